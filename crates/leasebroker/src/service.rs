//! The resumable handlers: create, delete and reboot a worker, each side effect keyed off the
//! request's idempotency record so that a retry resumes instead of repeating.
//!
//! Create, as the design describes it:
//! 1. `allocate(derive("alloc"))` returns the node already allocated under that id, if any;
//! 2. `insert_lease(derive("lease"))` likewise;
//! 3. the boot goes through an intent keyed by `derive("boot")`: record it, then call the
//!    hypervisor with the sub-key as the VM's `tag`, then record the VM. A retry that finds the
//!    intent pending lists the hypervisor's VMs by that tag and adopts what exists; it boots
//!    again only when nothing exists and the last call is older than the hypervisor timeout (a
//!    call from a dead attempt may still land; before then it answers 503 + Retry-After).
//! 4. the worker row, keyed by `derive("worker")`.

use std::collections::BTreeMap;
use std::time::Duration;

use idempotency::SubKey;
use serde::{Deserialize, Serialize};

use crate::domain::{Allocation, Domain, DomainError, Intent, WorkerRow};
use crate::hypervisor::client::{BootRequest, HvError, HypervisorClient};

/// Why an operation did not succeed; each maps to one problem+json response.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Invalid fields (422).
    #[error("{0}")]
    Invalid(String),
    /// No such worker for this principal (404).
    #[error("no worker {0}")]
    NotFound(String),
    /// No free node (503 + Retry-After).
    #[error("no free node in the pool")]
    CapacityExhausted,
    /// The principal holds `--max-workers-per-principal` workers already (403; not stored).
    #[error("this principal holds its quota of {0} workers; delete one first")]
    QuotaExceeded(u32),
    /// The hypervisor could not be reached or may not have acted; try again (503 + Retry-After).
    #[error("{reason}")]
    UpstreamUnavailable {
        /// What happened.
        reason: String,
        /// Seconds to wait.
        retry_after: u64,
    },
    /// The hypervisor refused the call (502).
    #[error("the hypervisor refused the call: {0}")]
    UpstreamRefused(String),
    /// The database failed (500; not stored, so the retry runs again).
    #[error(transparent)]
    Database(#[from] DomainError),
}

/// `POST /v1/workers` body.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWorker {
    /// The image to boot, 1-200 characters.
    #[schema(min_length = 1, max_length = 200, example = "worker-base:2025.11")]
    pub image: String,
    /// CPUs, 1 to the node size.
    #[schema(minimum = 1, example = 16)]
    pub cpu: i64,
    /// Memory in GB, 1 to the node size.
    #[schema(minimum = 1, example = 64)]
    pub memory_gb: i64,
    /// At most 64 labels; keys 1-63 characters, values at most 255.
    #[serde(default)]
    #[schema(example = json!({"team": "ml-eval"}))]
    pub labels: Option<BTreeMap<String, String>>,
}

/// Limits on a worker request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest `cpu`.
    pub node_cpu: i64,
    /// Largest `memory_gb`.
    pub node_memory_gb: i64,
}

/// The most labels a worker may carry.
pub const MAX_LABELS: usize = 64;
/// The longest label key.
pub const MAX_LABEL_KEY: usize = 63;
/// The longest label value.
pub const MAX_LABEL_VALUE: usize = 255;
/// The longest image name.
pub const MAX_IMAGE: usize = 200;

impl CreateWorker {
    /// Checks every field; the first problem found is the error.
    pub fn validate(&self, limits: Limits) -> Result<(), ServiceError> {
        let invalid = |m: String| Err(ServiceError::Invalid(m));
        let image_len = self.image.chars().count();
        if image_len == 0 || image_len > MAX_IMAGE {
            return invalid(format!("image must be 1 to {MAX_IMAGE} characters, got {image_len}"));
        }
        if self.image.chars().any(char::is_control) {
            return invalid("image must not contain control characters".into());
        }
        if !(1..=limits.node_cpu).contains(&self.cpu) {
            return invalid(format!("cpu must be 1 to {}, got {}", limits.node_cpu, self.cpu));
        }
        if !(1..=limits.node_memory_gb).contains(&self.memory_gb) {
            return invalid(format!("memory_gb must be 1 to {}, got {}", limits.node_memory_gb, self.memory_gb));
        }
        if let Some(labels) = &self.labels {
            if labels.len() > MAX_LABELS {
                return invalid(format!("at most {MAX_LABELS} labels, got {}", labels.len()));
            }
            for (k, v) in labels {
                if k.is_empty() || k.chars().count() > MAX_LABEL_KEY {
                    return invalid(format!("label keys must be 1 to {MAX_LABEL_KEY} characters"));
                }
                if v.chars().count() > MAX_LABEL_VALUE {
                    return invalid(format!("label values must be at most {MAX_LABEL_VALUE} characters"));
                }
            }
        }
        Ok(())
    }
}

/// The sub-keys of one create request.
#[derive(Debug, Clone)]
pub struct CreateKeys {
    /// The node allocation.
    pub alloc: SubKey,
    /// The lease.
    pub lease: SubKey,
    /// The VM boot (also its hypervisor tag).
    pub boot: SubKey,
    /// The worker row.
    pub worker: SubKey,
}

/// Public ids are a prefix and 16 hex digits of a sub-key.
pub fn public_id(prefix: &str, sub: &SubKey) -> String {
    let hex = sub.as_str().trim_start_matches("sk-");
    format!("{prefix}-{}", &hex[..16.min(hex.len())])
}

fn now_micros() -> i64 {
    idempotency::now().timestamp_micros()
}

/// The workers service.
#[derive(Debug, Clone)]
pub struct Workers {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// The hypervisor timeout: also the reconcile grace window.
    pub grace: Duration,
    /// Field limits.
    pub limits: Limits,
    /// The most workers one principal may hold (0: no limit).
    pub quota: u32,
}

/// How a pending intent's call is resolved: the VM it made, or an error to answer with.
enum Resolved {
    Vm(String),
    CallNow,
}

impl Workers {
    /// Creates a worker, resuming whatever an earlier attempt of the same record did.
    pub async fn create(
        &self,
        principal: &str,
        req: &CreateWorker,
        keys: &CreateKeys,
    ) -> Result<WorkerRow, ServiceError> {
        req.validate(self.limits)?;
        let worker_id = public_id("wkr", &keys.worker);
        // A finished earlier attempt whose response was not stored (say, the process died
        // between the worker insert and the record's completion): answer from the row.
        if let Some(w) = self.domain.worker(principal, &worker_id).await? {
            return Ok(w);
        }
        let now = now_micros();
        let node = match self.domain.allocate_within(keys.alloc.as_str(), principal, now, self.quota).await? {
            Allocation::Node(node) => node,
            Allocation::Exhausted => return Err(ServiceError::CapacityExhausted),
            Allocation::QuotaExceeded => return Err(ServiceError::QuotaExceeded(self.quota)),
        };
        let lease_id = public_id("lse", &keys.lease);
        self.domain.insert_lease(&lease_id, &node.node_id, principal, now).await?;

        let tag = keys.boot.as_str();
        let (intent, created) = self.domain.begin_intent(tag, "boot", now).await?;
        let vm_id = match intent.state.as_str() {
            "done" => intent.vm_id.clone().unwrap_or_default(),
            _ => {
                let resolved = if created { Resolved::CallNow } else { self.reconcile_boot(&intent).await? };
                match resolved {
                    Resolved::Vm(vm_id) => self.domain.finish_boot(tag, &vm_id).await?,
                    Resolved::CallNow => {
                        if !created {
                            self.domain.touch_intent(tag, now_micros()).await?;
                        }
                        let boot = BootRequest {
                            image: req.image.clone(),
                            cpu: req.cpu,
                            memory_gb: req.memory_gb,
                            tag: tag.to_owned(),
                        };
                        match self.hypervisor.boot(&boot).await {
                            Ok(vm) => self.domain.finish_boot(tag, &vm.vm_id).await?,
                            Err(e) => return Err(self.upstream_failure(tag, e).await),
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
        Ok(self.domain.insert_worker(&row).await?)
    }

    /// A pending boot intent from an earlier attempt: adopt the VM it booted, or decide whether
    /// booting again is safe yet.
    async fn reconcile_boot(&self, intent: &Intent) -> Result<Resolved, ServiceError> {
        let found =
            self.hypervisor.list_by_tag(&intent.intent_id).await.map_err(|e| ServiceError::UpstreamUnavailable {
                reason: format!("cannot ask the hypervisor what an earlier attempt did: {e}"),
                retry_after: 1,
            })?;
        if let Some(vm) = found.into_iter().min_by(|a, b| a.vm_id.cmp(&b.vm_id)) {
            return Ok(Resolved::Vm(vm.vm_id));
        }
        self.grace_elapsed(intent)?;
        Ok(Resolved::CallNow)
    }

    /// Errs with 503 + Retry-After while a call from an earlier attempt may still land.
    fn grace_elapsed(&self, intent: &Intent) -> Result<(), ServiceError> {
        if intent.state == "failed" {
            return Ok(()); // that call definitely did not happen
        }
        let grace = i64::try_from(self.grace.as_micros()).unwrap_or(i64::MAX);
        let waited = now_micros().saturating_sub(intent.last_attempt_at);
        if waited < grace {
            let left = ((grace - waited) + 999_999) / 1_000_000;
            return Err(ServiceError::UpstreamUnavailable {
                reason: "an earlier attempt's hypervisor call may still land; not calling again yet".into(),
                retry_after: u64::try_from(left).unwrap_or(1),
            });
        }
        Ok(())
    }

    /// Records the outcome of a failed hypervisor call and turns it into the answer.
    async fn upstream_failure(&self, intent_id: &str, e: HvError) -> ServiceError {
        if e.may_have_happened() {
            // Leave the intent pending: the retry looks (by tag) before it calls again, so it can
            // come at once; if nothing is found it is told how much of the grace window is left.
            ServiceError::UpstreamUnavailable {
                reason: format!("the hypervisor call may or may not have happened ({e}); retry with the same key"),
                retry_after: 1,
            }
        } else {
            if let Err(db) = self.domain.fail_intent(intent_id).await {
                return db.into();
            }
            match e {
                HvError::Status { .. } => ServiceError::UpstreamRefused(e.to_string()),
                _ => ServiceError::UpstreamUnavailable {
                    reason: format!("the hypervisor is unreachable: {e}"),
                    retry_after: 1,
                },
            }
        }
    }

    /// Deletes a worker: its VM first (so a failure never leaves a VM without a worker), then
    /// the worker, its lease and its node in one transaction.
    pub async fn delete(&self, principal: &str, worker_id: &str) -> Result<(), ServiceError> {
        let w =
            self.domain.worker(principal, worker_id).await?.ok_or_else(|| ServiceError::NotFound(worker_id.into()))?;
        // Deleting a VM by id is naturally idempotent: "already gone" is success.
        self.hypervisor.delete(&w.vm_id).await.map_err(|e| ServiceError::UpstreamUnavailable {
            reason: format!("cannot delete the VM: {e}"),
            retry_after: 1,
        })?;
        self.domain.delete_worker(principal, worker_id).await?;
        Ok(())
    }

    /// Reboots a worker once per record: the intent keyed by `reboot_key` is reconciled against
    /// the VM's `reboot_tags` before any second call.
    pub async fn reboot(&self, principal: &str, worker_id: &str, reboot_key: &SubKey) -> Result<i64, ServiceError> {
        let w =
            self.domain.worker(principal, worker_id).await?.ok_or_else(|| ServiceError::NotFound(worker_id.into()))?;
        let tag = reboot_key.as_str();
        let (intent, created) = self.domain.begin_intent(tag, "reboot", now_micros()).await?;
        if intent.state == "done" {
            return Ok(self.domain.finish_reboot(tag, &w.vm_id, &w.worker_id).await?);
        }
        if !created {
            let vm = self.hypervisor.get(&w.vm_id).await.map_err(|e| ServiceError::UpstreamUnavailable {
                reason: format!("cannot ask the hypervisor whether an earlier reboot happened: {e}"),
                retry_after: 1,
            })?;
            if vm.as_ref().is_some_and(|vm| vm.reboot_tags.iter().any(|t| t == tag)) {
                return Ok(self.domain.finish_reboot(tag, &w.vm_id, &w.worker_id).await?);
            }
            self.grace_elapsed(&intent)?;
            self.domain.touch_intent(tag, now_micros()).await?;
        }
        match self.hypervisor.reboot(&w.vm_id, tag).await {
            Ok(()) => Ok(self.domain.finish_reboot(tag, &w.vm_id, &w.worker_id).await?),
            Err(e) => Err(self.upstream_failure(tag, e).await),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(image: &str, cpu: i64, mem: i64, labels: usize) -> CreateWorker {
        CreateWorker {
            image: image.into(),
            cpu,
            memory_gb: mem,
            labels: Some((0..labels).map(|i| (format!("k{i}"), "v".into())).collect()),
        }
    }

    #[test]
    fn validation() {
        let l = Limits { node_cpu: 64, node_memory_gb: 512 };
        assert!(req("img", 16, 64, 2).validate(l).is_ok());
        assert!(req("", 16, 64, 0).validate(l).is_err());
        assert!(req(&"x".repeat(201), 16, 64, 0).validate(l).is_err());
        assert!(req("img", 0, 64, 0).validate(l).is_err());
        assert!(req("img", 65, 64, 0).validate(l).is_err());
        assert!(req("img", 1, 513, 0).validate(l).is_err());
        assert!(req("img", 1, 1, 65).validate(l).is_err());
        assert!(req("img", 1, 1, 64).validate(l).is_ok());
        let mut r = req("img", 1, 1, 0);
        r.labels = Some([("k".repeat(64), "v".into())].into());
        assert!(r.validate(l).is_err());
        r.labels = Some([("k".into(), "v".repeat(256))].into());
        assert!(r.validate(l).is_err());
    }
}
