//! The reaper: abandoned operations rolled back (or finished, or kept, as the service says),
//! finished ones marked; fair and bounded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Endpoint, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, Store};

use crate::effect::Effect;
use crate::ledger::{Ledger, LedgerError, Mark, OperationRow};
use crate::{micros, now_micros};

mod abandoned;
mod rollback;

use abandoned::BoxError;
pub use abandoned::{Abandoned, Disposal};

/// The reaper's durations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaperConfig {
    /// The settle window of the runner ([`crate::Effects::settle`]).
    pub settle: Duration,
    /// How long an operation goes without an attempt before it counts as abandoned.
    pub abandon_after: Duration,
    /// The idempotency layer's in-flight TTL (a claim older than this is stale).
    pub in_flight_ttl: Duration,
    /// The record retention: how long a reclaimed record lives at most, and how long rolled-back
    /// and finished marks are kept before [`Reaper::tick`] prunes them. Added to a timestamp
    /// with saturation: `Duration::MAX` keeps them for ever.
    pub retention: Duration,
    /// The most operations one tick looks at.
    pub batch: u32,
}

impl Default for ReaperConfig {
    fn default() -> Self {
        Self {
            settle: crate::DEFAULT_SETTLE,
            abandon_after: Duration::from_secs(3600),
            in_flight_ttl: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
            batch: 500,
        }
    }
}

/// What one tick did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Operations looked at (at most the batch).
    pub examined: u64,
    /// Put off until they may change (an attempt holds them, a call may still land, ...).
    pub waiting: u64,
    /// Rolled back (marked so by this reaper).
    pub rolled_back: u64,
    /// Marked finished: their record completed, the service's tables show them finished, the
    /// service finished them ([`Disposal::Finish`]), or a kept one's record is gone.
    pub finished: u64,
    /// Downstream resources undone by rollbacks.
    pub undone: u64,
    /// Operations left for a later tick after an error (a rollback that stopped half-way goes
    /// on from where it stopped).
    pub errors: u64,
    /// Marks pruned after the retention.
    pub pruned: u64,
}

/// The reaper of one service (run it on every replica: they never both act on one operation).
#[derive(Clone)]
pub struct Reaper {
    ledger: Arc<dyn Ledger>,
    store: Arc<dyn Store>,
    effects: HashMap<String, Arc<dyn Effect>>,
    service: Arc<dyn Abandoned>,
    config: ReaperConfig,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").field("ledger", &self.ledger).field("config", &self.config).finish_non_exhaustive()
    }
}

/// What the reaper came to on one operation.
enum Step {
    /// Nothing yet: look again at this moment (µs since the epoch).
    Waiting(i64),
    /// Rolled back (marked so by this reaper), with the resources undone.
    RolledBack(u64),
    /// Marked finished.
    Finished,
    /// Nothing more to do (another replica's reaper ended it first).
    Over,
}

impl Reaper {
    /// A reaper over `ledger`, finding records in `store`, undoing through `effects`; every
    /// abandoned operation is rolled back until [`Reaper::service`] says otherwise.
    pub fn new(
        ledger: Arc<dyn Ledger>,
        store: Arc<dyn Store>,
        effects: Vec<Arc<dyn Effect>>,
        config: ReaperConfig,
    ) -> Self {
        let effects = effects.into_iter().map(|e| (e.name().to_owned(), e)).collect();
        Self { ledger, store, effects, service: Arc::new(abandoned::RollBackAll), config }
    }

    /// What the service says about its operations: which way each kind ends, what it holds in
    /// its own tables (see [`Abandoned`]).
    pub fn service(mut self, service: Arc<dyn Abandoned>) -> Self {
        self.service = service;
        self
    }

    /// The reaper's durations.
    pub fn config(&self) -> &ReaperConfig {
        &self.config
    }

    /// One tick: at most `batch` due operations, each either put off until it may change (so it
    /// never comes up again before then and never delays another), rolled back, or marked
    /// finished; then the marks older than the retention are pruned. Errs only when the due
    /// operations cannot be read; an operation whose step failed is put off and counted in
    /// [`Pass::errors`].
    pub async fn tick(&self) -> Result<Pass, LedgerError> {
        let mut pass = Pass::default();
        for op in self.ledger.due(now_micros(), self.config.batch).await? {
            pass.examined += 1;
            let again = match self.look_at(&op).await {
                Ok(Step::Waiting(until)) => {
                    pass.waiting += 1;
                    Some(until)
                }
                Ok(Step::RolledBack(undone)) => {
                    pass.rolled_back += 1;
                    pass.undone += undone;
                    None
                }
                Ok(Step::Finished) => {
                    pass.finished += 1;
                    None
                }
                Ok(Step::Over) => None,
                Err(e) => {
                    pass.errors += 1;
                    tracing::warn!(op_id = %op.op_id, error = %e, "reaper: leaving the operation for a later tick");
                    Some(self.later(self.config.settle.max(Duration::from_secs(1))))
                }
            };
            if let Some(at) = again
                && let Err(e) = self.ledger.put_off(&op.op_id, at).await
            {
                pass.errors += 1;
                tracing::warn!(op_id = %op.op_id, error = %e, "reaper: cannot put off an operation");
            }
        }
        match self.ledger.prune(now_micros().saturating_sub(micros(self.config.retention))).await {
            Ok(n) => pass.pruned = n,
            Err(e) => tracing::warn!(error = %e, "reaper: pruning old marks failed; trying again next tick"),
        }
        Ok(pass)
    }

    /// Decides on one operation, and acts on it.
    async fn look_at(&self, op: &OperationRow) -> Result<Step, BoxError> {
        let c = &self.config;
        let disposal = self.service.disposal(op);
        if disposal == Disposal::Aside {
            return Ok(Step::Waiting(self.later(c.retention)));
        }
        let Some(scope) = scope_of(op) else {
            tracing::warn!(op_id = %op.op_id, "reaper: an operation row it cannot read; set aside");
            return Ok(Step::Waiting(self.later(c.retention)));
        };
        if op.mark == Mark::Live && disposal != Disposal::Watched {
            let abandoned_at = op.last_attempt_at.saturating_add(micros(c.abandon_after));
            if now_micros() < abandoned_at {
                return Ok(Step::Waiting(abandoned_at));
            }
        }
        let record = self.store.get(&scope).await?.filter(|r| r.record_id.to_hex() == op.record_id);
        let completed = record.as_ref().is_some_and(|r| r.state == RecordState::Completed);
        match disposal {
            Disposal::Watched if completed => return self.mark_finished(op).await,
            Disposal::Watched => return Ok(Step::Waiting(self.later(c.retention))),
            // Taken for a rollback by a tick that stopped half-way: the rollback goes on.
            _ if op.mark == Mark::RollingBack => return self.roll_back(op, &scope, record).await,
            _ => {}
        }
        let Some(r) = record else {
            // The record expired or was removed: nothing can retry this operation any more.
            return match disposal {
                Disposal::Finish => self.finish_abandoned(op, None).await,
                Disposal::Keep => self.mark_finished(op).await,
                _ => self.roll_back(op, &scope, None).await,
            };
        };
        if completed {
            return self.mark_finished(op).await;
        }
        if disposal == Disposal::Keep {
            return Ok(Step::Waiting(r.expires_at.timestamp_micros()));
        }
        if r.is_stale(idempotency::now(), c.in_flight_ttl) || r.state == RecordState::Failed {
            return match disposal {
                Disposal::Finish => self.finish_abandoned(op, Some(&r)).await,
                _ => self.roll_back(op, &scope, Some(r)).await,
            };
        }
        // An attempt holds the record: look again once its claim may be stale.
        let stale_at = idempotency::stale_after(r.started_at, c.in_flight_ttl).timestamp_micros();
        Ok(Step::Waiting(stale_at.max(now_micros() + 1)))
    }

    /// Marks `op` finished (an operation marked already is left as it is).
    async fn mark_finished(&self, op: &OperationRow) -> Result<Step, BoxError> {
        match self.ledger.finish(&op.op_id, now_micros()).await {
            Ok(()) => Ok(Step::Finished),
            Err(LedgerError::Finished | LedgerError::RolledBack) => Ok(Step::Over),
            Err(e) => Err(e.into()),
        }
    }

    /// Takes the record of an abandoned operation for the reaper's own attempt, by a reclaim as a
    /// retry's, with the time of the reclaim. `Ok(None)` when a retry (or another replica's
    /// reaper) took it first.
    async fn reclaim(&self, record: &Record) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
        let now = idempotency::now();
        let request = idempotency::ReclaimRequest {
            record,
            now,
            in_flight_ttl: self.config.in_flight_ttl,
            expires_at: idempotency::later(now, self.config.retention),
        };
        self.store.reclaim(request).await
    }

    /// Gives back the record's claim the reaper holds, failed, so a retry may take it at once
    /// (when the reaper stops short of its step); a failure here only leaves it to go stale.
    async fn give_back(&self, claim: Option<&idempotency::Claim>) {
        if let Some(claim) = claim
            && let Err(e) = self.store.fail(claim).await
        {
            tracing::warn!(error = %e, "reaper: cannot give back a record's claim; it goes stale");
        }
    }

    /// `d` from now, in µs since the epoch, saturating.
    fn later(&self, d: Duration) -> i64 {
        now_micros().saturating_add(micros(d))
    }
}

/// The record scope an operation row names, and its record id; `None` when they cannot be read.
fn scope_of(op: &OperationRow) -> Option<Scope> {
    let key = IdempotencyKey::try_from(op.idem_key.as_str()).ok()?;
    RecordId::from_hex(&op.record_id)?;
    Some(Scope::new(Principal::new(op.principal.as_str()), Endpoint::from_stored(op.endpoint.as_str()), key))
}
