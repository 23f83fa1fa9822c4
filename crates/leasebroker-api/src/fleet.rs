//! `GET /admin/v1/fleet`: the service's totals.

use serde::{Deserialize, Serialize};

/// `GET /admin/v1/fleet` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fleet {
    /// Nodes in the pool.
    pub nodes_total: u64,
    /// Nodes allocated.
    pub nodes_allocated: u64,
    /// Leases held.
    pub leases_active: u64,
    /// Workers that exist.
    pub workers_active: u64,
    /// VMs running on the hypervisor.
    pub vms_running: u64,
    /// VM boots leasebroker recorded.
    pub vm_boots_total: u64,
    /// Reboots leasebroker recorded.
    pub reboots_total: u64,
    /// Firmware flashes the BMCs took from leasebroker (0 from a server without firmware
    /// operations).
    #[serde(default)]
    pub firmware_flashes_total: u64,
    /// Nodes whose BMC was seen bricked (0 from a server without firmware operations).
    #[serde(default)]
    pub nodes_bricked: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_from_an_older_server_reads_zero_flashes() {
        let old = r#"{"nodes_total":4,"nodes_allocated":1,"leases_active":1,"workers_active":1,"vms_running":1,
            "vm_boots_total":1,"reboots_total":0}"#;
        let fleet: Fleet = serde_json::from_str(old).unwrap();
        assert_eq!((fleet.firmware_flashes_total, fleet.nodes_bricked), (0, 0));
    }

    #[test]
    fn a_fleet_round_trips_byte_for_byte() {
        let body = r#"{"nodes_total":4,"nodes_allocated":1,"leases_active":1,"workers_active":1,"vms_running":1,"vm_boots_total":3,"reboots_total":2,"firmware_flashes_total":1,"nodes_bricked":0}"#;
        let fleet: Fleet = serde_json::from_str(body).unwrap();
        assert_eq!(serde_json::to_string(&fleet).unwrap(), body);
    }
}
