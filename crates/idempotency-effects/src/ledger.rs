//! The durable intent ledger: the one place the rules of docs/protocol.md#side-effects are written, per backend.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

/// The mark of an operation's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mark {
    /// Attempts may run its steps.
    Live,
    /// The reaper took it for a rollback: no attempt may take, send or record anything more.
    RollingBack,
    /// Rolled back; kept, compact, until the retention.
    RolledBack,
    /// Finished; kept, compact, until the retention.
    Finished,
}

impl Mark {
    /// The stored number: 0 live, 1 rolling back, 2 rolled back, 3 finished.
    pub fn as_i64(self) -> i64 {
        match self {
            Self::Live => 0,
            Self::RollingBack => 1,
            Self::RolledBack => 2,
            Self::Finished => 3,
        }
    }

    /// Parses the stored number.
    pub fn from_i64(n: i64) -> Option<Self> {
        Some(match n {
            0 => Self::Live,
            1 => Self::RollingBack,
            2 => Self::RolledBack,
            3 => Self::Finished,
            _ => return None,
        })
    }
}

/// The state of an intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IntentState {
    /// Recorded; its call is sent or about to be, and may have happened.
    Pending,
    /// A long-running effect the downstream accepted; a watcher polls it.
    Accepted,
    /// Done; `resource_id` is what it made.
    Done,
    /// Definitely did not happen (a definite refusal, or a long-running effect that failed).
    Failed,
}

impl IntentState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Accepted => "accepted",
            Self::Done => "done",
            Self::Failed => "failed",
        }
    }

    /// Parses the stored name.
    pub fn from_stored(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "accepted" => Self::Accepted,
            "done" => Self::Done,
            "failed" => Self::Failed,
            _ => return None,
        })
    }
}

/// An operation: the side effects of one idempotency record, and what the reaper needs to find
/// that record again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationRow {
    /// The record's derived sub-key `op`.
    pub op_id: String,
    /// What the operation is (`create-record`); for logs and the service.
    pub kind: String,
    /// The record's principal.
    pub principal: String,
    /// The record's endpoint (`POST /v1/records`).
    pub endpoint: String,
    /// The client's idempotency key.
    pub idem_key: String,
    /// The record's id, hex.
    pub record_id: String,
    /// What the operation acts on, as the service names it ([`crate::Operation::with_subject`]):
    /// leasebroker's deletes name their worker. `None` when it names none, and for rows begun
    /// before the column existed.
    pub subject: Option<String>,
    /// The mark.
    pub mark: Mark,
    /// When the last attempt started a step (µs since the epoch).
    pub last_attempt_at: i64,
    /// When the reaper looks at it next (µs since the epoch).
    pub next_check_at: i64,
}

impl OperationRow {
    /// The row that fences off the operation `op_id` (of `kind`) whose request never reached the
    /// ledger's first step: marked rolling back, as of `now` (µs), never looked at by the reaper
    /// again. What [`Ledger::take_unbegun`] inserts.
    pub fn unbegun(op_id: &str, kind: &str, now: i64) -> Self {
        Self {
            op_id: op_id.to_owned(),
            kind: kind.to_owned(),
            principal: String::new(),
            endpoint: String::new(),
            idem_key: String::new(),
            record_id: String::new(),
            subject: None,
            mark: Mark::RollingBack,
            last_attempt_at: now,
            next_check_at: i64::MAX,
        }
    }
}

/// An intent: one side effect of an operation, recorded before its call is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    /// The derived sub-key, also the tag sent downstream.
    pub intent_id: String,
    /// Its operation.
    pub op_id: String,
    /// The effect's name.
    pub effect: String,
    /// Whether a finished operation keeps its resource (see [`crate::Effect::keeps`]).
    pub keeps: bool,
    /// Its state.
    pub state: IntentState,
    /// What it made downstream, once known.
    pub resource_id: Option<String>,
    /// When it was recorded (µs since the epoch).
    pub created_at: i64,
    /// The send stamp: the moment its last call was (or is about to be) sent (µs).
    pub sent_at: i64,
    /// Who watches it (an accepted long-running effect).
    pub watcher: Option<String>,
    /// Until when the watcher's lease holds (µs).
    pub watch_until: i64,
}

/// Who owns a resource found downstream under a tag, as the ledger knows it
/// ([`Ledger::ownership`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ownership {
    /// An operation of this ledger keeps it.
    Owned,
    /// This ledger issued its tag and nothing owns it: an orphan, or a duplicate of a kept one.
    Unowned,
    /// This ledger never issued its tag (or forgot it after the retention): another service's,
    /// on a downstream two services share. The sweep leaves it alone.
    Foreign,
}

/// What [`Ledger::decide`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// No intent existed: this call recorded it, with its send stamp (`intent.sent_at`). The
    /// insert was the compare-and-set from "no intent": this attempt, and only it, may send,
    /// if the commit came back before the stamped moment.
    Fresh(Intent),
    /// An earlier (or overlapping) attempt recorded it; as read in the transaction.
    Existing(Intent),
}

/// An error of a ledger.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The database failed (or could not be reached). Nothing can be concluded.
    #[error("the effect ledger is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The operation finished (an overlapping attempt or the reaper ended it): this attempt
    /// must not start anything again.
    #[error("the operation finished; this attempt stops")]
    Finished,
    /// The operation was taken for a rollback or rolled back: this attempt must not take, send
    /// or record anything more.
    #[error("the operation was abandoned and is rolled back; this attempt stops")]
    RolledBack,
    /// A row could not be read back.
    #[error("corrupt ledger row: {0}")]
    Corrupt(String),
}

impl LedgerError {
    /// The error of a step refused by `mark` (`None`: there is no row).
    pub fn refused_by(mark: Option<Mark>) -> Self {
        match mark {
            Some(Mark::Finished) => Self::Finished,
            _ => Self::RolledBack,
        }
    }
}

/// What a new intent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewIntent {
    /// The derived sub-key (the tag).
    pub intent_id: String,
    /// The effect's name.
    pub effect: String,
    /// See [`crate::Effect::keeps`].
    pub keeps: bool,
}

/// Durable intents and operation marks. Every method is one transaction, and every step of an
/// operation checks the operation's mark *in its own transaction* (on PostgreSQL a lock on the
/// row, on SQLite the write lock), so a finish or a rollback and a step are always ordered.
///
/// Implementations: [`crate::MemoryLedger`], [`crate::SqlLedger`] (SQLite, PostgreSQL). All pass
/// the conformance suite (feature `conformance`, [`crate::ledger_conformance_suite!`]).
#[async_trait]
pub trait Ledger: Send + Sync + fmt::Debug + 'static {
    /// The first step of every effect of an attempt, one transaction: records that an attempt
    /// of `op` runs now (inserts its row, or moves `last_attempt_at` and `next_check_at`; a row
    /// marked rolled back or finished is never revived: [`LedgerError::Finished`] /
    /// [`LedgerError::RolledBack`]), then reads the intent, or records it pending with a send
    /// stamp `ahead` of the clock taken once the transaction holds its lock.
    async fn decide(&self, op: &OperationRow, intent: &NewIntent, ahead: Duration) -> Result<Decided, LedgerError>;

    /// Takes the right to send the call of a pending or failed intent: moves its send stamp
    /// from `seen` (what the caller read and decided from) to a new one, `ahead` of the clock
    /// once the transaction holds its lock, by compare-and-set; fenced on the operation.
    /// `None` when the stamp moved since it was read (another attempt acted): send nothing.
    async fn stamp(&self, op_id: &str, intent_id: &str, seen: i64, ahead: Duration)
    -> Result<Option<i64>, LedgerError>;

    /// Decides which resource a pending intent adopts, fenced on the operation: the one it
    /// records already (an overlapping attempt adopted one), or else `candidate`, recorded now.
    async fn adopt(&self, op_id: &str, intent_id: &str, candidate: &str) -> Result<String, LedgerError>;

    /// Records what a sent call made: a pending intent becomes `state` (done or accepted) with
    /// `resource_id` (the first one recorded wins; returned). Recorded even when the operation
    /// is no longer live (the reaper reconciles by it), but then errs with its mark.
    async fn record(
        &self,
        op_id: &str,
        intent_id: &str,
        resource_id: &str,
        state: IntentState,
    ) -> Result<String, LedgerError>;

    /// A definite refusal of the call sent under the send stamp `sent_at`: the pending intent is
    /// marked failed (that call did not happen, so a retry may send at once), by compare-and-set
    /// on the stamp. False when it was not pending, or its stamp moved since (a newer attempt
    /// sent again: its call may still land, so the intent stays pending).
    async fn release(&self, intent_id: &str, sent_at: i64) -> Result<bool, LedgerError>;

    /// Finishes a live operation, one transaction: marks it finished (kept until the
    /// retention), keeps ownership of the resources of its done intents that keep theirs,
    /// deletes its intents but the accepted ones (their watcher ends them). Errs with
    /// [`LedgerError::Finished`] when it was finished already, [`LedgerError::RolledBack`] when
    /// the reaper took it.
    async fn finish(&self, op_id: &str, now: i64) -> Result<(), LedgerError>;

    /// The operation, if its row exists.
    async fn operation(&self, op_id: &str) -> Result<Option<OperationRow>, LedgerError>;

    /// The intent `intent_id` (a tag), if it exists.
    async fn intent(&self, intent_id: &str) -> Result<Option<Intent>, LedgerError>;

    /// The operation's intents.
    async fn intents(&self, op_id: &str) -> Result<Vec<Intent>, LedgerError>;

    /// Up to `limit` operations due for the reaper (`next_check_at <= now`, live or rolling
    /// back): the `limit / 2` due longest and the `limit / 2` due last, so a backlog never
    /// delays a row that just fell due while it drains from its oldest end.
    async fn due(&self, now: i64, limit: u32) -> Result<Vec<OperationRow>, LedgerError>;

    /// Puts off the reaper's next look at `op_id` until `at`.
    async fn put_off(&self, op_id: &str, at: i64) -> Result<(), LedgerError>;

    /// Takes a live operation for a rollback by compare-and-set on the `last_attempt_at` the
    /// reaper decided from: false when an attempt ran a step since, or it is not live.
    async fn take_for_rollback(&self, op_id: &str, seen_last_attempt: i64) -> Result<bool, LedgerError>;

    /// Takes for a rollback an operation that never began in the ledger (the service recorded
    /// its own row first, and the request that would have begun it was abandoned before): inserts
    /// `op` marked rolling back, so no late attempt can begin it. False when the operation exists
    /// (an attempt began it meanwhile: look at it as it is).
    async fn take_unbegun(&self, op: &OperationRow) -> Result<bool, LedgerError>;

    /// Ends a rollback, one transaction: deletes the intents, marks the row rolled back (kept
    /// until the retention). False when it was not rolling back.
    async fn rolled_back(&self, op_id: &str, now: i64) -> Result<bool, LedgerError>;

    /// Deletes operations marked rolled back or finished before `before`, with their intents
    /// (but one with an accepted intent still being watched). Returns rows deleted.
    async fn prune(&self, before: i64) -> Result<u64, LedgerError>;

    /// Who owns the downstream resource `resource_id` tagged `tag`, for the inventory sweep, in
    /// one snapshot. [`Ownership::Owned`]: a finished operation keeps it, or the intent `tag`
    /// exists and its operation is live or being rolled back, or it is accepted, or its last send
    /// is later than `settled_before`. [`Ownership::Unowned`]: this ledger issued `tag` (its
    /// intent is there, or its operation finished or was rolled back within the retention) and
    /// nothing owns the resource. [`Ownership::Foreign`]: this ledger never issued `tag`.
    async fn ownership(&self, tag: &str, resource_id: &str, settled_before: i64) -> Result<Ownership, LedgerError>;

    /// The service deleted the resource `resource_id`: no operation owns it any more (its tag is
    /// still known as issued here until the retention). Returns rows removed.
    async fn disown(&self, resource_id: &str) -> Result<u64, LedgerError>;

    /// Up to `limit` accepted intents whose watch lease expired before `now` or is held by
    /// `watcher`, the least recently watched first.
    async fn to_watch(&self, watcher: &str, now: i64, limit: u32) -> Result<Vec<Intent>, LedgerError>;

    /// Takes (or renews) the watch lease on an accepted intent for `watcher` until `until`, by
    /// compare-and-set on the lease as read (`seen_until`): of several watchers that read one
    /// expired lease, one takes it.
    async fn take_watch(
        &self,
        intent_id: &str,
        watcher: &str,
        seen_until: i64,
        until: i64,
    ) -> Result<bool, LedgerError>;

    /// Ends an accepted intent watched by `watcher`: done or failed. False when it was not
    /// accepted or another watcher holds it.
    async fn conclude(&self, intent_id: &str, watcher: &str, state: IntentState) -> Result<bool, LedgerError>;

    /// For tests and benchmarks: inserts `rows` as they are, in bulk.
    #[doc(hidden)]
    async fn insert_operations(&self, rows: &[OperationRow]) -> Result<(), LedgerError>;
}
