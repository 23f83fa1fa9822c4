//! Why an operation did not succeed.

use super::InvalidRequest;
use crate::domain::DomainError;

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
    /// The hypervisor refused the call (502, not stored: nothing is held, a retry runs again).
    #[error("the hypervisor refused the call: {0}")]
    UpstreamRefused(String),
    /// The worker this create made was deleted since (410, stored): a retry never brings it back.
    #[error("worker {0} was deleted since this request created it; use a new key to create another")]
    Gone(String),
    /// No such node in the pool (404).
    #[error("no node {0}")]
    NoSuchNode(String),
    /// No such operation (404).
    #[error("no operation {0}")]
    NoSuchOperation(String),
    /// Another operation runs on the node, or ended `uncertain` there (409
    /// `operation-conflict`, naming it): nothing was sent.
    #[error("operation {op_id} holds this node; wait for it to end")]
    OperationConflict {
        /// The operation that holds the node.
        op_id: String,
        /// Whether it ended `uncertain` (an operator resolves it) rather than running.
        uncertain: bool,
    },
    /// A resolve of an operation that is not `uncertain` (409 `operation-not-uncertain`).
    #[error("operation {op_id} is {state}, not uncertain")]
    OperationNotUncertain {
        /// The operation.
        op_id: String,
        /// Its state.
        state: String,
    },
    /// The database failed (500; not stored, so the retry runs again).
    #[error(transparent)]
    Database(#[from] DomainError),
}

impl ServiceError {
    /// The downstream could not be reached or may not have acted: `503`, retry in a second.
    pub fn upstream(reason: impl Into<String>) -> Self {
        Self::UpstreamUnavailable { reason: reason.into(), retry_after: 1 }
    }
}

/// A body that fails validation is a 422 with the validator's message.
impl From<InvalidRequest> for ServiceError {
    fn from(e: InvalidRequest) -> Self {
        ServiceError::Invalid(e.message().to_owned())
    }
}
