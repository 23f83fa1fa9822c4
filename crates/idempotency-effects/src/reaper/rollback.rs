//! The reaper's two ways to end an abandoned operation: a rollback, or the service's finish.

use idempotency::{Claim, Record, RecordId, RecordState, Scope};

use super::{BoxError, Reaper, Step};
use crate::ledger::{IntentState, LedgerError, Mark, OperationRow};
use crate::{micros, now_micros};

impl Reaper {
    /// Rolls back an abandoned operation whose record is `record` (`None`: gone). Takes the
    /// record's claim first (so it never races a retry) and the operation's mark by
    /// compare-and-set (so an attempt still running can take, send or record nothing more),
    /// waits out the settle window of the last send, undoes what the effects made, removes the
    /// record, has the service release what it holds, and only then marks it rolled back: a step
    /// that fails leaves it rolling back, and a later tick goes on from there.
    pub(super) async fn roll_back(
        &self,
        op: &OperationRow,
        scope: &Scope,
        record: Option<Record>,
    ) -> Result<Step, BoxError> {
        if op.mark == Mark::Live && self.service.finished(op).await? {
            return self.mark_finished(op).await;
        }
        // Wait out the settle window of its last call before taking anything.
        if let Some(until) = self.settling_until(&op.op_id).await? {
            return Ok(Step::Waiting(until));
        }
        let mut claim = match &record {
            // A completed record keeps its answer; the rollback goes on without it.
            Some(r) if r.state != RecordState::Completed => match self.reclaim(r).await? {
                Some(claim) => Some(claim),
                // A retry took the record first: look again once its attempt may have run a step.
                None => return Ok(Step::Waiting(self.later(self.config.settle))),
            },
            _ => None,
        };
        let rolled = self.roll_back_holding(op, scope, &mut claim).await;
        // Stopped short of removing the record: a retry may take it at once.
        self.give_back(claim.as_ref()).await;
        rolled
    }

    /// [`Reaper::roll_back`] once the reaper holds the record's `claim` (if it has a record),
    /// which it takes when it removes the record.
    async fn roll_back_holding(
        &self,
        op: &OperationRow,
        scope: &Scope,
        claim: &mut Option<Claim>,
    ) -> Result<Step, BoxError> {
        if op.mark == Mark::Live && !self.ledger.take_for_rollback(&op.op_id, op.last_attempt_at).await? {
            // An attempt ran a step since the row was read: not abandoned after all.
            return Ok(Step::Waiting(self.later(self.config.settle)));
        }
        // Fenced now: no attempt can stamp, send or record. A stalled one may have stamped just
        // before the mark: its call may still land.
        if let Some(until) = self.settling_until(&op.op_id).await? {
            return Ok(Step::Waiting(until));
        }
        let undone = self.undo_effects(op, scope).await?;
        // The record first: from here a retry runs as a new operation, with new sub-keys, so
        // nothing can resume this one while the service releases what it held.
        if let Some(held) = claim.as_ref() {
            self.store.remove(held).await?;
            *claim = None;
        }
        self.service.release(op).await?;
        if !self.ledger.rolled_back(&op.op_id, now_micros()).await? {
            return Ok(Step::Over); // another replica's reaper marked it first
        }
        self.service.rolled_back(op, undone);
        tracing::info!(op_id = %op.op_id, kind = %op.kind, undone, "reaper: rolled back an abandoned operation");
        Ok(Step::RolledBack(undone))
    }

    /// Undoes what the operation's effects made: every resource found by the tag of each effect
    /// the reaper knows (derived from the operation's record, so found even without an intent),
    /// and every resource its intents recorded. Returns how many were there.
    async fn undo_effects(&self, op: &OperationRow, scope: &Scope) -> Result<u64, BoxError> {
        let record_id = RecordId::from_hex(&op.record_id).ok_or("the operation's record id cannot be read")?;
        let intents = self.ledger.intents(&op.op_id).await?;
        for unknown in intents.iter().filter(|i| !self.effects.contains_key(&i.effect)) {
            tracing::warn!(effect = %unknown.effect, "reaper: an intent of an effect it does not know; not undone");
        }
        let mut undone = 0;
        for effect in self.effects.values().filter(|e| e.can_undo()) {
            let tag = idempotency::derive(scope, &record_id, effect.name()).to_string();
            let mut ids = effect.probe(&tag).await?;
            ids.extend(intents.iter().filter(|i| i.effect == effect.name()).filter_map(|i| i.resource_id.clone()));
            ids.sort();
            ids.dedup();
            for id in ids {
                if effect.undo(&id).await? {
                    undone += 1;
                    effect.undone(&tag, &id, &crate::Undone::RolledBack);
                }
            }
        }
        Ok(undone)
    }

    /// Ends an abandoned operation of [`super::Disposal::Finish`]: takes its record's claim,
    /// has the service finish it ([`super::Abandoned::finish`]), marks it finished.
    pub(super) async fn finish_abandoned(&self, op: &OperationRow, record: Option<&Record>) -> Result<Step, BoxError> {
        let claim = match record {
            Some(r) => match self.reclaim(r).await? {
                Some(claim) => Some(claim),
                None => return Ok(Step::Waiting(self.later(self.config.settle))),
            },
            None => None,
        };
        if let Err(e) = self.service.finish(op, claim.as_ref()).await {
            self.give_back(claim.as_ref()).await;
            return Err(e);
        }
        match self.ledger.finish(&op.op_id, now_micros()).await {
            Ok(()) | Err(LedgerError::Finished | LedgerError::RolledBack) => Ok(Step::Finished),
            Err(e) => Err(e.into()),
        }
    }

    /// When the settle window of the operation's last send ends, if it has not passed yet.
    async fn settling_until(&self, op_id: &str) -> Result<Option<i64>, LedgerError> {
        let last = self
            .ledger
            .intents(op_id)
            .await?
            .iter()
            .filter(|i| i.state == IntentState::Pending)
            .map(|i| i.sent_at)
            .max();
        let now = now_micros();
        Ok(last.map(|s| s.saturating_add(micros(self.config.settle))).filter(|until| *until > now))
    }
}
