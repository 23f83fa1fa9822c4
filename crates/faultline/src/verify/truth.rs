//! What the servers and the hypervisor hold once they have settled: the fleet, the simulator's
//! counters, every listed worker, the replicas' own counters and the VMs that run.

use std::collections::{HashMap, HashSet};

use leasebroker_api::SimStats;
use leasebroker_client::{Fleet, Worker, WorkerId};
use serde::Serialize;

/// What the servers say they did about refusals, late landings and abandoned operations, summed
/// over the replicas' `/metrics` (a replica killed mid-run forgot what it counted before).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ServerCounters {
    /// `leasebroker_refusals_released_total`: creates that gave back node and lease on a refusal.
    pub refusals_released: u64,
    /// `leasebroker_duplicate_vms_destroyed_total`: late landings past the settle window destroyed.
    pub duplicate_vms_destroyed: u64,
    /// `leasebroker_reaper_rolled_back_total{resource="operation"}`: abandoned operations rolled back.
    pub operations_reaped: u64,
    /// `leasebroker_orphans_removed_total`: VMs with the service's tag that nothing owned, deleted
    /// by the inventory sweep (a boot that landed after its operation was rolled back).
    pub orphans_removed: u64,
}

/// What the servers and the hypervisor hold.
#[derive(Debug, Clone)]
pub struct GroundTruth {
    /// `GET /admin/v1/fleet`.
    pub fleet: Fleet,
    /// `GET /v1/stats` of the simulator.
    pub sim: SimStats,
    /// Every worker each principal lists, by id, with its principal's index.
    pub workers: HashMap<WorkerId, (usize, Worker)>,
    /// The replicas' own counters.
    pub server: ServerCounters,
    /// The VMs the simulator runs: their ids and tags.
    pub vms: HashMap<String, String>,
}

impl GroundTruth {
    /// The VMs the simulator runs that no listed worker runs on (`vm_id (tag)`, sorted): what runs
    /// that nobody owns.
    pub fn vms_without_worker(&self) -> Vec<String> {
        let owned: HashSet<&str> = self.workers.values().filter_map(|(_, w)| w.vm_id.as_deref()).collect();
        let mut out: Vec<String> = self
            .vms
            .iter()
            .filter(|(id, _)| !owned.contains(id.as_str()))
            .map(|(id, tag)| format!("{id} ({tag})"))
            .collect();
        out.sort();
        out
    }
}
