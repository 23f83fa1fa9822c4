//! What the API shows: workers, pages, reboot results, operations, the fleet. The shapes are
//! `leasebroker-api`'s, the one definition the client reads too; here are the conversions from
//! the service's rows, where its SQL integers and strings become the wire's types.

use serde::Deserialize;

pub use leasebroker_api::{
    Fleet, NodeId, Operation, OperationId, OperationKind, OperationState, RebootResult, Worker, WorkerId, WorkerPage,
    WorkerState,
};

use crate::domain::{Counts, DomainError, FlashRow, WorkerRow};

/// Micros since the epoch as a time (the epoch itself for one out of chrono's range).
fn time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_micros(micros).unwrap_or_default()
}

/// A count read as SQL's `i64`; a negative one (never written) reads as 0.
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A size read as SQL's `i64`: within `u32`, since the service only stores what validation let
/// through; beyond it, the nearest bound.
fn size(n: i64) -> u32 {
    u32::try_from(n).unwrap_or(if n < 0 { 0 } else { u32::MAX })
}

/// A row field the service never writes in that form.
fn bad_row(e: impl std::fmt::Display) -> DomainError {
    DomainError::BadRow(e.to_string())
}

impl TryFrom<WorkerRow> for Worker {
    type Error = DomainError;

    fn try_from(w: WorkerRow) -> Result<Self, DomainError> {
        Ok(Self {
            id: w.worker_id,
            state: w.state.parse().map_err(bad_row)?,
            image: w.image,
            cpu: size(w.cpu),
            memory_gb: size(w.memory_gb),
            labels: serde_json::from_str(&w.labels).unwrap_or_default(),
            node_id: Some(w.node_id.into()),
            lease_id: Some(w.lease_id),
            vm_id: Some(w.vm_id),
            reboot_count: count(w.reboot_count),
            created_at: time(w.created_at),
        })
    }
}

impl TryFrom<FlashRow> for Operation {
    type Error = DomainError;

    fn try_from(f: FlashRow) -> Result<Self, DomainError> {
        Ok(Self {
            id: f.op_id,
            kind: OperationKind::FirmwareFlash,
            node_id: f.node_id,
            version: f.version,
            state: f.state,
            error: f.error,
            created_at: time(f.created_at),
            finished_at: f.finished_at.map(time),
        })
    }
}

/// The fleet's counts: the domain tables' and the VMs running at the hypervisor.
pub fn fleet_from_counts(counts: Counts, vms_running: usize) -> Fleet {
    Fleet {
        nodes_total: count(counts.nodes_total),
        nodes_allocated: count(counts.nodes_allocated),
        leases_active: count(counts.leases_active),
        workers_active: count(counts.workers_active),
        vms_running: u64::try_from(vms_running).unwrap_or(u64::MAX),
        vm_boots_total: count(counts.boots_done),
        reboots_total: count(counts.reboots_done),
        firmware_flashes_total: count(counts.flashes_done),
        nodes_bricked: count(counts.nodes_bricked),
    }
}

/// `GET /v1/workers` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Page size, 1-500 (default 100).
    #[param(minimum = 1, maximum = 500, default = 100)]
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// The largest page.
pub const MAX_PAGE: u32 = 500;

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> WorkerRow {
        WorkerRow {
            worker_id: "wkr-3f9c2a7d1e5b8c04".parse().unwrap(),
            principal: idempotency::Principal::new("team-a"),
            image: "worker-base:2025.11".into(),
            cpu: 16,
            memory_gb: 64,
            labels: r#"{"team":"ml-eval"}"#.into(),
            node_id: "node-0417".parse().unwrap(),
            lease_id: "lease-9a1b2c3d4e5f6071".into(),
            vm_id: "vm-5c0ffee".into(),
            state: "running".into(),
            reboot_count: 2,
            created_at: 1_796_076_847_123_456,
        }
    }

    /// The body the service wrote before the shapes moved to `leasebroker-api`, byte for byte.
    #[test]
    fn a_worker_row_is_shown_as_before() {
        let worker = Worker::try_from(row()).unwrap();
        assert_eq!(
            serde_json::to_string(&worker).unwrap(),
            r#"{"id":"wkr-3f9c2a7d1e5b8c04","state":"running","image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{"team":"ml-eval"},"node_id":"node-0417","lease_id":"lease-9a1b2c3d4e5f6071","vm_id":"vm-5c0ffee","reboot_count":2,"created_at":"2026-11-30T22:14:07.123456Z"}"#
        );
    }

    #[test]
    fn a_row_the_service_never_writes_is_an_error_and_counts_never_wrap() {
        assert!(matches!(Worker::try_from(WorkerRow { state: "gone".into(), ..row() }), Err(DomainError::BadRow(_))));
        let odd = Worker::try_from(WorkerRow { cpu: -1, memory_gb: i64::MAX, reboot_count: -5, ..row() }).unwrap();
        assert_eq!((odd.cpu, odd.memory_gb, odd.reboot_count), (0, u32::MAX, 0));
    }
}
