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

pub use leasebroker_api::{
    CreateWorker, FlashFirmware, InvalidRequest, Limits, MAX_IMAGE, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS,
};

use idempotency_effects::{Attempt, Decided, Effect, Effects, IntentState, Sent};

use crate::domain::{
    Allocation, CreateStart, Domain, DomainError, Node, Principal, StartCreate, WorkerId, WorkerRow,
    is_unique_violation,
};
use crate::hypervisor::client::{BootRequest, HypervisorClient};

mod calls;
mod effects;
mod error;
mod hook;
mod keys;

pub(crate) use calls::{longest_settle_retry_after, micros, now_micros};
pub use effects::{Boot, DeleteVm, Reboot, TAG_PREFIX};
pub(crate) use effects::{call_error, effect_failed};
pub use error::ServiceError;
pub use hook::{Hook, Step};
pub use keys::{CreateKeys, OpKind, RequestRecord, is_worker_id, public_id};

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
    /// The side-effect runner: the effect ledger on the service's database, with
    /// `--hypervisor-settle`.
    pub fn effects(&self) -> Effects {
        Effects::new(self.domain.ledger()).settle(self.settle)
    }

    /// The boot effect.
    pub fn boot_effect(&self) -> Boot {
        Boot { hypervisor: self.hypervisor.clone() }
    }

    /// Creates a worker, resuming whatever an earlier attempt of the same record did.
    pub async fn create(
        &self,
        principal: &Principal,
        req: &CreateWorker,
        op: &RequestRecord,
    ) -> Result<WorkerRow, ServiceError> {
        req.validate(self.limits)?;
        let keys = CreateKeys::of(op);
        let worker_id = keys.worker_id();
        let lease_id = keys.lease_id();
        let attempt = self.effects().attempt(&op.effects_op(OpKind::Create));
        let boot = self.boot_effect();
        self.hook.at(Step::CreateDecide).await;
        // One commit for everything before the call: the attempt and the boot intent (born with
        // its send stamp when it is new), the node, the lease. It decides too whether the create
        // finished already (its worker exists or was deleted): in the transaction, not before.
        let start = StartCreate {
            attempt: &attempt,
            boot: &boot,
            principal,
            alloc_id: keys.alloc.as_str(),
            lease_id: &lease_id,
            worker_id: &worker_id,
            quota: self.quota,
            now: now_micros(),
        };
        let (node, decided) = match self.domain.start_create(start).await {
            Ok(CreateStart::Held { node, decided }) => (node, decided),
            Ok(CreateStart::Refused(refused)) => return Err(self.refused(refused)),
            Ok(CreateStart::Finished) | Err(DomainError::Finished) => {
                return self.finished(principal, &worker_id).await;
            }
            // An overlapping attempt of this request allocated at the same moment: step by step,
            // each step finds what it did.
            Err(DomainError::Db(e)) if is_unique_violation(&e) => {
                match self.start_stepwise(&keys, &attempt, &boot, principal).await {
                    Err(ServiceError::Database(DomainError::Finished)) => {
                        return self.finished(principal, &worker_id).await;
                    }
                    started => started?,
                }
            }
            Err(e) => return Err(e.into()),
        };
        // A boot found pending was sent by an earlier attempt: reconciled by tag first.
        let reconciling = matches!(&decided, Decided::Existing(i) if i.state == IntentState::Pending);
        if reconciling {
            self.hook.at(Step::CreateAdopt).await;
        }
        // Any boot an earlier attempt recorded (pending, or done: an adoption records the VM
        // before it starts it, and its start may have failed since) must run before this one
        // answers with it.
        let earlier = matches!(&decided, Decided::Existing(_));
        let request =
            BootRequest { image: req.image.clone(), cpu: req.cpu, memory_gb: req.memory_gb, tag: String::new() };
        let hypervisor = &self.hypervisor;
        // What a boot sent now made is recorded by the last commit, with the worker.
        let booted = attempt
            .run_decided_unrecorded(&boot, decided, |tag| async move {
                let vm = hypervisor.boot(&BootRequest { tag, ..request }).await.map_err(call_error)?;
                Ok(Sent::Done(vm.vm_id))
            })
            .await;
        let made = match booted {
            Ok(made) => made,
            Err(idempotency_effects::EffectError::Finished) => return self.finished(principal, &worker_id).await,
            Err(e @ idempotency_effects::EffectError::Refused(_)) => return Err(self.boot_refused(&keys, e).await),
            Err(e) => return Err(effect_failed(e, "hypervisor")),
        };
        let vm_id = made.outcome().id().to_owned();
        if earlier {
            self.ensure_running(&vm_id).await?;
        }

        let labels = serde_json::to_string(&req.labels.clone().unwrap_or_default()).unwrap_or_else(|_| "{}".into());
        let row = WorkerRow {
            worker_id,
            principal: principal.clone(),
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
        // One commit for everything after the call: the VM, the operation finished, the worker.
        match self.domain.finish_create(&attempt, &made, &row).await {
            Ok((w, recorded)) => {
                attempt.undo_unkept(&boot, &made, &recorded).await;
                Ok(w)
            }
            // An overlapping attempt finished the create first: its worker is the answer.
            Err(DomainError::Finished) => self.finished(principal, &row.worker_id).await,
            Err(e) => Err(e.into()),
        }
    }

    /// The answer of a create that finished already: its worker, or `410` when the worker was
    /// deleted since. Never runs a step again.
    async fn finished(&self, principal: &Principal, worker_id: &WorkerId) -> Result<WorkerRow, ServiceError> {
        if let Some(w) = self.domain.worker(principal, worker_id).await? {
            return Ok(w);
        }
        if self.domain.is_deleted(worker_id).await? {
            return Err(ServiceError::Gone(worker_id.to_string()));
        }
        Err(DomainError::Finished.into())
    }

    /// The steps before the call one transaction each, as an overlapping attempt needs them:
    /// the ledger's decide step (which records the attempt, the fence of the others), then the
    /// allocation and the lease, each resolving a unique violation by finding the other
    /// attempt's row.
    async fn start_stepwise(
        &self,
        keys: &CreateKeys,
        attempt: &Attempt,
        boot: &dyn Effect,
        principal: &Principal,
    ) -> Result<(Node, Decided), ServiceError> {
        let decided = attempt.decide(boot).await.map_err(|e| ServiceError::Database(e.into()))?;
        let now = now_micros();
        let op_id = attempt.operation().id();
        let node = match self.domain.allocate_within(keys.alloc.as_str(), principal, now, self.quota, op_id).await? {
            Allocation::Node(node) => node,
            refused => return Err(self.refused(refused)),
        };
        self.domain.insert_lease(&keys.lease_id(), &node.node_id, principal, now, op_id).await?;
        Ok((node, decided))
    }

    /// The answer to an allocation that took no node.
    fn refused(&self, refused: Allocation) -> ServiceError {
        match refused {
            Allocation::QuotaExceeded => ServiceError::QuotaExceeded(self.quota),
            Allocation::Exhausted | Allocation::Node(_) => ServiceError::CapacityExhausted,
        }
    }

    /// A boot cut between its define and its start (libvirt) left the VM stopped: the worker a
    /// create answers with must run. A failure answers 503; the retry, finding the boot recorded
    /// (pending, or done by the adoption that failed to start it), starts the same VM.
    async fn ensure_running(&self, vm_id: &str) -> Result<(), ServiceError> {
        let unavailable = |e: crate::hypervisor::client::HvError| {
            tracing::warn!(error = %ErrorChain(&e), vm_id, "cannot start the VM an earlier attempt booted");
            ServiceError::upstream("cannot start the VM an earlier attempt booted; retry with the same key")
        };
        self.hypervisor.ensure_running_by_id(vm_id).await.map_err(unavailable)
    }

    /// A boot the hypervisor definitely refused (the library released its intent): the node and
    /// the lease are given back before answering.
    async fn boot_refused(&self, keys: &CreateKeys, e: idempotency_effects::EffectError) -> ServiceError {
        match self.domain.release(keys.alloc.as_str(), &keys.lease_id()).await {
            Ok(released) => {
                metrics::counter!(crate::metric::REFUSALS_RELEASED_TOTAL).increment(1);
                tracing::info!(
                    leases = released.leases,
                    nodes = released.nodes,
                    "the hypervisor refused the boot; node and lease given back"
                );
            }
            Err(db) => return db.into(),
        }
        effect_failed(e, "hypervisor")
    }

    /// Deletes a worker: its VM first (so a failure never leaves a VM without a worker), then
    /// the worker, its lease and its node in one transaction that finishes the operation and
    /// leaves a tombstone keyed by the delete's sub-key. A retry that finds its own tombstone
    /// answers 204, not 404.
    pub async fn delete(
        &self,
        principal: &Principal,
        worker_id: &WorkerId,
        op: &RequestRecord,
    ) -> Result<(), ServiceError> {
        let tombstone = op.derive("delete");
        let gone = || async {
            match self.domain.tombstone(tombstone.as_str()).await? {
                Some(deleted) if deleted == *worker_id => Ok(()),
                _ => Err(ServiceError::NotFound(worker_id.to_string())),
            }
        };
        let Some(w) = self.domain.worker(principal, worker_id).await? else { return gone().await };
        let attempt = self.effects().attempt(&op.effects_op(OpKind::Delete).with_subject(worker_id.as_str()));
        let effect = DeleteVm { hypervisor: self.hypervisor.clone(), vm_id: w.vm_id.clone() };
        let hypervisor = &self.hypervisor;
        let vm_id = w.vm_id.as_str();
        let deleted = attempt
            .run(&effect, |_tag| async move {
                // Deleting a VM by id is naturally idempotent: "already gone" is success.
                hypervisor.delete(vm_id).await.map_err(call_error)?;
                Ok(Sent::Done(vm_id.to_owned()))
            })
            .await;
        match deleted {
            Ok(_) => {}
            Err(idempotency_effects::EffectError::Finished) => return gone().await,
            Err(e) => return Err(effect_failed(e, "hypervisor")),
        }
        match self.domain.finish_delete(&attempt, principal, worker_id, tombstone.as_str(), now_micros()).await {
            Ok(_) | Err(DomainError::Finished) => {}
            Err(e) => return Err(e.into()),
        }
        // The VM is gone: no finished create owns it any more.
        if let Err(e) = self.domain.ledger().disown(&w.vm_id).await {
            tracing::warn!(error = %ErrorChain(&e), vm_id = %w.vm_id, "cannot disown a deleted worker's VM");
        }
        gone().await
    }

    /// Reboots a worker once per record: the intent keyed by the record's `reboot` sub-key is
    /// reconciled against the VM's `reboot_tags` before any second call, and a second call waits
    /// out the settle window of the first.
    pub async fn reboot(
        &self,
        principal: &Principal,
        worker_id: &WorkerId,
        op: &RequestRecord,
    ) -> Result<i64, ServiceError> {
        let not_found = || ServiceError::NotFound(worker_id.to_string());
        let w = self.domain.worker(principal, worker_id).await?.ok_or_else(not_found)?;
        let attempt = self.effects().attempt(&op.effects_op(OpKind::Reboot));
        self.hook.at(Step::RebootDecide).await;
        let effect = Reboot { hypervisor: self.hypervisor.clone(), vm_id: w.vm_id.clone() };
        let hypervisor = &self.hypervisor;
        let vm_id = w.vm_id.as_str();
        // What a reboot sent now did is recorded by the last commit, with the count.
        let rebooted = async {
            let decided = attempt.decide(&effect).await?;
            attempt
                .run_decided_unrecorded(&effect, decided, |tag| async move {
                    hypervisor.reboot(vm_id, &tag).await.map_err(call_error)?;
                    Ok(Sent::Done(vm_id.to_owned()))
                })
                .await
        }
        .await;
        let made = match rebooted {
            Ok(made) => Some(made),
            // The reboot finished (an overlapping attempt did it): this attempt sends nothing
            // and answers the count it left.
            Err(idempotency_effects::EffectError::Finished) => None,
            // No such VM: a delete of this worker removed it (a delete takes the VM first, then
            // the row). Nothing was rebooted, and there is nothing left to reboot.
            Err(idempotency_effects::EffectError::Refused(e)) if e.status() == Some(404) => {
                tracing::info!(%worker_id, vm_id = %w.vm_id, "reboot of a worker whose VM is gone");
                return Err(not_found());
            }
            Err(e) => return Err(effect_failed(e, "hypervisor")),
        };
        self.domain.finish_reboot(&attempt, made.as_ref(), worker_id).await?;
        match self.domain.worker(principal, worker_id).await? {
            Some(w) => Ok(w.reboot_count),
            None => Err(not_found()),
        }
    }
}
