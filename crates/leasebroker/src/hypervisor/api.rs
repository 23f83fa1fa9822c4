//! The wire types of the hypervisor API (docs/protocol.md#hypervisor-api), shared by the simulator and the client so the
//! two cannot drift apart.

use serde::{Deserialize, Serialize};

/// The body of `POST /v1/vms`: boot one VM.
///
/// The hypervisor picks the VM's id itself; `tag` is the only thing the caller can stamp on it, and
/// it is echoed back on every listing, which is what lets a caller find a VM it booted but never
/// heard about (reconciliation by tag).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootRequest {
    /// The image to boot.
    pub image: String,
    /// Virtual CPUs (at least 1).
    pub cpu: i64,
    /// Memory in GiB (at least 1).
    pub memory_gb: i64,
    /// A free-form label the hypervisor stores and echoes; may be empty.
    pub tag: String,
}

/// The lifecycle state the hypervisor reports for a VM.
///
/// The simulator only ever reports `running` (a deleted VM is gone, not `stopped`); the other
/// variants let the client read a real hypervisor that reports more without failing to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum VmState {
    /// The VM is up.
    Running,
    /// The VM exists but is not running.
    Stopped,
    /// A state this client does not know.
    #[serde(other)]
    Unknown,
}

impl VmState {
    /// The wire name: `running`, `stopped` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Compares with the wire name, so `vm.state == "running"` reads as it would on the wire.
impl PartialEq<str> for VmState {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for VmState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A VM as the hypervisor lists it: `{"vm_id", "tag", "state"}` (the answer to a boot, and each
/// entry of `GET /v1/vms`). Extra fields a hypervisor adds are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    /// The hypervisor-assigned id (`vm-<hex>` on the simulator).
    pub vm_id: String,
    /// The tag given at boot.
    pub tag: String,
    /// The current state.
    pub state: VmState,
}

/// One VM in full, the answer to `GET /v1/vms/{vm_id}`.
///
/// `image`, `cpu` and `memory_gb` are the simulator's additions to docs/protocol.md#hypervisor-api; they are optional so
/// that a hypervisor which does not report them still decodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDetail {
    /// The hypervisor-assigned id.
    pub vm_id: String,
    /// The tag given at boot.
    pub tag: String,
    /// The current state.
    pub state: VmState,
    /// Every reboot's tag, in the order the reboots arrived (duplicates included).
    #[serde(default)]
    pub reboot_tags: Vec<String>,
    /// The image booted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Virtual CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<i64>,
    /// Memory in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gb: Option<i64>,
}

impl VmDetail {
    /// The listing form of this VM.
    pub fn summary(&self) -> Vm {
        Vm { vm_id: self.vm_id.clone(), tag: self.tag.clone(), state: self.state }
    }
}

/// The body of `POST /v1/vms/{vm_id}/reboot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebootRequest {
    /// A free-form label appended to the VM's `reboot_tags`.
    pub tag: String,
}

/// The answer to `GET /v1/vms`: `{"vms": [...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmList<T> {
    /// The VMs, oldest boot first.
    pub vms: Vec<T>,
}

/// The simulator's counters, `GET /v1/stats`: defined with the other wire types the fault
/// harness reads.
pub use leasebroker_api::SimStats;

/// `POST /v1/bmc/{node_id}/flash`: flash firmware `version`; `tag` is the caller's sub-key,
/// echoed in the node's `flash_tags`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlashRequest {
    /// The firmware version to write.
    pub version: String,
    /// The caller's tag for this flash.
    pub tag: String,
}

/// A BMC's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BmcState {
    /// Idle, running `firmware`.
    Ok,
    /// A flash is writing.
    Flashing,
    /// A second flash started while one was writing: the machine needs a person at the rack.
    Bricked,
}

/// `GET /v1/bmc/{node_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcNode {
    /// The node.
    pub node_id: String,
    /// The firmware it runs (the last flash that finished).
    pub firmware: String,
    /// `ok`, `flashing` or `bricked`.
    pub state: BmcState,
    /// The tags of every flash started on it, oldest first.
    pub flash_tags: Vec<String>,
}

/// `GET /v1/bmc?tag=T`: `{"nodes": [...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmcList {
    /// The nodes whose `flash_tags` hold the tag.
    pub nodes: Vec<BmcNode>,
}
