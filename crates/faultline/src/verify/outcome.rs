//! What the checks yield: each invariant with whether it held, and the damage counts of the run.

use serde::Serialize;

/// One checked invariant: `actual` must equal `expected`, or with `at_most` must not exceed it.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    /// What is checked.
    pub name: String,
    /// What it should be (or its upper bound).
    pub expected: u64,
    /// What it is.
    pub actual: u64,
    /// `expected` is an upper bound, not the exact value.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub at_most: bool,
    /// Whether they agree.
    pub ok: bool,
}

/// The damage counts of one run: all zero when idempotency held.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Damage {
    /// Workers the server has that no client was told about (beyond one per abandoned create).
    pub phantom_workers: u64,
    /// Workers a client holds that the server does not have (or answers differently about).
    pub lost_workers: u64,
    /// `leases_active - workers_active`.
    pub leaked_leases: i64,
    /// `nodes_allocated - workers_active`.
    pub leaked_nodes: i64,
    /// `VMs running - workers_active`.
    pub leaked_vms: i64,
    /// Boots of a tag that had been booted before.
    pub duplicate_boot_tags: u64,
    /// Boots beyond the workers clients were told they created and the creates they abandoned.
    pub extra_boots: i64,
    /// Reboots with a tag already in that VM's reboot tags.
    pub duplicate_reboot_tags: u64,
    /// Reboots beyond the reboot operations that succeeded or were abandoned.
    pub extra_reboots: i64,
    /// Workers whose `reboot_count` differs from the reboots that succeeded on them (beyond the
    /// abandoned ones), plus reboot answers that did.
    pub reboot_count_mismatches: u64,
    /// Create operations told the id of a worker another operation was told about.
    pub same_id_twice: u64,
    /// Workers whose delete did not succeed (existence unknown to the client; not counted above).
    pub delete_unknown: u64,
    /// Abandoned creates the server finished anyway (their worker is listed; not a phantom).
    pub abandoned_creates_finished: u64,
    /// Nodes a flash bricked (the BMC's count).
    pub bricked_nodes: u64,
    /// Tags the BMCs flashed more than once.
    pub duplicate_flash_tags: u64,
    /// Accepted flash operations that never ended.
    pub stuck_operations: u64,
    /// BMC flashes beyond one per accepted operation (and one per abandoned one).
    pub extra_flashes: i64,
    /// VMs the simulator runs that no worker runs on, once the inventory sweep had its time.
    pub vms_without_worker: u64,
    /// Flashes the BMCs hold that no operation owns (none, or one that did not succeed).
    pub flashes_without_operation: u64,
    /// Keys a success was answered for whose record is gone or no longer completed at the end.
    pub acknowledged_records_lost: u64,
    /// Accepted flash operations (`202`) that cannot be found at the end.
    pub acknowledged_flash_ops_lost: u64,
    /// Operations that gave up or failed and did not complete when sent again with their key.
    pub failed_ops_not_completed: u64,
    /// Reruns whose answer was not the response the service had stored for their key.
    pub reruns_not_stored_answer: u64,
}
