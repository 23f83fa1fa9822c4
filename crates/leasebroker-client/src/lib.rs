#![doc = include_str!("../README.md")]
//!
//! The parts: [`Client`] (built by a [`ClientBuilder`], answering a [`Response`] or an
//! [`Error`]), the [`retry`] core with its [`OpKey`] and [`RetryPolicy`], and the [`journal`].

mod client;
mod error;
pub mod journal;
mod records;
pub mod retry;
mod types;

pub use client::{Client, ClientBuilder, DEFAULT_POLL_INTERVAL, Mutation, Response};
pub use error::{Error, IN_PROGRESS, KEY_REUSED, OPERATION_CONFLICT, Problem, retry_after};
pub use records::{InvalidRecordId, Record, RecordFilter, RecordId, RecordPage, RecordState};
pub use retry::{OpKey, RetryPolicy};
pub use types::{
    CreateWorker, FlashFirmware, Fleet, InvalidNodeId, InvalidOperationId, InvalidWorkerId, InvalidWorkerState, NodeId,
    Operation, OperationId, OperationKind, OperationState, RebootResult, Resolution, ResolveOperation, Worker,
    WorkerId, WorkerPage, WorkerState,
};
