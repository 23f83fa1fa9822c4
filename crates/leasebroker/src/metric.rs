//! Every metric leasebroker records, named and described in one place. [`describe`] registers
//! the help texts, with the idempotency layer's ([`idempotency_tower::describe_metrics`]); the
//! alerts and dashboards under `deploy/` read these names.

/// Counter: responses by status code, labelled `code` (`429` alerts read it).
pub const HTTP_RESPONSES_TOTAL: &str = "leasebroker_http_responses_total";

/// Counter: VMs deleted because a second VM carried a tag whose boot had already been adopted
/// (a call that landed after the settle window; the window is set too short).
pub const DUPLICATE_VMS_DESTROYED_TOTAL: &str = "leasebroker_duplicate_vms_destroyed_total";
/// Counter: creates whose node and lease were given back because the hypervisor definitely
/// refused the boot.
pub const REFUSALS_RELEASED_TOTAL: &str = "leasebroker_refusals_released_total";

/// Counter: what the reaper rolled back, labelled `resource` (`operation`, `vm`, `lease`, `node`).
pub const ROLLED_BACK_TOTAL: &str = "leasebroker_reaper_rolled_back_total";
/// Counter: abandoned deletes the reaper finished (VM, worker, lease, node; 204 stored).
pub const DELETES_FINISHED_TOTAL: &str = "leasebroker_reaper_deletes_finished_total";
/// Counter: finished operations whose intents and row the reaper deleted.
pub const FORGOTTEN_TOTAL: &str = "leasebroker_reaper_forgotten_total";
/// Counter: VMs carrying one of the service's tags that no live operation or worker owned,
/// deleted by the inventory sweep (a boot that landed after its operation was rolled back).
pub const ORPHANS_REMOVED_TOTAL: &str = "leasebroker_orphans_removed_total";
/// Gauge: VMs the last inventory sweep listed whose tag this service never issued (another
/// service's, on a hypervisor both use), left alone.
pub const INVENTORY_FOREIGN: &str = "leasebroker_inventory_foreign_resources";
/// Gauge: operations due for the reaper and not looked at yet, after its last tick (counted up
/// to the reaper's cap): above zero for long, the reaper falls behind.
pub const REAPER_BACKLOG: &str = "leasebroker_reaper_backlog_operations";
/// Gauge: records in flight whose attempt has not been renewed for
/// [`crate::reaper::STUCK_AFTER`] (counted up to one page of the records listing), read at each
/// reaper tick.
pub const RECORDS_STUCK_IN_FLIGHT: &str = "leasebroker_records_stuck_in_flight";

/// Counter: long-running operations that ended, labelled `kind` (`firmware-flash`) and
/// `outcome` (`succeeded`, `failed`, `uncertain`: sent, and what came of it cannot be read; an
/// operator resolves it).
pub const OPERATIONS_TOTAL: &str = "leasebroker_operations_total";
/// Counter: operations a watcher started following (a lease taken that another watcher did not
/// hold). With several replicas, their sum is the number of operations followed, once each.
pub const OPERATION_WATCHES_TOTAL: &str = "leasebroker_operation_watches_total";
/// Counter: flashes sent to a BMC.
pub const FLASHES_SENT_TOTAL: &str = "leasebroker_flashes_sent_total";

/// Registers the help text of every metric here and of the idempotency layer's with the
/// installed recorder.
pub fn describe() {
    idempotency_tower::describe_metrics();
    metrics::describe_counter!(HTTP_RESPONSES_TOTAL, "Responses by status code");
    metrics::describe_counter!(
        DUPLICATE_VMS_DESTROYED_TOTAL,
        "Second VMs of one boot deleted: calls that landed after --hypervisor-settle (set it longer)"
    );
    metrics::describe_counter!(REFUSALS_RELEASED_TOTAL, "Creates whose node and lease were given back on a refusal");
    metrics::describe_counter!(
        ROLLED_BACK_TOTAL,
        "What the reaper rolled back, by resource (operation, vm, lease, node)"
    );
    metrics::describe_counter!(DELETES_FINISHED_TOTAL, "Abandoned deletes the reaper finished");
    metrics::describe_counter!(FORGOTTEN_TOTAL, "Finished operations whose rows and intents the reaper deleted");
    metrics::describe_counter!(
        ORPHANS_REMOVED_TOTAL,
        "VMs with the service's tag that no live operation or worker owned, deleted by the inventory sweep"
    );
    metrics::describe_gauge!(
        INVENTORY_FOREIGN,
        "VMs the last inventory sweep listed whose tag this service never issued (another service's), left alone"
    );
    metrics::describe_gauge!(
        REAPER_BACKLOG,
        "Operations due for the reaper and not looked at yet, after its last tick"
    );
    metrics::describe_gauge!(
        RECORDS_STUCK_IN_FLIGHT,
        "Records in flight whose attempt has not been renewed for ten minutes, read at each reaper tick"
    );
    metrics::describe_counter!(OPERATIONS_TOTAL, "Long-running operations that ended, by kind and outcome");
    metrics::describe_counter!(OPERATION_WATCHES_TOTAL, "Operations this replica's watcher started following");
    metrics::describe_counter!(FLASHES_SENT_TOTAL, "Firmware flashes sent to a BMC (every attempt)");
}

/// Puts every counter an alert reads with `increase(...)` or `rate(...)` (deploy/prometheus) on
/// `/metrics` at zero, and the other counters of what went wrong and was cleaned up, with each
/// label value they take: a series that first appears at 1 has no earlier sample to increase
/// from, so the first event after a start would go unseen.
pub fn start_at_zero() {
    for name in [
        ORPHANS_REMOVED_TOTAL,
        DUPLICATE_VMS_DESTROYED_TOTAL,
        REFUSALS_RELEASED_TOTAL,
        DELETES_FINISHED_TOTAL,
        FORGOTTEN_TOTAL,
        idempotency_tower::RECORDS_SWEPT_TOTAL,
        idempotency::REPLAY_CACHE_HITS_TOTAL,
    ] {
        metrics::counter!(name).increment(0);
    }
    for resource in ["operation", "vm", "lease", "node"] {
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => resource).increment(0);
    }
    metrics::counter!(idempotency_tower::REQUESTS_TOTAL, "outcome" => "store_unavailable").increment(0);
    metrics::counter!(HTTP_RESPONSES_TOTAL, "code" => "429").increment(0);
    metrics::counter!(OPERATIONS_TOTAL, "kind" => "firmware-flash", "outcome" => "uncertain").increment(0);
}
