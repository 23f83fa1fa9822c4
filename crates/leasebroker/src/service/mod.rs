//! The resumable handlers: create, delete and reboot a worker, each side effect keyed off the
//! request's idempotency record so that a retry resumes instead of repeating.
//!
//! Create, as the design describes it:
//! 1. `allocate(derive("alloc"))` returns the node already allocated under that id, if any;
//! 2. `insert_lease(derive("lease"))` likewise;
//! 3. the boot goes through an intent keyed by `derive("boot")`: record it, stamp the moment
//!    the call is sent, call the hypervisor with the sub-key as the VM's `tag`, then record the
//!    VM. A retry that finds the intent pending lists the hypervisor's VMs by that tag and adopts
//!    what exists (deleting any second VM a late landing made); it boots again only when nothing
//!    exists and the settle window (`--hypervisor-settle`) has passed since the last call was
//!    sent: a call from an earlier attempt may still land until then, so the retry answers
//!    503 + Retry-After instead of calling twice.
//! 4. the worker row, keyed by `derive("worker")`.
//!
//! The steps share transactions where nothing outside the database happens between them: the
//! attempt's row, 1, 2 and the intent (with its send stamp, when it is new) are one commit before
//! the call ([`Domain::start_create`]); the VM, 4 and the operation's end are one commit after it
//! ([`Domain::finish_create`]). With the idempotency record's claim and completion that is four
//! commits a create, the floor `bench/run e2e` measures against. Each write keeps its sub-key and
//! its `ON CONFLICT` rule, so a retry that finds an earlier attempt's rows goes on from them; when
//! an overlapping attempt allocated at the same moment (a unique violation) the steps run one
//! transaction each, as before.
//!
//! Attempts of one record can overlap: a holder whose claim went stale (its heartbeats could not
//! reach a restarting database) still runs when a retry or the reaper takes the record. So the
//! steps are fenced in the database, not by the claim alone: a call is sent only by the attempt
//! that recorded the intent with its send stamp, or moved that stamp by compare-and-set from the
//! value it decided on; and every commit of a create first checks, in its transaction, that the
//! reaper has not taken the operation for a rollback and that it has not finished (a finished
//! operation keeps a compact mark until the retention, so an attempt that outlived its claim
//! never starts it again).
//!
//! A definite refusal (the hypervisor answered 4xx, or could not be reached at all) gives back
//! the node and the lease before answering. A create nobody finishes is rolled back by the
//! [`crate::reaper`]. A delete leaves a tombstone keyed by its own sub-key (its retry answers
//! 204) and by the worker id (a retry of the worker's create answers 410, never runs again).
use idempotency::ErrorChain;
use std::time::Duration;

pub use leasebroker_validation::{
    CreateWorker, FlashFirmware, InvalidRequest, Limits, MAX_IMAGE, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS,
};

use crate::domain::{
    Allocation, CreateStart, Domain, DomainError, Intent, Node, OperationRow, StartCreate, WorkerRow,
    is_unique_violation,
};
use crate::hypervisor::Vm;
use crate::hypervisor::client::{BootRequest, HvError, HypervisorClient};

mod calls;
mod error;
mod hook;
mod keys;

pub(crate) use calls::{destroy_duplicates, longest_settle_retry_after, may_send, micros, now_micros, settled_since};
pub use error::ServiceError;
pub use hook::{Hook, Step};
pub use keys::{CreateKeys, Operation, public_id};

/// Counter: VMs deleted because a second VM carried a tag whose boot had already been adopted
/// (a call that landed after the settle window; the window is set too short).
pub const DUPLICATE_VMS_DESTROYED_TOTAL: &str = "leasebroker_duplicate_vms_destroyed_total";
/// Counter: creates whose node and lease were given back because the hypervisor definitely
/// refused the boot.
pub const REFUSALS_RELEASED_TOTAL: &str = "leasebroker_refusals_released_total";

/// The workers service.
#[derive(Debug, Clone)]
pub struct Workers {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// How long a sent hypervisor call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
    /// Field limits.
    pub limits: Limits,
    /// The most workers one principal may hold (0: no limit).
    pub quota: u32,
    /// What runs at the handlers' named steps (nothing, outside tests).
    pub hook: Hook,
}

impl Workers {
    /// Creates a worker, resuming whatever an earlier attempt of the same record did.
    pub async fn create(&self, principal: &str, req: &CreateWorker, op: &Operation) -> Result<WorkerRow, ServiceError> {
        req.validate(self.limits)?;
        let keys = CreateKeys::of(op);
        let worker_id = keys.worker_id();
        self.hook.at(Step::CreateDecide).await;
        let now = now_micros();
        let op_row = op.row("create", now);
        let lease_id = keys.lease_id();
        let tag = keys.boot.as_str();
        // One commit for everything before the call: the attempt, the node, the lease, and the
        // intent, born with its send stamp when it is new. It decides too whether the create
        // finished already (its worker exists or was deleted): in the transaction, not before.
        let start = StartCreate {
            op: &op_row,
            alloc_id: keys.alloc.as_str(),
            lease_id: &lease_id,
            intent_id: tag,
            worker_id: &worker_id,
            quota: self.quota,
            check_at: now.saturating_add(micros(self.settle)),
        };
        // `stamped`: the intent was recorded by this call with its send stamp.
        let (node, intent, created, stamped) = match self.domain.start_create(start).await {
            Ok(CreateStart::Held { node, intent, created }) => (node, intent, created, created),
            Ok(CreateStart::Refused(refused)) => return Err(self.refused(refused)),
            Ok(CreateStart::Finished) | Err(DomainError::Finished) => {
                return self.finished(principal, &worker_id).await;
            }
            // An overlapping attempt of this request allocated at the same moment: step by step,
            // each step finds what it did.
            Err(DomainError::Db(e)) if is_unique_violation(&e) => match self.start_stepwise(&keys, &op_row).await {
                Err(ServiceError::Database(DomainError::Finished)) => {
                    return self.finished(principal, &worker_id).await;
                }
                started => started?,
            },
            Err(e) => return Err(e.into()),
        };

        let vm_id = match intent.state.as_str() {
            "done" => intent.vm_id.clone().unwrap_or_default(),
            _ => {
                let adopted = if created {
                    None
                } else {
                    self.hook.at(Step::CreateAdopt).await;
                    match self.adopt_boot(&intent, keys.op.as_str()).await {
                        Err(ServiceError::Database(DomainError::Finished)) => {
                            return self.finished(principal, &worker_id).await;
                        }
                        adopted => adopted?,
                    }
                };
                match adopted {
                    Some(vm_id) => vm_id,
                    None => {
                        if !created {
                            self.settled(&intent)?;
                        }
                        if stamped {
                            // The stamp was taken with the intent: the call goes out only if
                            // that commit came back before the stamped moment.
                            may_send(tag, Some(intent.last_attempt_at))?;
                        } else {
                            self.mark_sending(&intent, keys.op.as_str()).await?;
                        }
                        let boot = BootRequest {
                            image: req.image.clone(),
                            cpu: req.cpu,
                            memory_gb: req.memory_gb,
                            tag: tag.to_owned(),
                        };
                        match self.hypervisor.boot(&boot).await {
                            Ok(vm) => vm.vm_id,
                            Err(e) => return Err(self.boot_failed(&keys, e).await),
                        }
                    }
                }
            }
        };

        let labels = serde_json::to_string(&req.labels.clone().unwrap_or_default()).unwrap_or_else(|_| "{}".into());
        let row = WorkerRow {
            worker_id,
            principal: principal.to_owned(),
            image: req.image.clone(),
            cpu: req.cpu,
            memory_gb: req.memory_gb,
            labels,
            node_id: node.node_id,
            lease_id,
            vm_id,
            state: "running".into(),
            reboot_count: 0,
            created_at: now_micros(),
        };
        // One commit for everything after the call: the VM, the worker, the operation finished.
        match self.domain.finish_create(tag, &row.vm_id, &row, keys.op.as_str()).await {
            Ok(w) => Ok(w),
            // The reaper took the operation: there is no worker. The VM is recorded all the same,
            // unfenced, as the reaper and a late retry reconcile by it.
            // An overlapping attempt finished the create first: its worker is the answer.
            Err(DomainError::Finished) => self.finished(principal, &row.worker_id).await,
            Err(DomainError::RolledBack) => {
                self.domain.finish_boot(tag, &row.vm_id).await?;
                match self.domain.worker(principal, &row.worker_id).await? {
                    Some(w) => Ok(w),
                    None => Err(DomainError::RolledBack.into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The answer of a create that finished already: its worker, or `410` when the worker was
    /// deleted since. Never runs a step again.
    async fn finished(&self, principal: &str, worker_id: &str) -> Result<WorkerRow, ServiceError> {
        if let Some(w) = self.domain.worker(principal, worker_id).await? {
            return Ok(w);
        }
        if self.domain.is_deleted(worker_id).await? {
            return Err(ServiceError::Gone(worker_id.to_owned()));
        }
        Err(DomainError::Finished.into())
    }

    /// The steps before the call one transaction each, as an overlapping attempt needs them:
    /// each step resolves a unique violation by finding the other attempt's row. Returns the
    /// node, the intent, whether this call recorded it, and `false`: the intent is not stamped
    /// yet (the compare-and-set of `mark_sending` takes the right to send).
    async fn start_stepwise(
        &self,
        keys: &CreateKeys,
        op_row: &OperationRow,
    ) -> Result<(Node, Intent, bool, bool), ServiceError> {
        let now = op_row.last_attempt_at;
        let principal = op_row.principal.as_str();
        self.domain.begin_attempt(op_row, now.saturating_add(micros(self.settle))).await?;
        let node =
            match self.domain.allocate_within(keys.alloc.as_str(), principal, now, self.quota, keys.op.as_str()).await?
            {
                Allocation::Node(node) => node,
                refused => return Err(self.refused(refused)),
            };
        self.domain.insert_lease(&keys.lease_id(), &node.node_id, principal, now, keys.op.as_str()).await?;
        let (intent, created) = self.domain.begin_intent(keys.boot.as_str(), "boot", keys.op.as_str(), now).await?;
        Ok((node, intent, created, false))
    }

    /// The answer to an allocation that took no node.
    fn refused(&self, refused: Allocation) -> ServiceError {
        match refused {
            Allocation::QuotaExceeded => ServiceError::QuotaExceeded(self.quota),
            Allocation::Exhausted | Allocation::Node(_) => ServiceError::CapacityExhausted,
        }
    }

    /// A pending boot intent from an earlier attempt: the VM it booted, if one exists. When a
    /// late landing made a second VM with the same tag, one is kept and the others are deleted.
    /// Which one is decided in the database, not from `intent` as this attempt read it (an
    /// overlapping attempt may have adopted one since): the VM the intent records, or else the
    /// first by id (so every replica picks the same), recorded in a transaction fenced on the
    /// operation (a finished or rolled-back operation adopts and deletes nothing).
    async fn adopt_boot(&self, intent: &Intent, op_id: &str) -> Result<Option<String>, ServiceError> {
        let found = self.hypervisor.list_by_tag(&intent.intent_id).await.map_err(|e| {
            tracing::warn!(error = %ErrorChain(&e), "cannot list VMs by tag to reconcile a boot");
            ServiceError::upstream("cannot ask the hypervisor what an earlier attempt did; retry with the same key")
        })?;
        let Some(first) = found.iter().map(|vm| &vm.vm_id).min() else { return Ok(None) };
        let keep = self.domain.adopt_vm(&intent.intent_id, op_id, first).await?;
        let (kept, extra): (Vec<Vm>, Vec<Vm>) = found.into_iter().partition(|vm| vm.vm_id == keep);
        let extra: Vec<String> = extra.into_iter().map(|vm| vm.vm_id).collect();
        destroy_duplicates(&self.hypervisor, &intent.intent_id, &keep, &extra).await;
        // A boot cut between its define and its start (libvirt) left the VM stopped: the worker
        // this create answers with must run. A failure leaves the intent pending; the retry
        // adopts the same VM and starts it.
        if let Some(vm) = kept.first() {
            self.hypervisor.ensure_running(vm).await.map_err(|e| {
                tracing::warn!(error = %ErrorChain(&e), vm_id = %keep, "cannot start the VM an earlier attempt booted");
                ServiceError::upstream("cannot start the VM an earlier attempt booted; retry with the same key")
            })?;
        }
        tracing::info!(tag = %intent.intent_id, vm_id = %keep, "adopted the VM an earlier attempt booted");
        Ok(Some(keep))
    }

    /// Stamps the intent with the moment its hypervisor call is sent, before sending it. Two
    /// guards make the stamp safe to measure the settle window from:
    /// - It is taken by compare-and-set on `intent`'s stamp, the one this attempt decided from:
    ///   if another attempt stamped (or the reaper took) the intent since, this one sends nothing
    ///   and answers 503. Attempts can overlap although the claim is exclusive: a holder whose
    ///   claim went stale (its heartbeats could not reach a restarting database) still runs when
    ///   a retry reclaims it.
    /// - It is a promise a little ahead of the clock, taken inside the transaction once it holds
    ///   its lock (so a queue for the database never eats into it): the call goes out only if the
    ///   commit came back before the stamped moment, so the window is never measured from a
    ///   moment earlier than the real send. A commit slower than that answers 503 and sends
    ///   nothing; the retry waits out the settle window from the stamp, which is safe.
    async fn mark_sending(&self, intent: &Intent, op_id: &str) -> Result<(), ServiceError> {
        let tag = intent.intent_id.as_str();
        may_send(tag, self.domain.stamp_intent(tag, op_id, intent.last_attempt_at).await?).map(drop)
    }

    /// Errs with 503 + Retry-After while a call from an earlier attempt may still land: until
    /// the settle window has passed since that call was sent.
    fn settled(&self, intent: &Intent) -> Result<(), ServiceError> {
        if intent.state == "failed" {
            return Ok(()); // that call definitely did not happen
        }
        settled_since(&intent.intent_id, intent.last_attempt_at, self.settle)
    }

    /// A boot that failed: pending (and 503) when it may have happened; otherwise the node and
    /// the lease are given back and the intent marked failed before answering.
    async fn boot_failed(&self, keys: &CreateKeys, e: HvError) -> ServiceError {
        if e.may_have_happened() {
            return Self::ambiguous(e);
        }
        match self.domain.release_refused(keys.alloc.as_str(), &keys.lease_id(), keys.boot.as_str()).await {
            Ok(released) => {
                metrics::counter!(REFUSALS_RELEASED_TOTAL).increment(1);
                tracing::info!(error = %ErrorChain(&e), leases = released.leases, nodes = released.nodes,
                    "the hypervisor refused the boot; node and lease given back");
            }
            Err(db) => return db.into(),
        }
        Self::definite(e)
    }

    /// The answer to a call that may have taken effect: the intent stays pending.
    fn ambiguous(e: HvError) -> ServiceError {
        tracing::warn!(error = %ErrorChain(&e), "hypervisor call may or may not have taken effect");
        ServiceError::upstream("the hypervisor call may or may not have taken effect; retry with the same key")
    }

    /// The answer to a call that definitely did not take effect.
    fn definite(e: HvError) -> ServiceError {
        tracing::warn!(error = %ErrorChain(&e), "hypervisor call refused or not sent");
        match e.status() {
            Some(status) => ServiceError::UpstreamRefused(format!("status {}", status.as_u16())),
            None => ServiceError::upstream("the hypervisor is unreachable"),
        }
    }

    /// Deletes a worker: its VM first (so a failure never leaves a VM without a worker), then
    /// the worker, its lease and its node in one transaction that leaves a tombstone keyed by
    /// the delete's sub-key. A retry that finds its own tombstone answers 204, not 404.
    pub async fn delete(&self, principal: &str, worker_id: &str, op: &Operation) -> Result<(), ServiceError> {
        let tombstone = op.derive("delete");
        let Some(w) = self.domain.worker(principal, worker_id).await? else {
            return match self.domain.tombstone(tombstone.as_str()).await? {
                Some(deleted) if deleted == worker_id => Ok(()),
                _ => Err(ServiceError::NotFound(worker_id.into())),
            };
        };
        let now = now_micros();
        self.domain.begin_attempt(&op.row("delete", now), now.saturating_add(micros(self.settle))).await?;
        // Deleting a VM by id is naturally idempotent: "already gone" is success.
        self.hypervisor.delete(&w.vm_id).await.map_err(|e| {
            tracing::warn!(error = %ErrorChain(&e), "cannot delete the VM");
            ServiceError::upstream("cannot delete the VM; retry with the same key")
        })?;
        self.domain.delete_worker(principal, worker_id, tombstone.as_str(), now_micros()).await?;
        Ok(())
    }

    /// Reboots a worker once per record: the intent keyed by the record's `reboot` sub-key is
    /// reconciled against the VM's `reboot_tags` before any second call, and a second call waits
    /// out the settle window of the first.
    pub async fn reboot(&self, principal: &str, worker_id: &str, op: &Operation) -> Result<i64, ServiceError> {
        let w =
            self.domain.worker(principal, worker_id).await?.ok_or_else(|| ServiceError::NotFound(worker_id.into()))?;
        match self.reboot_once(&w, op).await {
            // The reboot finished (an overlapping attempt did it): this attempt sends nothing
            // and answers the count it left.
            Err(ServiceError::Database(DomainError::Finished)) => match self.domain.worker(principal, worker_id).await?
            {
                Some(w) => Ok(w.reboot_count),
                None => Err(ServiceError::NotFound(worker_id.into())),
            },
            done => done,
        }
    }

    /// The steps of a reboot of `w`, each fenced on the operation's row: a finished or
    /// rolled-back operation is refused in the step's own transaction.
    async fn reboot_once(&self, w: &WorkerRow, op: &Operation) -> Result<i64, ServiceError> {
        let worker_id = w.worker_id.as_str();
        let reboot_key = op.derive("reboot");
        let tag = reboot_key.as_str();
        let now = now_micros();
        let row = op.row("reboot", now);
        self.hook.at(Step::RebootDecide).await;
        self.domain.begin_attempt(&row, now.saturating_add(micros(self.settle))).await?;
        let (intent, created) = self.domain.begin_intent(tag, "reboot", &row.op_id, now).await?;
        if intent.state == "done" {
            return Ok(self.domain.finish_reboot(tag, &w.vm_id, worker_id, &row.op_id).await?);
        }
        if !created {
            let vm = self.hypervisor.get(&w.vm_id).await.map_err(|e| {
                tracing::warn!(error = %ErrorChain(&e), "cannot read the VM to reconcile a reboot");
                ServiceError::upstream(
                    "cannot ask the hypervisor whether an earlier reboot happened; retry with the same key",
                )
            })?;
            if vm.as_ref().is_some_and(|vm| vm.reboot_tags.iter().any(|t| t == tag)) {
                return Ok(self.domain.finish_reboot(tag, &w.vm_id, worker_id, &row.op_id).await?);
            }
            self.settled(&intent)?;
        }
        self.mark_sending(&intent, &row.op_id).await?;
        match self.hypervisor.reboot(&w.vm_id, tag).await {
            Ok(()) => Ok(self.domain.finish_reboot(tag, &w.vm_id, worker_id, &row.op_id).await?),
            Err(e) if e.may_have_happened() => Err(Self::ambiguous(e)),
            Err(e) => {
                self.domain.fail_intent(tag).await?;
                // No such VM: a delete of this worker removed it (a delete takes the VM first,
                // then the row). Nothing was rebooted, and there is nothing left to reboot.
                if e.status() == Some(reqwest::StatusCode::NOT_FOUND) {
                    tracing::info!(worker_id, vm_id = %w.vm_id, "reboot of a worker whose VM is gone");
                    return Err(ServiceError::NotFound(worker_id.into()));
                }
                Err(Self::definite(e))
            }
        }
    }
}
