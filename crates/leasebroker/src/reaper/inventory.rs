//! The inventory sweep, on every reaper tick (docs/protocol.md#side-effects, "nothing runs that nobody owns"): the
//! effect library's [`idempotency_effects::InventorySweep`] over the boot effect, which lists
//! every VM with the service's tag prefix and deletes each one that no live operation, no
//! finished create and no worker owns, once its last send is older than the settle window: a
//! boot that landed after its operation was rolled back (an orphan), or a second VM of one
//! boot that landed after the create finished. Each deleted VM is counted once
//! ([`crate::metric::ORPHANS_REMOVED_TOTAL`]), even when the delete's answer was lost and the VM's absence
//! is learnt from a later listing. A VM whose tag this service never issued (another
//! deployment's, on a hypervisor both use) is left alone and counted in
//! [`crate::metric::INVENTORY_FOREIGN`].

use async_trait::async_trait;
use idempotency::ErrorChain;

use super::{ReapReport, Reaper};
use crate::domain::Domain;

/// What leasebroker's own tables own: the VM a worker runs on (a worker from before the effect
/// ledger has no ledger row that keeps its VM).
#[derive(Debug, Clone)]
pub(super) struct WorkerVms(pub(super) Domain);

#[async_trait]
impl idempotency_effects::Owner for WorkerVms {
    async fn owns(&self, _effect: &str, id: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
        Ok(self.0.vm_in_use(id).await?)
    }
}

impl Reaper {
    /// One inventory sweep; what it deleted is added to `report`.
    pub(super) async fn sweep_inventory(&self, report: &mut ReapReport) {
        match self.inventory.sweep().await {
            Ok(swept) => {
                report.orphans_removed += swept.undone;
                report.vms_deleted += swept.undone;
                metrics::gauge!(crate::metric::INVENTORY_FOREIGN).set(swept.foreign as f64);
            }
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "inventory sweep failed; trying again next tick"),
        }
    }
}
