//! The record an operation runs under, and the sub-keys and public ids derived from it.

use idempotency::{Record, SubKey};

use crate::domain::OperationRow;

/// The idempotency record an operation runs under: every side effect derives its sub-key from
/// it, and the reaper finds the record again through it.
#[derive(Debug, Clone)]
pub struct Operation {
    record: Record,
}

impl Operation {
    /// The operation of `record` (the claim's record, in a handler).
    pub fn new(record: Record) -> Self {
        Self { record }
    }

    /// The sub-key of the side effect `label`.
    pub fn derive(&self, label: &str) -> SubKey {
        self.record.derive(label)
    }

    /// The operation's row, for an attempt starting at `now`.
    pub(super) fn row(&self, kind: &str, now: i64) -> OperationRow {
        let scope = &self.record.scope;
        OperationRow {
            op_id: self.derive("op").as_str().to_owned(),
            kind: kind.to_owned(),
            principal: scope.principal.as_str().to_owned(),
            endpoint: scope.endpoint.as_str().to_owned(),
            idem_key: scope.key.as_str().to_owned(),
            record_id: self.record.record_id.to_hex(),
            last_attempt_at: now,
        }
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
    pub fn of(op: &Operation) -> Self {
        Self::of_record(&op.record)
    }

    /// The sub-keys of the create whose record is `record`.
    pub fn of_record(record: &Record) -> Self {
        let d = |label| record.derive(label);
        Self { op: d("op"), alloc: d("alloc"), lease: d("lease"), boot: d("boot"), worker: d("worker") }
    }

    /// The lease's public id.
    pub fn lease_id(&self) -> String {
        public_id("lse", &self.lease)
    }

    /// The worker's public id.
    pub fn worker_id(&self) -> String {
        public_id("wkr", &self.worker)
    }
}

/// Public ids are a prefix and 16 hex digits of a sub-key.
pub fn public_id(prefix: &str, sub: &SubKey) -> String {
    let hex = sub.as_str().trim_start_matches("sk-");
    format!("{prefix}-{}", &hex[..16.min(hex.len())])
}
