//! The hypervisor simulator's counters: the ground truth the fault harness checks. The other
//! hypervisor wire types stay with the simulator and the service's hypervisor client, the only
//! two that speak them.

use serde::{Deserialize, Serialize};

/// The simulator's counters, `GET /v1/stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SimStats {
    /// Every boot that happened, ever (deleted VMs included).
    pub boots_total: u64,
    /// VMs that exist now.
    pub running: u64,
    /// Boots whose non-empty tag had been booted before (even if that VM was deleted since).
    pub duplicate_boot_tags: u64,
    /// Every reboot that happened, ever.
    pub reboots_total: u64,
    /// Reboots whose tag was already in that VM's `reboot_tags`.
    pub duplicate_reboot_tags: u64,
    /// Every BMC firmware flash that started, ever (docs/protocol.md#firmware-operations).
    #[serde(default)]
    pub flashes_total: u64,
    /// Flashes whose tag had been flashed before, on any node.
    #[serde(default)]
    pub duplicate_flash_tags: u64,
    /// Nodes bricked by a flash that started while another one ran.
    #[serde(default)]
    pub bricked_nodes: u64,
    /// Boots, reboots and flashes that happened whose request carried its tag as its
    /// `Idempotency-Key`, in the structured field string form (`Idempotency-Key: "<tag>"`): the
    /// calls a client's key propagation keyed (docs/protocol.md#records).
    #[serde(default)]
    pub tag_keyed_calls: u64,
}
