//! leasebroker's side effects, as `idempotency-effects` runs them: what each hypervisor call is
//! (its probe by tag, its undo, its listing) and how its errors read. The fences themselves
//! (the intent, the send stamp by compare-and-set, the settle window, adoption by tag, the
//! finished and rolled-back marks) are the library's, written once there.

use async_trait::async_trait;
use idempotency::ErrorChain;
use idempotency_effects::{CallError, Effect, EffectError, Tagged, Undone};

use super::ServiceError;
use crate::hypervisor::client::{HvError, HypervisorClient};
use crate::metric::{DUPLICATE_VMS_DESTROYED_TOTAL, ORPHANS_REMOVED_TOTAL};

/// The tag prefix of every sub-key, so of every VM this service boots.
pub use idempotency_effects::TAG_PREFIX;

/// A hypervisor error as the library reads it: definite (the hypervisor answered "no", or the
/// call never left) or ambiguous (it may have happened), with the status it answered.
pub(crate) fn call_error(e: HvError) -> CallError {
    let status = e.status().map(|s| s.as_u16());
    let ce = if e.may_have_happened() { CallError::ambiguous(e) } else { CallError::definite(e) };
    match status {
        Some(s) => ce.with_status(s),
        None => ce,
    }
}

/// The answer to a side effect that did not come to an outcome.
pub(crate) fn effect_failed(e: EffectError, downstream: &str) -> ServiceError {
    match e {
        EffectError::Settling { retry_after } => ServiceError::UpstreamUnavailable {
            reason: "an earlier attempt's call may still take effect; retry with the same key".into(),
            retry_after,
        },
        EffectError::Contended => {
            ServiceError::upstream("another attempt of this request is calling the downstream; retry with the same key")
        }
        EffectError::SlowCommit => {
            ServiceError::upstream("the database was too slow to record the call before sending it; nothing was sent")
        }
        EffectError::CannotProbe(e) => {
            tracing::warn!(error = %ErrorChain(&e), "cannot ask the {downstream} what an earlier attempt did");
            ServiceError::upstream(format!(
                "cannot ask the {downstream} what an earlier attempt did; retry with the same key"
            ))
        }
        EffectError::Ambiguous(e) => {
            tracing::warn!(error = %ErrorChain(&e), "{downstream} call may or may not have taken effect");
            ServiceError::upstream(format!(
                "the {downstream} call may or may not have taken effect; retry with the same key"
            ))
        }
        EffectError::Refused(e) => {
            tracing::warn!(error = %ErrorChain(&e), "{downstream} call refused or not sent");
            match e.status() {
                Some(status) => ServiceError::UpstreamRefused(format!("status {status}")),
                None => ServiceError::upstream(format!("the {downstream} is unreachable")),
            }
        }
        e => ServiceError::Database(e.into()),
    }
}

/// A VM boot: tagged with the create's sub-key `boot`; found by listing VMs by tag; undone by
/// deleting the VM; every VM with the service's tag prefix is listed for the inventory sweep.
#[derive(Debug, Clone)]
pub struct Boot {
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
}

#[async_trait]
impl Effect for Boot {
    fn name(&self) -> &str {
        "boot"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        Ok(self.hypervisor.list_by_tag(tag).await.map_err(call_error)?.into_iter().map(|vm| vm.vm_id).collect())
    }

    fn can_undo(&self) -> bool {
        true
    }

    async fn undo(&self, id: &str) -> Result<bool, CallError> {
        self.hypervisor.delete(id).await.map_err(call_error)
    }

    fn can_list(&self) -> bool {
        true
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Tagged>, CallError> {
        let vms = self.hypervisor.list_all().await.map_err(call_error)?;
        Ok(vms
            .into_iter()
            .filter(|vm| vm.tag.starts_with(prefix))
            .map(|vm| Tagged { tag: vm.tag, id: vm.vm_id })
            .collect())
    }

    fn undone(&self, tag: &str, id: &str, why: &Undone) {
        use crate::activity::{ActionKind, record};
        match why {
            Undone::Duplicate { kept } => {
                metrics::counter!(DUPLICATE_VMS_DESTROYED_TOTAL).increment(1);
                tracing::warn!(%tag, vm_id = %id, %kept,
                    "a second VM for one boot (a call landed after the settle window): deleted it; \
                     --hypervisor-settle is shorter than the hypervisor takes");
                record(ActionKind::DuplicateDestroyed, format!("VM {id} (tag {tag}; kept {kept})"));
            }
            Undone::Orphan => {
                metrics::counter!(ORPHANS_REMOVED_TOTAL).increment(1);
                tracing::warn!(%tag, vm_id = %id, "deleted a VM nobody owns (a call that landed after its operation ended)");
                record(ActionKind::OrphanRemoved, format!("VM {id} (tag {tag})"));
            }
            Undone::RolledBack => {}
        }
    }
}

/// A reboot of the VM `vm_id`: tagged with the reboot's sub-key, which the hypervisor records on
/// the VM (`reboot_tags`); found there; never undone.
#[derive(Debug, Clone)]
pub struct Reboot {
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// The VM rebooted.
    pub vm_id: String,
}

#[async_trait]
impl Effect for Reboot {
    fn name(&self) -> &str {
        "reboot"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        let vm = self.hypervisor.get(&self.vm_id).await.map_err(call_error)?;
        Ok(vm.filter(|vm| vm.reboot_tags.iter().any(|t| t == tag)).map(|_| self.vm_id.clone()).into_iter().collect())
    }

    fn keeps(&self) -> bool {
        false
    }
}

/// The delete of the VM `vm_id`: by id, so idempotent downstream (a VM already gone is
/// success) and sent again at once by a retry; found done when the VM is gone.
#[derive(Debug, Clone)]
pub struct DeleteVm {
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// The VM deleted.
    pub vm_id: String,
}

#[async_trait]
impl Effect for DeleteVm {
    fn name(&self) -> &str {
        "delete"
    }

    async fn probe(&self, _tag: &str) -> Result<Vec<String>, CallError> {
        let vm = self.hypervisor.get(&self.vm_id).await.map_err(call_error)?;
        Ok(if vm.is_none() { vec![self.vm_id.clone()] } else { Vec::new() })
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn keeps(&self) -> bool {
        false
    }
}
