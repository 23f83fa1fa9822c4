//! The idempotency record a request's work runs under, and the sub-keys and public ids derived
//! from it.

use idempotency::{Record, SubKey};
use leasebroker_api::WorkerId;

/// The idempotency record a mutating request's work runs under: every side effect derives its
/// sub-key from it, and the reaper finds the record again through it. (Not the API's
/// long-running operation, [`crate::api::Operation`], nor the effect ledger's row,
/// [`idempotency_effects::Operation`], which is made from it by [`RequestRecord::effects_op`].)
#[derive(Debug, Clone)]
pub struct RequestRecord {
    record: Record,
}

impl RequestRecord {
    /// The work of `record` (the claim's record, in a handler).
    pub fn new(record: Record) -> Self {
        Self { record }
    }

    /// The sub-key of the side effect `label`.
    pub fn derive(&self, label: &str) -> SubKey {
        self.record.derive(label)
    }

    /// The operation in the effect ledger (its id is the sub-key `op`), of `kind`.
    pub fn effects_op(&self, kind: OpKind) -> idempotency_effects::Operation {
        idempotency_effects::Operation::of(&self.record, kind.as_str())
    }
}

/// The sub-keys of one create request.
#[derive(Debug, Clone)]
pub struct CreateKeys {
    /// The operation (and its row in `lb_operations`).
    pub op: SubKey,
    /// The node allocation.
    pub alloc: SubKey,
    /// The lease.
    pub lease: SubKey,
    /// The VM boot (also its hypervisor tag).
    pub boot: SubKey,
    /// The worker row.
    pub worker: SubKey,
}

impl CreateKeys {
    /// The sub-keys of the create `op` (the same on every retry of its record).
    pub fn of(op: &RequestRecord) -> Self {
        Self::of_record(&op.record)
    }

    /// The sub-keys of the create whose record is `record`.
    pub fn of_record(record: &Record) -> Self {
        Self::of_scope(&record.scope, &record.record_id)
    }

    /// The sub-keys of the create whose record had `scope` and `record_id` (the derivation needs
    /// nothing else, so the reaper derives them when the record itself is gone).
    pub fn of_scope(scope: &idempotency::Scope, record_id: &idempotency::RecordId) -> Self {
        let d = |label| idempotency::derive(scope, record_id, label);
        Self { op: d("op"), alloc: d("alloc"), lease: d("lease"), boot: d("boot"), worker: d("worker") }
    }

    /// The lease's public id.
    pub fn lease_id(&self) -> String {
        public_id("lse", &self.lease)
    }

    /// The worker's public id.
    pub fn worker_id(&self) -> WorkerId {
        // `wkr-` and hex digits: always a valid id.
        WorkerId::try_from(public_id("wkr", &self.worker)).expect("a worker's public id is path-safe")
    }
}

/// Public ids are a prefix and 16 hex digits of a sub-key.
pub fn public_id(prefix: &str, sub: &SubKey) -> String {
    let hex = sub.as_str().trim_start_matches("sk-");
    format!("{prefix}-{}", &hex[..16.min(hex.len())])
}

/// Whether `id` has the form [`public_id`] gives a worker's id: `wkr-` and hex digits.
pub fn is_worker_id(id: &str) -> bool {
    id.strip_prefix("wkr-")
        .is_some_and(|hex| !hex.is_empty() && hex.len() <= 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The kinds of leasebroker's operations, as the effect ledger stores them (`fx_operations.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// `POST /v1/workers`.
    Create,
    /// `POST /v1/workers/{id}/reboot`.
    Reboot,
    /// `DELETE /v1/workers/{id}`.
    Delete,
    /// `POST /admin/v1/nodes/{id}/firmware`.
    Flash,
}

impl OpKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Reboot => "reboot",
            Self::Delete => "delete",
            Self::Flash => "flash",
        }
    }

    /// Parses the stored name; `None` for a kind this version does not know.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "create" => Self::Create,
            "reboot" => Self::Reboot,
            "delete" => Self::Delete,
            "flash" => Self::Flash,
            _ => return None,
        })
    }
}
