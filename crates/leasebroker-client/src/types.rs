//! The JSON shapes of the leasebroker API (SPEC 3.2).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A worker id such as `wkr-7Q2K9`: 1 to 128 ASCII letters, digits, `-` or `_`.
///
/// The restriction keeps an id safe to put in a URL path as it is (no `/`, `.` or `%`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(String);

impl WorkerId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A string that is not a valid worker id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a worker id is 1 to 128 ASCII letters, digits, '-' or '_' (got {0:?})")]
pub struct InvalidWorkerId(String);

impl FromStr for WorkerId {
    type Err = InvalidWorkerId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok =
            !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if ok { Ok(WorkerId(s.to_owned())) } else { Err(InvalidWorkerId(s.to_owned())) }
    }
}

impl TryFrom<String> for WorkerId {
    type Error = InvalidWorkerId;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<WorkerId> for String {
    fn from(id: WorkerId) -> String {
        id.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The body of `POST /v1/workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateWorker {
    /// The image to boot.
    pub image: String,
    /// CPUs.
    pub cpu: u32,
    /// Memory in GiB.
    pub memory_gb: u32,
    /// Labels; `None` leaves the field out of the body, which the server may treat differently
    /// from an empty map.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

impl CreateWorker {
    /// A request without labels.
    pub fn new(image: impl Into<String>, cpu: u32, memory_gb: u32) -> Self {
        CreateWorker { image: image.into(), cpu, memory_gb, labels: None }
    }
}

/// A worker's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum WorkerState {
    /// Its VM is starting.
    Booting,
    /// Its VM is up.
    Running,
}

/// A worker, as the server returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Worker {
    /// Its id.
    pub id: WorkerId,
    /// Its state.
    pub state: WorkerState,
    /// The image it runs.
    pub image: String,
    /// CPUs.
    pub cpu: u32,
    /// Memory in GiB.
    pub memory_gb: u32,
    /// Its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The node it was allocated on.
    pub node_id: Option<String>,
    /// Its lease.
    pub lease_id: Option<String>,
    /// Its VM at the hypervisor.
    pub vm_id: Option<String>,
    /// How many reboots it has had.
    #[serde(default)]
    pub reboot_count: u64,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// One page of `GET /v1/workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPage {
    /// The caller's workers on this page.
    pub workers: Vec<Worker>,
    /// The cursor of the next page, `None` on the last one.
    pub next_cursor: Option<String>,
}

/// The body of `202` from `POST /v1/workers/{id}/reboot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebootResult {
    /// The worker.
    pub id: WorkerId,
    /// Its reboot count after this reboot.
    pub reboot_count: u64,
}

/// `GET /admin/v1/fleet`: the service's totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fleet {
    /// Nodes in the pool.
    pub nodes_total: u64,
    /// Nodes with a worker on them.
    pub nodes_allocated: u64,
    /// Leases not yet released.
    pub leases_active: u64,
    /// Workers not deleted.
    pub workers_active: u64,
    /// VMs running at the hypervisor.
    pub vms_running: u64,
    /// VM boots ever made.
    pub vm_boots_total: u64,
    /// Reboots ever made.
    pub reboots_total: u64,
}
