//! An abandoned create, rolled back by the library's reaper: what leasebroker tells it (whether
//! the create finished after all) and does for it (frees the lease and the node, counts it).

use idempotency_effects::OperationRow;

use super::operations::{Operations, keys_of};
use crate::metric::ROLLED_BACK_TOTAL;

impl Operations {
    /// Whether the create `op` finished: its worker exists or was deleted. The worker is its
    /// result, never rolled back.
    pub(super) async fn create_finished(&self, op: &OperationRow) -> anyhow::Result<bool> {
        let worker_id = keys_of(op)?.worker_id();
        let principal = idempotency::Principal::new(op.principal.as_str());
        Ok(self.domain.worker(&principal, &worker_id).await?.is_some() || self.domain.is_deleted(&worker_id).await?)
    }

    /// Frees the lease and the node the create `op` took (after its VM was deleted and its
    /// record removed, so nothing can resume it meanwhile). Idempotent: a second run frees
    /// nothing, and counts nothing.
    pub(super) async fn release_create(&self, op: &OperationRow) -> anyhow::Result<()> {
        let keys = keys_of(op)?;
        let released = self.domain.release(keys.alloc.as_str(), &keys.lease_id()).await?;
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "lease").increment(released.leases);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "node").increment(released.nodes);
        tracing::debug!(op = %op.op_id, leases = released.leases, nodes = released.nodes, "abandoned create released");
        Ok(())
    }

    /// The create `op` is rolled back, `vms` VMs deleted for it: counted and logged, once.
    pub(super) fn create_rolled_back(&self, op: &OperationRow, vms: u64) {
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "operation").increment(1);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "vm").increment(vms);
        tracing::info!(op = %op.op_id, key = %op.idem_key, principal = %op.principal, vms, "abandoned create rolled back");
        crate::activity::record(
            crate::activity::ActionKind::RolledBack,
            format!("{} key {} of {}: {vms} VM(s), its lease and node", op.endpoint, op.idem_key, op.principal),
        );
    }
}
