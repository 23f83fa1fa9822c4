//! Running a side effect at most once per derived sub-key: [`Effects`], [`Operation`],
//! [`Attempt::run`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Record, RecordId, Scope, SubKey};

use crate::effect::{CallError, Effect, Sent};
use crate::ledger::{Decided, Intent, IntentState, Ledger, LedgerError, Mark, NewIntent, OperationRow};
use crate::{micros, now_micros};

/// How long a sent call may still take effect downstream, by default: 30 s.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(30);
/// How far ahead of the clock a send stamp lies, by default: 1 s (the longest the stamp's
/// commit may take for the call still to be sent).
pub const DEFAULT_SEND_AHEAD: Duration = Duration::from_secs(1);
/// How many times a send stamp whose commit came back late is taken again before the call is
/// given up ([`EffectError::SlowCommit`]).
const RESTAMPS: usize = 3;

/// The side-effect runner of a service: a ledger and the two durations of the rules.
#[derive(Debug, Clone)]
pub struct Effects {
    ledger: Arc<dyn Ledger>,
    settle: Duration,
    send_ahead: Duration,
}

impl Effects {
    /// A runner on `ledger` with [`DEFAULT_SETTLE`] and [`DEFAULT_SEND_AHEAD`].
    pub fn new(ledger: Arc<dyn Ledger>) -> Self {
        Self { ledger, settle: DEFAULT_SETTLE, send_ahead: DEFAULT_SEND_AHEAD }
    }

    /// The settle window: the longest a sent call may take to take effect downstream. It must
    /// be longer than the call's timeout (a call that timed out may still land).
    pub fn settle(mut self, settle: Duration) -> Self {
        self.settle = settle;
        self
    }

    /// How far ahead of the clock the send stamp lies (see [`DEFAULT_SEND_AHEAD`]).
    pub fn send_ahead(mut self, ahead: Duration) -> Self {
        self.send_ahead = ahead;
        self
    }

    /// The ledger.
    pub fn ledger(&self) -> &Arc<dyn Ledger> {
        &self.ledger
    }

    /// The settle window.
    pub fn settle_window(&self) -> Duration {
        self.settle
    }

    /// Errs with [`EffectError::Settling`] while the last call of the pending `intent` may
    /// still land (the settle window since its send stamp has not passed): for a service that
    /// reconciles a long-running effect itself before deciding anything more.
    pub fn settling(&self, intent: &Intent) -> Result<(), EffectError> {
        if intent.state != IntentState::Pending {
            return Ok(());
        }
        settled_since(&intent.intent_id, intent.sent_at, self.settle)
    }

    /// An attempt of `op`: one run of a handler.
    pub fn attempt(&self, op: &Operation) -> Attempt {
        Attempt { effects: self.clone(), op: op.clone() }
    }
}

/// The operation of one idempotency record: what its side effects are keyed off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    scope: Scope,
    record_id: RecordId,
    kind: String,
    op_id: SubKey,
    subject: Option<String>,
}

impl Operation {
    /// The operation of `record` (from the claim a handler runs under:
    /// `ctx.claim().record()` with `idempotency-tower`); `kind` names it in logs.
    pub fn of(record: &Record, kind: &str) -> Self {
        Self::new(record.scope.clone(), record.record_id, kind)
    }

    /// The operation of the record with `scope` and `record_id`.
    pub fn new(scope: Scope, record_id: RecordId, kind: &str) -> Self {
        let op_id = idempotency::derive(&scope, &record_id, "op");
        Self { scope, record_id, kind: kind.to_owned(), op_id, subject: None }
    }

    /// Names what the operation acts on (a worker id, a record name), kept on its row
    /// ([`OperationRow::subject`]) for the reaper and the service: read back, not parsed out of
    /// the endpoint.
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// The operation's id: the record's sub-key `op`.
    pub fn id(&self) -> &str {
        self.op_id.as_str()
    }

    /// The sub-key of the side effect `label` (an effect's tag is `derive(effect.name())`).
    pub fn derive(&self, label: &str) -> SubKey {
        idempotency::derive(&self.scope, &self.record_id, label)
    }

    /// The record's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    fn row(&self, now: i64, next_check_at: i64) -> OperationRow {
        OperationRow {
            op_id: self.op_id.to_string(),
            kind: self.kind.clone(),
            principal: self.scope.principal.as_str().to_owned(),
            endpoint: self.scope.endpoint.as_str().to_owned(),
            idem_key: self.scope.key.as_str().to_owned(),
            record_id: self.record_id.to_hex(),
            subject: self.subject.clone(),
            mark: Mark::Live,
            last_attempt_at: now,
            next_check_at,
        }
    }
}

/// What a side effect came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It happened (now, or in an earlier attempt); the downstream's id.
    Done(String),
    /// A long-running effect was accepted (now or earlier) and finishes later; its id.
    Accepted(String),
}

impl Outcome {
    /// The downstream's id.
    pub fn id(&self) -> &str {
        match self {
            Self::Done(id) | Self::Accepted(id) => id,
        }
    }

    /// The intent's state that records it.
    pub(crate) fn state(&self) -> IntentState {
        match self {
            Self::Done(_) => IntentState::Done,
            Self::Accepted(_) => IntentState::Accepted,
        }
    }

    /// The same outcome with the id `id`.
    fn with_id(&self, id: String) -> Self {
        match self {
            Self::Done(_) => Self::Done(id),
            Self::Accepted(_) => Self::Accepted(id),
        }
    }
}

/// What an effect came to under [`Attempt::run_decided_unrecorded`]: its outcome, and whether
/// the call that made it was sent by this attempt and is not recorded yet. Recorded by the
/// transaction that finishes the operation ([`Attempt::finish_made_in_sqlite`] /
/// [`Attempt::finish_made_in_postgres`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Made {
    outcome: Outcome,
    /// The intent's tag, when this attempt's call made the outcome and nothing recorded it.
    unrecorded: Option<String>,
}

impl Made {
    /// The outcome, as this attempt knows it (the finishing transaction may find that another
    /// attempt recorded another id first: [`Attempt::finish_made_in_postgres`] returns that one).
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// What the finishing transaction records, when anything.
    fn to_record(&self) -> Option<(&str, &Outcome)> {
        self.unrecorded.as_deref().map(|tag| (tag, &self.outcome))
    }

    /// The outcome as the finishing transaction found it recorded (`recorded`: the id the
    /// intent held after the record, `None` when it was not recorded there).
    fn recorded_as(&self, recorded: Option<String>) -> Outcome {
        match recorded {
            Some(id) if self.unrecorded.is_some() => self.outcome.with_id(id),
            _ => self.outcome.clone(),
        }
    }
}

/// Why a side effect did not come to an outcome, shaped by what the caller does next: the
/// retryable ones answer `503` with [`EffectError::retry_after`], a refusal `502` (not stored:
/// the retry may succeed), and a finished or rolled-back operation ends the attempt.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EffectError {
    /// An earlier attempt's call may still land: nothing found by tag, and the settle window
    /// has not passed since it was sent. Nothing was sent.
    #[error("an earlier attempt's call may still take effect; retry with the same key in {retry_after} s")]
    Settling {
        /// Seconds until the window has passed.
        retry_after: u64,
    },
    /// Another attempt of the same operation acted on the call since this one read it (the send
    /// stamp's compare-and-set moved). Nothing was sent.
    #[error("another attempt of this request is calling the downstream; retry with the same key")]
    Contended,
    /// The send stamp's commit came back after the stamped moment, every time it was taken
    /// again; nothing was sent, and the retry waits out the settle window from the stamp.
    #[error("the ledger was too slow to record the call before sending it; nothing was sent")]
    SlowCommit,
    /// The downstream could not be asked what an earlier attempt did.
    #[error("cannot ask the downstream what an earlier attempt did")]
    CannotProbe(#[source] CallError),
    /// The call may have happened; the intent stays pending.
    #[error("the downstream call may or may not have taken effect")]
    Ambiguous(#[source] CallError),
    /// The downstream definitely did nothing; the intent was released (a retry calls again).
    #[error("the downstream refused the call")]
    Refused(#[source] CallError),
    /// The operation finished (another attempt, or the reaper, ended it): this attempt stops.
    #[error("the operation finished; this attempt stops")]
    Finished,
    /// The operation was abandoned and is rolled back: this attempt stops.
    #[error("the operation was rolled back; this attempt stops")]
    RolledBack,
    /// The ledger failed.
    #[error("the effect ledger failed")]
    Ledger(#[source] LedgerError),
}

impl From<LedgerError> for EffectError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Finished => Self::Finished,
            LedgerError::RolledBack => Self::RolledBack,
            e => Self::Ledger(e),
        }
    }
}

impl EffectError {
    /// Seconds after which a retry with the same key may get further, for the errors a retry
    /// may fix (`Retry-After` on the 503); `None` for a refusal or an ended operation.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::Settling { retry_after } => Some(*retry_after),
            Self::Contended | Self::SlowCommit | Self::CannotProbe(_) | Self::Ambiguous(_) | Self::Ledger(_) => Some(1),
            Self::Refused(_) | Self::Finished | Self::RolledBack => None,
        }
    }
}

/// One run of a handler of an [`Operation`].
#[derive(Debug, Clone)]
pub struct Attempt {
    effects: Effects,
    op: Operation,
}

impl Attempt {
    /// The operation.
    pub fn operation(&self) -> &Operation {
        &self.op
    }

    /// Makes `effect` happen at most once for this operation. `send` makes the downstream call
    /// with the tag it is given stamped into it (the tag is `op.derive(effect.name())`).
    ///
    /// - No intent yet: it is recorded with its send stamp (one transaction, fenced), and
    ///   `send` runs if that commit came back before the stamped moment; one that came back
    ///   after it is stamped again (nothing was sent), a few times, before the attempt gives up.
    /// - Done or accepted by an earlier attempt: its outcome, nothing sent.
    /// - Pending (an earlier call may have happened): `probe(tag)`; what exists is adopted
    ///   (the lowest id, decided in the ledger; any other with the tag is undone); nothing found
    ///   before the settle window has passed since the last send answers
    ///   [`EffectError::Settling`]; after it, the stamp is moved by compare-and-set and the call
    ///   sent again.
    /// - Failed (definitely did not happen): the stamp is moved and the call sent again at once.
    ///
    /// A definite error of `send` releases the intent ([`EffectError::Refused`]); an ambiguous
    /// one leaves it pending ([`EffectError::Ambiguous`]).
    pub async fn run<F, Fut>(&self, effect: &dyn Effect, send: F) -> Result<Outcome, EffectError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Sent, CallError>>,
    {
        let decided = self.decide(effect).await?;
        self.run_decided(effect, decided, send).await
    }

    /// The first step of [`Attempt::run`] alone ([`Ledger::decide`]): records the attempt and
    /// reads the effect's intent, or records it with its send stamp. Go on with
    /// [`Attempt::run_decided`] (a service does its own steps in between).
    pub async fn decide(&self, effect: &dyn Effect) -> Result<Decided, EffectError> {
        let (row, new) = self.first_step(effect);
        Ok(self.effects.ledger.decide(&row, &new, self.effects.send_ahead).await?)
    }

    #[cfg(feature = "sqlite")]
    /// The first step of `effect` ([`Ledger::decide`]) inside the caller's own SQLite
    /// transaction (`BEGIN IMMEDIATE`), so the service's rows and the intent are one commit.
    /// After the commit, go on with [`Attempt::run_decided`]: the send stamp is checked then.
    /// The attempt's ledger must be an [`crate::SqlLedger`] on the same database.
    pub async fn decide_in_sqlite(
        &self,
        conn: &mut sqlx::SqliteConnection,
        effect: &dyn Effect,
    ) -> Result<Decided, EffectError> {
        let (row, new) = self.first_step(effect);
        Ok(crate::sql::decide_in_sqlite(conn, &row, &new, self.effects.send_ahead).await?)
    }

    #[cfg(feature = "postgres")]
    /// As [`Attempt::decide_in_sqlite`], in the caller's own PostgreSQL transaction.
    pub async fn decide_in_postgres(
        &self,
        conn: &mut sqlx::PgConnection,
        effect: &dyn Effect,
    ) -> Result<Decided, EffectError> {
        let (row, new) = self.first_step(effect);
        Ok(crate::sql::decide_in_postgres(conn, &row, &new, self.effects.send_ahead).await?)
    }

    /// The rest of [`Attempt::run`] after its first step, `decided` (by [`Ledger::decide`], or
    /// in the caller's transaction, committed).
    pub async fn run_decided<F, Fut>(
        &self,
        effect: &dyn Effect,
        decided: Decided,
        send: F,
    ) -> Result<Outcome, EffectError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Sent, CallError>>,
    {
        Ok(self.run_from(effect, decided, send, true).await?.outcome)
    }

    /// As [`Attempt::run_decided`], except that what a call sent by this attempt made is not
    /// recorded on its own: the transaction that finishes the operation with the service's
    /// result records it ([`Attempt::finish_made_in_sqlite`] /
    /// [`Attempt::finish_made_in_postgres`]), one commit fewer per effect. A process that stops
    /// between the call and that commit leaves the intent pending with its send stamp, as one
    /// that stopped between the call and its record would: the next attempt reconciles by tag.
    /// For the last effect of an operation, right before it finishes.
    pub async fn run_decided_unrecorded<F, Fut>(
        &self,
        effect: &dyn Effect,
        decided: Decided,
        send: F,
    ) -> Result<Made, EffectError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Sent, CallError>>,
    {
        self.run_from(effect, decided, send, false).await
    }

    /// [`Attempt::run_decided`]; `record`: whether a call sent now is recorded at once.
    async fn run_from<F, Fut>(
        &self,
        effect: &dyn Effect,
        decided: Decided,
        send: F,
        record: bool,
    ) -> Result<Made, EffectError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Sent, CallError>>,
    {
        let ledger = &self.effects.ledger;
        let tag = self.op.derive(effect.name()).to_string();
        let recorded = |outcome| Made { outcome, unrecorded: None };
        let intent = match decided {
            Decided::Fresh(intent) => {
                let stamp = self.in_time(&tag, intent.sent_at).await?;
                return self.send(&tag, stamp, send, record).await;
            }
            Decided::Existing(intent) => intent,
        };
        match intent.state {
            IntentState::Done => return Ok(recorded(Outcome::Done(intent.resource_id.unwrap_or_default()))),
            IntentState::Accepted => return Ok(recorded(Outcome::Accepted(intent.resource_id.unwrap_or_default()))),
            IntentState::Pending => {
                if let Some(outcome) = self.adopt(effect, &intent).await? {
                    return Ok(recorded(outcome));
                }
                if !effect.idempotent() {
                    settled_since(&tag, intent.sent_at, self.effects.settle)?;
                }
            }
            IntentState::Failed => {} // that call definitely did not happen
        }
        let stamp = ledger.stamp(self.op.id(), &tag, intent.sent_at, self.effects.send_ahead).await?;
        let Some(stamp) = stamp else {
            tracing::warn!(tag, "another attempt acted on this call since it was read; not sending it");
            return Err(EffectError::Contended);
        };
        let stamp = self.in_time(&tag, stamp).await?;
        self.send(&tag, stamp, send, record).await
    }

    /// Makes sure the call goes out before its send stamp `stamp`: when the stamp's commit came
    /// back after the stamped moment (a queue for the disk), nothing was sent, so the stamp is
    /// moved ahead again by compare-and-set, at most [`RESTAMPS`] times. Returns the stamp the
    /// call goes out under. [`EffectError::SlowCommit`] when every commit came back late;
    /// [`EffectError::Contended`] when another attempt moved the stamp meanwhile.
    async fn in_time(&self, tag: &str, mut stamp: i64) -> Result<i64, EffectError> {
        for _ in 0..RESTAMPS {
            if now_micros() < stamp {
                return Ok(stamp);
            }
            tracing::info!(tag, "recording the call took longer than its send stamp allows; stamping it again");
            match self.effects.ledger.stamp(self.op.id(), tag, stamp, self.effects.send_ahead).await? {
                Some(next) => stamp = next,
                None => {
                    tracing::warn!(tag, "another attempt acted on this call since it was stamped; not sending it");
                    return Err(EffectError::Contended);
                }
            }
        }
        if now_micros() >= stamp {
            tracing::warn!(tag, "recording the call took too long, every time; not sending it");
            return Err(EffectError::SlowCommit);
        }
        Ok(stamp)
    }

    /// The operation's row for this attempt and the effect's new intent.
    fn first_step(&self, effect: &dyn Effect) -> (OperationRow, NewIntent) {
        let now = now_micros();
        let row = self.op.row(now, now.saturating_add(micros(self.effects.settle)));
        let tag = self.op.derive(effect.name()).to_string();
        (row, NewIntent { intent_id: tag, effect: effect.name().to_owned(), keeps: effect.keeps() })
    }

    /// Marks the operation finished: no attempt can start it again, the resources of its done
    /// effects that keep theirs stay owned (the inventory sweep leaves them), its intents go
    /// (but accepted ones, which their watcher ends). Call it before answering.
    pub async fn finish(&self) -> Result<(), EffectError> {
        Ok(self.effects.ledger.finish(self.op.id(), now_micros()).await?)
    }

    #[cfg(feature = "sqlite")]
    /// [`Attempt::finish`] inside the caller's own SQLite transaction, so the service's result
    /// (a worker row) and the operation's end are one commit. Run it first in the transaction:
    /// its write is the fence. Errs with [`EffectError::Finished`] / [`EffectError::RolledBack`]
    /// when the operation is not live (roll the transaction back then).
    pub async fn finish_in_sqlite(&self, conn: &mut sqlx::SqliteConnection) -> Result<(), EffectError> {
        crate::sql::finish_in_sqlite(conn, self.op.id(), now_micros(), None).await?;
        Ok(())
    }

    #[cfg(feature = "postgres")]
    /// As [`Attempt::finish_in_sqlite`], in the caller's own PostgreSQL transaction.
    pub async fn finish_in_postgres(&self, conn: &mut sqlx::PgConnection) -> Result<(), EffectError> {
        crate::sql::finish_in_postgres(conn, self.op.id(), now_micros(), None).await?;
        Ok(())
    }

    #[cfg(feature = "sqlite")]
    /// [`Attempt::finish_in_sqlite`] that also records what `made` is, when this attempt's call
    /// made it ([`Attempt::run_decided_unrecorded`]): the record, the service's result and the
    /// operation's end are one commit. Returns the outcome as recorded: the first id recorded
    /// wins, so it names another resource when an overlapping attempt recorded one first (the
    /// service's result must point at that one; undo this attempt's with
    /// [`Attempt::undo_unkept`] after the commit).
    ///
    /// On [`EffectError::Finished`] / [`EffectError::RolledBack`], commit the transaction still
    /// (with nothing of the service's written): the record is in it, and the reaper reconciles
    /// by it.
    pub async fn finish_made_in_sqlite(
        &self,
        conn: &mut sqlx::SqliteConnection,
        made: &Made,
    ) -> Result<Outcome, EffectError> {
        let recorded = crate::sql::finish_in_sqlite(conn, self.op.id(), now_micros(), made.to_record()).await?;
        Ok(made.recorded_as(recorded))
    }

    #[cfg(feature = "postgres")]
    /// As [`Attempt::finish_made_in_sqlite`], in the caller's own PostgreSQL transaction.
    pub async fn finish_made_in_postgres(
        &self,
        conn: &mut sqlx::PgConnection,
        made: &Made,
    ) -> Result<Outcome, EffectError> {
        let recorded = crate::sql::finish_in_postgres(conn, self.op.id(), now_micros(), made.to_record()).await?;
        Ok(made.recorded_as(recorded))
    }

    /// A pending intent: what its earlier call made, adopted, if anything exists.
    async fn adopt(&self, effect: &dyn Effect, intent: &Intent) -> Result<Option<Outcome>, EffectError> {
        let tag = intent.intent_id.as_str();
        let found = effect.probe(tag).await.map_err(|e| {
            tracing::warn!(tag, error = %e, "cannot probe the downstream to reconcile an earlier call");
            EffectError::CannotProbe(e)
        })?;
        let Some(first) = found.iter().min() else { return Ok(None) };
        let ledger = &self.effects.ledger;
        let keep = ledger.adopt(self.op.id(), tag, first).await?;
        for extra in found.iter().filter(|id| **id != keep) {
            undo_duplicate(effect, tag, &keep, extra).await;
        }
        let state = if effect.long_running() { IntentState::Accepted } else { IntentState::Done };
        let recorded = ledger.record(self.op.id(), tag, &keep, state).await?;
        tracing::info!(tag, resource = %recorded, "adopted what an earlier attempt's call made");
        Ok(Some(if effect.long_running() { Outcome::Accepted(recorded) } else { Outcome::Done(recorded) }))
    }

    /// Sends the call under the send stamp `stamp`; what it made is recorded at once when
    /// `record`, else left to the finishing transaction ([`Made`]). A definite refusal releases
    /// the intent only while its stamp is still `stamp`: when another attempt has sent again
    /// since, that newer call keeps its intent pending.
    async fn send<F, Fut>(&self, tag: &str, stamp: i64, send: F, record: bool) -> Result<Made, EffectError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Sent, CallError>>,
    {
        let ledger = &self.effects.ledger;
        let made = match send(tag.to_owned()).await {
            Ok(Sent::Done(id)) => Outcome::Done(id),
            Ok(Sent::Accepted(id)) => Outcome::Accepted(id),
            Err(e) if e.is_definite() => {
                if ledger.release(tag, stamp).await? {
                    tracing::info!(tag, error = %e, "the downstream refused the call; intent released");
                } else {
                    tracing::info!(tag, error = %e, "the downstream refused the call; a newer call is pending, kept");
                }
                return Err(EffectError::Refused(e));
            }
            Err(e) => {
                tracing::warn!(tag, error = %e, "the downstream call may or may not have taken effect");
                return Err(EffectError::Ambiguous(e));
            }
        };
        if !record {
            return Ok(Made { outcome: made, unrecorded: Some(tag.to_owned()) });
        }
        let recorded = ledger.record(self.op.id(), tag, made.id(), made.state()).await?;
        Ok(Made { outcome: made.with_id(recorded), unrecorded: None })
    }

    /// After the finishing transaction's commit: when another attempt recorded another resource
    /// for the effect first (`recorded`, as [`Attempt::finish_made_in_postgres`] returned it),
    /// the one this attempt's call made is a duplicate, undone now (else the inventory sweep
    /// would, after the settle window).
    pub async fn undo_unkept(&self, effect: &dyn Effect, made: &Made, recorded: &Outcome) {
        if let Some(tag) = &made.unrecorded
            && recorded.id() != made.outcome.id()
        {
            undo_duplicate(effect, tag, recorded.id(), made.outcome.id()).await;
        }
    }
}

/// Undoes a second resource with one tag (a call that landed after the settle window).
pub(crate) async fn undo_duplicate(effect: &dyn Effect, tag: &str, keep: &str, extra: &str) {
    if !effect.can_undo() {
        tracing::warn!(tag, kept = keep, extra, "a second resource for one effect, and the effect cannot be undone");
        return;
    }
    match effect.undo(extra).await {
        Ok(existed) => {
            tracing::warn!(
                tag,
                kept = keep,
                extra,
                existed,
                "a second resource for one effect (a call landed after the settle window): undone; \
                 the settle window is shorter than the downstream takes"
            );
            if existed {
                effect.undone(tag, extra, &crate::Undone::Duplicate { kept: keep.to_owned() });
            }
        }
        Err(e) => tracing::warn!(tag, extra, error = %e, "undoing a duplicate failed; the inventory sweep retries"),
    }
}

/// Errs with [`EffectError::Settling`] while a call sent at `sent_at` may still land.
fn settled_since(tag: &str, sent_at: i64, settle: Duration) -> Result<(), EffectError> {
    let settle = micros(settle);
    let waited = now_micros().saturating_sub(sent_at);
    if waited < settle {
        let left = ((settle - waited) + 999_999) / 1_000_000;
        tracing::info!(tag, left_s = left, "an earlier call may still land; waiting");
        return Err(EffectError::Settling { retry_after: u64::try_from(left).unwrap_or(1).max(1) });
    }
    Ok(())
}
