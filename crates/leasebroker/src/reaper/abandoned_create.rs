//! An abandoned create, rolled back: its VMs by tag, its record, its lease and node, its
//! intents, once no call of it can still land.

use idempotency::{Record, RecordId, Scope};
use idempotency_effects::{Effect, IntentState, Mark, OperationRow};

use super::{ReapReport, Reaper, Reclaimed};
use crate::metric::ROLLED_BACK_TOTAL;
use crate::service::{Boot, CreateKeys, micros, now_micros};

impl Reaper {
    /// Rolls back an abandoned create: VM by tag, record, lease and node, intents.
    pub(super) async fn roll_back(
        &self,
        op: &OperationRow,
        record: Option<Record>,
        scope: Scope,
        report: &mut ReapReport,
    ) -> anyhow::Result<Option<i64>> {
        let Some(keys) = keys_of(op, &scope) else {
            return Ok(Some(now_micros().saturating_add(micros(self.retention)))); // unreadable: set aside
        };
        // A create that made its worker finished: the worker is its result, never rolled back.
        if self.domain.worker(&op.principal, &keys.worker_id()).await?.is_some()
            || self.domain.is_deleted(&keys.worker_id()).await?
        {
            self.forget(op).await?;
            report.forgotten += 1;
            return Ok(None);
        }
        if let Some(at) = self.settles_at(&op.op_id).await? {
            return Ok(Some(at));
        }
        let claim = match self.reclaim_record(record.as_ref()).await? {
            Reclaimed::Held(claim) => claim,
            // A retry (or another replica's reaper) took it first: look again later.
            Reclaimed::TakenFirst => return Ok(Some(now_micros().saturating_add(micros(self.settle)))),
        };
        // Holding the claim, no attempt can start. One that started earlier may still run (its
        // claim went stale while it waited on a restarting database): taking the operation
        // fences it off, since every step of a create checks this mark in its own transaction.
        // The mark is taken by compare-and-set on the attempt time the reaper decided from: an
        // attempt that ran a step since (or finished the create) keeps it.
        if op.mark == Mark::Live && !self.ledger().take_for_rollback(&op.op_id, op.last_attempt_at).await? {
            // The record is given back, failed: a retry resumes (or answers from the worker).
            if let Some(claim) = &claim {
                self.store.fail(claim).await?;
            }
            return Ok(Some(now_micros().saturating_add(micros(self.settle))));
        }
        // Check the window once more: a step that committed before the mark may have sent a call.
        if let Some(at) = self.settles_at(&op.op_id).await? {
            if let Some(claim) = &claim {
                self.store.fail(claim).await?;
            }
            return Ok(Some(at));
        }
        // What the boot made: found by its tag, and what its intent recorded.
        let boot = Boot { hypervisor: self.hypervisor.clone() };
        let recorded = self.ledger().intents(&op.op_id).await?.into_iter().filter_map(|i| i.resource_id);
        let mut vms = match boot.probe(keys.boot.as_str()).await {
            Ok(vms) => vms,
            Err(e) => {
                if let Some(claim) = &claim {
                    self.store.fail(claim).await?;
                }
                anyhow::bail!("cannot list the abandoned create's VMs: {e}");
            }
        };
        vms.extend(recorded);
        vms.sort();
        vms.dedup();
        let mut vms_deleted = 0;
        for vm_id in &vms {
            match boot.undo(vm_id).await {
                Ok(existed) => vms_deleted += u64::from(existed),
                Err(e) => {
                    if let Some(claim) = &claim {
                        self.store.fail(claim).await?;
                    }
                    anyhow::bail!("cannot delete the abandoned create's VM {vm_id}: {e}");
                }
            }
        }
        // The record first: from here a retry runs as a new operation, with new sub-keys, so
        // nothing can resume this one while its lease and node are freed.
        if let Some(claim) = &claim {
            self.store.remove(claim).await?;
        }
        let released = self.domain.release(keys.alloc.as_str(), &keys.lease_id()).await?;
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "vm").increment(vms_deleted);
        if !self.ledger().rolled_back(&op.op_id, now_micros()).await? {
            return Ok(None); // another replica's reaper finished this rollback first
        }
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "operation").increment(1);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "lease").increment(released.leases);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "node").increment(released.nodes);
        tracing::info!(
            op = %op.op_id, key = %op.idem_key, principal = %op.principal,
            vms = vms_deleted, leases = released.leases, nodes = released.nodes,
            "abandoned create rolled back"
        );
        crate::activity::record(
            crate::activity::ActionKind::RolledBack,
            format!(
                "{} key {} of {}: {vms_deleted} VM(s), {} lease(s), {} node(s)",
                op.endpoint, op.idem_key, op.principal, released.leases, released.nodes
            ),
        );
        report.rolled_back += 1;
        report.vms_deleted += vms_deleted;
        Ok(None)
    }

    /// When the settle window of the operation's last call ends, if it has not passed
    /// (`None`: no call may still land: none was made, it was refused, or it is done).
    async fn settles_at(&self, op_id: &str) -> anyhow::Result<Option<i64>> {
        let intents = self.ledger().intents(op_id).await?;
        let Some(sent_at) = intents.iter().filter(|i| i.state == IntentState::Pending).map(|i| i.sent_at).max() else {
            return Ok(None);
        };
        let at = sent_at.saturating_add(micros(self.settle));
        let left = at.saturating_sub(now_micros());
        if left > 0 {
            tracing::info!(op_id, left_ms = left / 1000, "abandoned create's last call may still land; waiting");
            return Ok(Some(at));
        }
        Ok(None)
    }
}

/// The sub-keys of the create `op` (derived from its scope and record id: the record itself may
/// be gone).
fn keys_of(op: &OperationRow, scope: &Scope) -> Option<CreateKeys> {
    RecordId::from_hex(&op.record_id).map(|id| CreateKeys::of_scope(scope, &id))
}
