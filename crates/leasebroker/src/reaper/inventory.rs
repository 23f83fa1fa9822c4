//! The inventory sweep, on every reaper tick: what carries the service's tags downstream and
//! whether anything owns it (SPEC 1.5, "nothing runs that nobody owns").

use std::collections::BTreeMap;
use std::sync::Arc;

use idempotency::ErrorChain;

use super::{ORPHANS_REMOVED_TOTAL, ReapReport, Reaper};
use crate::service::{destroy_duplicates, micros, now_micros};

/// The tag prefix of every sub-key, so of every VM this service boots.
const TAG_PREFIX: &str = "sk-";

/// The VMs the inventory sweep sent a delete to without learning its outcome (the call timed
/// out, as on a hypervisor slower than the call timeout): each is counted once in
/// [`ORPHANS_REMOVED_TOTAL`], however many ticks it takes to disappear.
#[derive(Debug, Clone, Default)]
pub struct OrphanDeletes(Arc<std::sync::Mutex<std::collections::HashSet<String>>>);

impl OrphanDeletes {
    /// Records the outcome `deleted` (`Some(true)`: done or may be done; `Some(false)`: was gone
    /// already; `None`: definitely not done) of a delete of `vm_id`; true when it is to be
    /// counted now.
    fn count(&self, vm_id: &str, deleted: Option<bool>, confirmed: bool) -> bool {
        let mut sent = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match deleted {
            Some(true) if confirmed => !sent.remove(vm_id),
            Some(true) => sent.insert(vm_id.to_owned()),
            Some(false) => {
                sent.remove(vm_id);
                false
            }
            None => false,
        }
    }

    /// Forgets every VM not in `listed` (gone: its count is done).
    fn retain_listed(&self, listed: &std::collections::HashSet<&str>) {
        let mut sent = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        sent.retain(|vm_id| listed.contains(vm_id.as_str()));
    }
}

impl Reaper {
    /// Lists every VM that carries the service's tag prefix and (1) where a tag carries two VMs
    /// (a boot call landed after a retry booted again: the settle window is shorter than the
    /// hypervisor takes) keeps the one the service adopted and deletes the others; (2) deletes
    /// every VM that no live operation or worker owns and whose last send is older than the
    /// settle window: a boot that landed after its operation was rolled back (an orphan).
    pub(super) async fn sweep_inventory(&self, report: &mut ReapReport) {
        let vms = match self.hypervisor.list_all().await {
            Ok(vms) => vms,
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "cannot list VMs for the inventory sweep");
                return;
            }
        };
        self.orphan_deletes.retain_listed(&vms.iter().map(|vm| vm.vm_id.as_str()).collect());
        let mut by_tag: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for vm in vms.into_iter().filter(|vm| vm.tag.starts_with(TAG_PREFIX)) {
            by_tag.entry(vm.tag).or_default().push(vm.vm_id);
        }
        let settled_before = now_micros().saturating_sub(micros(self.settle));
        for (tag, ids) in by_tag {
            let ids = if ids.len() > 1 { self.destroy_late_landings(&tag, ids, report).await } else { ids };
            for vm_id in ids {
                match self.domain.vm_owned(&tag, &vm_id, settled_before).await {
                    Ok(true) => {}
                    Ok(false) => self.remove_orphan(&tag, &vm_id, report).await,
                    Err(e) => tracing::warn!(error = %ErrorChain(&e), %tag, "cannot check who owns a VM"),
                }
            }
        }
    }

    /// Deletes an orphan VM and counts it (once, even when the delete's outcome is learnt only
    /// from a later listing).
    async fn remove_orphan(&self, tag: &str, vm_id: &str, report: &mut ReapReport) {
        let (deleted, confirmed) = match self.hypervisor.delete(vm_id).await {
            Ok(existed) => (Some(existed), true),
            Err(e) => {
                tracing::warn!(%tag, %vm_id, error = %ErrorChain(&e), "deleting an orphan VM failed; checking again next tick");
                (e.may_have_happened().then_some(true), false)
            }
        };
        if self.orphan_deletes.count(vm_id, deleted, confirmed) {
            metrics::counter!(ORPHANS_REMOVED_TOTAL).increment(1);
            report.orphans_removed += 1;
            report.vms_deleted += 1;
            tracing::warn!(%tag, %vm_id, "deleted a VM nobody owns (a call that landed after its operation ended)");
            crate::activity::record(crate::activity::ActionKind::OrphanRemoved, format!("VM {vm_id} (tag {tag})"));
        }
    }

    /// A tag that carries two VMs or more: keeps the VM the service adopted (recorded in the
    /// intent, or the one a worker runs on) and deletes the others. Returns the VMs left to
    /// look at (all of them when the service has not decided yet: the create's retry adopts one).
    async fn destroy_late_landings(&self, tag: &str, ids: Vec<String>, report: &mut ReapReport) -> Vec<String> {
        let keep = match self.adopted(tag, &ids).await {
            Ok(Some(keep)) => keep,
            Ok(None) => return ids,
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "cannot check a tag with two VMs");
                return Vec::new();
            }
        };
        let extra: Vec<String> = ids.into_iter().filter(|id| *id != keep).collect();
        destroy_duplicates(&self.hypervisor, tag, &keep, &extra).await;
        report.vms_deleted += extra.len() as u64;
        vec![keep]
    }

    /// Which of `ids` (all tagged `tag`) the service adopted, if it decided.
    async fn adopted(&self, tag: &str, ids: &[String]) -> Result<Option<String>, crate::domain::DomainError> {
        if let Some(intent) = self.domain.intent(tag).await? {
            return Ok(match (intent.state.as_str(), intent.vm_id) {
                ("done", Some(vm_id)) if ids.contains(&vm_id) => Some(vm_id),
                _ => None,
            });
        }
        let mut used = Vec::new();
        for id in ids {
            if self.domain.vm_in_use(id).await? {
                used.push(id.clone());
            }
        }
        Ok(if used.len() == 1 { used.pop() } else { None })
    }
}
