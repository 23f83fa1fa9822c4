//! What the API shows: workers, pages, reboot results, operations, the fleet.

use serde::{Deserialize, Serialize};

use crate::domain::{FlashRow, WorkerRow};

/// Micros since the epoch as RFC 3339.
fn rfc3339(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The worker as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Worker {
    /// `wkr-...`.
    pub id: String,
    /// `booting` or `running`.
    pub state: String,
    /// The image.
    pub image: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory in GB.
    pub memory_gb: i64,
    /// Labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// The node it runs on.
    pub node_id: String,
    /// Its lease.
    pub lease_id: String,
    /// Its VM.
    pub vm_id: String,
    /// Reboots done.
    pub reboot_count: i64,
    /// RFC 3339 creation time.
    pub created_at: String,
}

impl From<WorkerRow> for Worker {
    fn from(w: WorkerRow) -> Self {
        Self {
            id: w.worker_id,
            state: w.state,
            image: w.image,
            cpu: w.cpu,
            memory_gb: w.memory_gb,
            labels: serde_json::from_str(&w.labels).unwrap_or_default(),
            node_id: w.node_id,
            lease_id: w.lease_id,
            vm_id: w.vm_id,
            reboot_count: w.reboot_count,
            created_at: rfc3339(w.created_at),
        }
    }
}

/// `GET /v1/workers` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkerPage {
    /// This page.
    pub workers: Vec<Worker>,
    /// Pass as `cursor` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

/// `POST /v1/workers/{id}/reboot` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebootResult {
    /// The worker.
    pub id: String,
    /// Reboots done, counting this one.
    pub reboot_count: i64,
}

/// `GET /admin/v1/fleet` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Fleet {
    /// Nodes in the pool.
    pub nodes_total: i64,
    /// Nodes allocated.
    pub nodes_allocated: i64,
    /// Leases held.
    pub leases_active: i64,
    /// Workers that exist.
    pub workers_active: i64,
    /// VMs running on the hypervisor.
    pub vms_running: i64,
    /// VM boots leasebroker recorded.
    pub vm_boots_total: i64,
    /// Reboots leasebroker recorded.
    pub reboots_total: i64,
    /// Firmware flashes the BMCs took from leasebroker.
    pub firmware_flashes_total: i64,
    /// Nodes whose BMC was seen bricked.
    pub nodes_bricked: i64,
}

/// A long-running operation (SPEC 3.4): `GET /admin/v1/operations/{op_id}`, and the body of the
/// `202` that started it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Operation {
    /// `op-...`.
    pub id: String,
    /// `firmware-flash`.
    pub kind: String,
    /// The node.
    pub node_id: String,
    /// The firmware version.
    pub version: String,
    /// `running`, `succeeded` or `failed`.
    pub state: String,
    /// Why it failed; null otherwise.
    pub error: Option<String>,
    /// RFC 3339 creation time.
    pub created_at: String,
    /// RFC 3339 end time; null while it runs.
    pub finished_at: Option<String>,
}

/// The kind of every firmware-flash operation.
pub const FIRMWARE_FLASH: &str = "firmware-flash";

impl From<FlashRow> for Operation {
    fn from(f: FlashRow) -> Self {
        Self {
            id: f.op_id,
            kind: FIRMWARE_FLASH.to_owned(),
            node_id: f.node_id,
            version: f.version,
            state: f.state,
            error: f.error,
            created_at: rfc3339(f.created_at),
            finished_at: f.finished_at.map(rfc3339),
        }
    }
}

/// `GET /v1/workers` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct ListQuery {
    /// Page size, 1-500 (default 100).
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// The largest page.
pub const MAX_PAGE: u32 = 500;
