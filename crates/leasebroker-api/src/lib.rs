#![doc = include_str!("../README.md")]

mod fleet;
mod ids;
#[macro_use]
mod operations;
pub mod parse;
pub mod problems;
mod records;
mod sim;
pub mod text;
mod time;
mod workers;

pub use fleet::Fleet;
pub use ids::{
    InvalidNodeId, InvalidOperationId, InvalidRecordId, InvalidWorkerId, NodeId, OperationId, RecordId, WorkerId,
    is_path_id,
};
pub use operations::{
    FlashFirmware, MAX_REASON, MAX_VERSION, Operation, OperationKind, OperationState, Resolution, ResolveOperation,
};
pub use records::{Record, RecordPage, RecordState};
pub use sim::SimStats;
pub use workers::{
    CreateWorker, InvalidWorkerState, Limits, MAX_IMAGE, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, RebootResult,
    Worker, WorkerPage, WorkerState,
};

/// A body field out of bounds: the service answers `422` with this message as the detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(String);

impl InvalidRequest {
    /// What is wrong, as the problem's detail says it.
    pub fn message(&self) -> &str {
        &self.0
    }
}
