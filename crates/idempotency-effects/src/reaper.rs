//! The reaper: abandoned operations rolled back, finished ones marked; fair and bounded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{
    Endpoint, IdempotencyKey, Principal, ReclaimRequest, RecordId, RecordState, Scope, Store, Timestamp,
};

use crate::effect::Effect;
use crate::ledger::{IntentState, Ledger, LedgerError, Mark, OperationRow};
use crate::{micros, now_micros};

/// What a service gives back itself when one of its operations is rolled back (a node, a
/// lease: rows in its own tables). Called after the downstream effects were undone and before
/// the operation is marked rolled back; it must be idempotent (a reaper that dies after it runs
/// it again).
#[async_trait]
pub trait Compensate: Send + Sync + std::fmt::Debug {
    /// Releases what `op` took in the service's own tables.
    async fn release(&self, op: &OperationRow) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

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
    /// and finished marks are kept before [`Reaper::tick`] prunes them.
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
    /// Rolled back.
    pub rolled_back: u64,
    /// Found finished (their record completed) and marked so.
    pub finished: u64,
    /// Downstream resources undone by rollbacks.
    pub undone: u64,
    /// Operations left for the next tick after an error.
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
    compensate: Option<Arc<dyn Compensate>>,
    config: ReaperConfig,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").field("ledger", &self.ledger).field("config", &self.config).finish_non_exhaustive()
    }
}

enum Step {
    Waiting(i64),
    RolledBack(u64),
    Finished,
}

impl Reaper {
    /// A reaper over `ledger`, finding records in `store`, undoing through `effects`.
    pub fn new(
        ledger: Arc<dyn Ledger>,
        store: Arc<dyn Store>,
        effects: Vec<Arc<dyn Effect>>,
        config: ReaperConfig,
    ) -> Self {
        let effects = effects.into_iter().map(|e| (e.name().to_owned(), e)).collect();
        Self { ledger, store, effects, compensate: None, config }
    }

    /// What the service releases itself on a rollback.
    pub fn compensate(mut self, c: Arc<dyn Compensate>) -> Self {
        self.compensate = Some(c);
        self
    }

    /// One tick: at most `batch` due operations, each either put off until it may change (so it
    /// never comes up again before then and never delays another), rolled back, or marked
    /// finished; then the marks older than the retention are pruned.
    pub async fn tick(&self) -> Result<Pass, LedgerError> {
        let now = now_micros();
        let mut pass = Pass::default();
        for op in self.ledger.due(now, self.config.batch).await? {
            pass.examined += 1;
            match self.look_at(&op, now).await {
                Ok(Step::Waiting(until)) => {
                    pass.waiting += 1;
                    self.ledger.put_off(&op.op_id, until).await?;
                }
                Ok(Step::RolledBack(undone)) => {
                    pass.rolled_back += 1;
                    pass.undone += undone;
                }
                Ok(Step::Finished) => pass.finished += 1,
                Err(e) => {
                    pass.errors += 1;
                    tracing::warn!(op_id = %op.op_id, error = %e, "reaper: leaving the operation for a later tick");
                    self.ledger.put_off(&op.op_id, now.saturating_add(micros(self.config.settle))).await?;
                }
            }
        }
        pass.pruned = self.ledger.prune(now.saturating_sub(micros(self.config.retention))).await?;
        Ok(pass)
    }

    async fn look_at(&self, op: &OperationRow, now: i64) -> Result<Step, Box<dyn std::error::Error + Send + Sync>> {
        let c = &self.config;
        if op.mark == Mark::Live {
            let abandoned_at = op.last_attempt_at.saturating_add(micros(c.abandon_after));
            if now < abandoned_at {
                return Ok(Step::Waiting(abandoned_at));
            }
        }
        let scope = scope_of(op)?;
        let record = self.store.get(&scope).await?.filter(|r| r.record_id.to_hex() == op.record_id);
        let ts = Timestamp::from_timestamp_micros(now).unwrap_or_else(idempotency::now);
        if let Some(r) = &record {
            match r.state {
                RecordState::Completed if op.mark == Mark::Live => {
                    return match self.ledger.finish(&op.op_id, now).await {
                        Ok(()) | Err(LedgerError::Finished) => Ok(Step::Finished),
                        Err(LedgerError::RolledBack) => Ok(Step::Waiting(now)),
                        Err(e) => Err(e.into()),
                    };
                }
                RecordState::InFlight if !r.is_stale(ts, c.in_flight_ttl) => {
                    let stale_at = idempotency::stale_after(r.started_at, c.in_flight_ttl).timestamp_micros();
                    return Ok(Step::Waiting(stale_at.max(now + 1)));
                }
                _ => {}
            }
        }
        // Abandoned: wait out the settle window of its last call before taking anything.
        if let Some(until) = self.settling_until(&op.op_id, now).await? {
            return Ok(Step::Waiting(until));
        }
        let claim = match &record {
            Some(r) => match self
                .store
                .reclaim(ReclaimRequest {
                    record: r,
                    now: ts,
                    in_flight_ttl: c.in_flight_ttl,
                    expires_at: ts + c.retention,
                })
                .await?
            {
                Some(claim) => Some(claim),
                // A retry took the record first: look again once its attempt may be over.
                None => return Ok(Step::Waiting(now.saturating_add(micros(c.in_flight_ttl)))),
            },
            None => None, // the record expired or was removed: nothing can retry this operation
        };
        if op.mark == Mark::Live && !self.ledger.take_for_rollback(&op.op_id, op.last_attempt_at).await? {
            // An attempt ran a step since the row was read: not abandoned after all.
            if let Some(claim) = &claim {
                let _ = self.store.fail(claim).await;
            }
            return Ok(Step::Waiting(now.saturating_add(micros(c.abandon_after))));
        }
        // Fenced now: no attempt can stamp, send or record. A stalled one may have stamped just
        // before the mark: its call may still land.
        if let Some(until) = self.settling_until(&op.op_id, now_micros()).await? {
            if let Some(claim) = &claim {
                let _ = self.store.fail(claim).await;
            }
            return Ok(Step::Waiting(until));
        }
        let mut undone = 0;
        for intent in self.ledger.intents(&op.op_id).await? {
            let Some(effect) = self.effects.get(&intent.effect) else {
                tracing::warn!(effect = %intent.effect, "reaper: an intent of an effect it does not know; not undone");
                continue;
            };
            if !effect.can_undo() || intent.state == IntentState::Failed {
                continue;
            }
            let mut ids = effect.probe(&intent.intent_id).await?;
            ids.extend(intent.resource_id.clone());
            ids.sort();
            ids.dedup();
            for id in ids {
                if effect.undo(&id).await? {
                    undone += 1;
                }
            }
        }
        if let Some(c) = &self.compensate {
            c.release(op).await?;
        }
        self.ledger.rolled_back(&op.op_id, now_micros()).await?;
        if let Some(claim) = &claim {
            // A later retry with the key runs as a new operation, with new sub-keys.
            let _ = self.store.remove(claim).await;
        }
        tracing::info!(op_id = %op.op_id, kind = %op.kind, undone, "reaper: rolled back an abandoned operation");
        Ok(Step::RolledBack(undone))
    }

    /// When the settle window of the operation's last send ends, if it has not yet at `now`.
    async fn settling_until(&self, op_id: &str, now: i64) -> Result<Option<i64>, LedgerError> {
        let last = self
            .ledger
            .intents(op_id)
            .await?
            .iter()
            .filter(|i| i.state == IntentState::Pending)
            .map(|i| i.sent_at)
            .max();
        Ok(last.map(|s| s.saturating_add(micros(self.config.settle))).filter(|until| *until > now))
    }
}

fn scope_of(op: &OperationRow) -> Result<Scope, Box<dyn std::error::Error + Send + Sync>> {
    let key = IdempotencyKey::try_from(op.idem_key.as_str())?;
    RecordId::from_hex(&op.record_id).ok_or_else(|| format!("bad record id {:?}", op.record_id))?;
    Ok(Scope::new(Principal::new(op.principal.as_str()), Endpoint::from_stored(op.endpoint.as_str()), key))
}
