//! The two round-2 fault modes and the invariant "nothing runs that nobody owns" (docs/protocol.md#side-effects and #proving-it):
//! boots that land after the servers' settle window and a replica paused past its claims must
//! leave no VM without a worker and no flash without an operation once the service's inventory
//! sweep had its time; and what nobody owns is reported when the sweep cannot remove it.

use serde_json::Value;

use crate::support::{SERIAL, broken, invariant, num, run, run_faultline};

const VMS_UNOWNED: &str = "nothing runs that nobody owns: VMs without a worker";
const FLASHES_UNOWNED: &str = "nothing runs that nobody owns: flashes without an operation";

fn listed(run: &Value, field: &str) -> Vec<String> {
    run[field].as_array().expect(field).iter().map(|v| v.as_str().expect("a string").to_owned()).collect()
}

#[test]
fn late_landings_and_paused_replicas_leave_nothing_unowned() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "250",
        "--concurrency",
        "8",
        "--client-faults",
        "0.1",
        "--hv-fail-before",
        "0.05",
        "--hv-fail-after",
        "0.05",
        "--late-landings",
        "0.2",
        "--pauses",
        "2",
        "--abandon",
        "0.1",
        // Longer than a faulted client's gap between two attempts (a 503's Retry-After of up to
        // the settle window, then an attempt lost to a client fault), so that the reaper rolls
        // back what was abandoned, not what a retry is about to resume.
        "--abandon-after",
        "8s",
        "--flashes",
        "0.1",
        "--max-duration",
        "150s",
    ]);
    let protected = run(&report, "protected");
    let broken = broken(protected);
    assert!(
        broken.is_empty(),
        "protected run broke invariants: {broken:#?}\nwhy operations failed: {:#}\nunowned: {:#} {:#}",
        protected["failures"],
        protected["vms_without_worker"],
        protected["flashes_without_operation"]
    );
    assert_eq!(code, 0, "faultline exits 0 when the protected run holds");
    assert_eq!(protected["setup"]["database"], "sqlite");

    // Both modes really ran: boots were held past the settle window and landed, and the one
    // replica was stopped twice with requests open.
    assert!(num(protected, &["late", "booted"]) > 0, "no boot landed late: {}", protected["late"]);
    assert_eq!(num(protected, &["pauses"]), 2);
    // What landed late was the inventory sweep's to remove: a second VM of its tag beside the
    // one a retry booted after the window, or an orphan whose create was rolled back.
    let server = &protected["server"];
    assert!(
        num(server, &["duplicate_vms_destroyed"]) + num(server, &["orphans_removed"]) > 0,
        "the service removed nothing that landed late: {server}"
    );
    // The new invariant is checked, and holds.
    for name in [VMS_UNOWNED, FLASHES_UNOWNED] {
        let i = invariant(protected, name);
        assert_eq!((i["actual"].as_i64(), i["ok"].as_bool()), (Some(0), Some(true)), "{i}");
    }
    // Flashes ran, and each the BMCs hold was found to belong to its operation.
    assert!(num(protected, &["outcomes", "flashes_ok"]) > 0, "no flash was accepted");
    assert!(num(protected, &["hypervisor", "flashes_total"]) > 0);
    for field in ["phantom_workers", "lost_workers", "leaked_leases", "leaked_nodes", "leaked_vms", "extra_reboots"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
}

/// The check can fail: with the servers' inventory sweep starved (`--sweep-interval 10m`: one tick
/// at start-up, none after), the VMs that land after the settle window stay, and VMs and a flash
/// planted on the simulator with a tag nothing owns are counted, each by name.
#[test]
fn what_nobody_owns_is_reported() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "60",
        "--concurrency",
        "8",
        "--client-faults",
        "0",
        "--flashes",
        "0",
        "--late-landings",
        "0.5",
        "--sweep-interval",
        "10m",
        "--plant-orphans",
        "2",
        "--max-duration",
        "150s",
    ]);
    assert_eq!(code, 1, "a protected run that leaves something unowned fails");
    assert_eq!(report["protected_passed"], false);
    let protected = run(&report, "protected");
    assert!(num(protected, &["late", "booted"]) > 0, "no boot landed late: {}", protected["late"]);

    let vms = listed(protected, "vms_without_worker");
    let planted = vms.iter().filter(|v| v.contains("(faultline-planted-")).count();
    let late = vms.iter().filter(|v| v.contains("(sk-")).count();
    assert_eq!(planted, 2, "both planted VMs are reported: {vms:?}");
    assert!(late > 0, "VMs that landed late and were never swept are reported: {vms:?}");
    let i = invariant(protected, VMS_UNOWNED);
    assert_eq!(i["ok"], false);
    assert_eq!(i["actual"].as_u64(), Some(vms.len() as u64));
    assert_eq!(num(protected, &["damage", "vms_without_worker"]), vms.len() as i64);

    let flashes = listed(protected, "flashes_without_operation");
    assert_eq!(flashes, ["node-0017: faultline-planted-2"], "the planted flash, and nothing else");
    let i = invariant(protected, FLASHES_UNOWNED);
    assert_eq!((i["actual"].as_u64(), i["ok"].as_bool()), (Some(1), Some(false)), "{i}");
}
