//! The JSON shapes of the leasebroker API (docs/protocol.md#leasebroker-api). They are defined once, in
//! `leasebroker-api`, which the service serves from too; the SDK re-exports them.

pub use leasebroker_api::{
    CreateWorker, FlashFirmware, Fleet, InvalidNodeId, InvalidOperationId, InvalidRecordId, InvalidWorkerId,
    InvalidWorkerState, NodeId, Operation, OperationId, OperationKind, OperationState, RebootResult, Record, RecordId,
    RecordPage, RecordState, Resolution, ResolveOperation, Worker, WorkerId, WorkerPage, WorkerState,
};
