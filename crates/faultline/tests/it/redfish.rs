//! `--bmc redfish`: the simulator serves its BMCs as Redfish (`hypervisor-sim --bmc redfish`) and
//! the servers flash through `--bmc-url redfish+http://...` (`UpdateService.SimpleUpdate`, task
//! monitors); the flash invariants are read from the simulator's stats and its Redfish tasks.

use crate::support::{SERIAL, broken, num, run, run_faultline};

#[test]
fn flashes_through_redfish_hold_every_invariant() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "120",
        "--concurrency",
        "8",
        "--client-faults",
        "0.2",
        "--server-kills",
        "1",
        "--hv-fail-before",
        "0.05",
        "--hv-fail-after",
        "0.05",
        "--flashes",
        "0.3",
        "--bmc",
        "redfish",
        "--max-duration",
        "200s",
    ]);
    let protected = run(&report, "protected");
    let broken = broken(protected);
    assert!(broken.is_empty(), "protected run broke invariants: {broken:#?}\nfailures: {:#}", protected["failures"]);
    assert_eq!(code, 0);
    assert_eq!(protected["setup"]["bmc"], "redfish");
    // Flashes went through Redfish and reached the BMCs (the simulator serves no native BMC API
    // in this mode: a flash sent there would fail its operation), and every one was checked
    // against its operation.
    assert!(num(protected, &["outcomes", "flashes_ok"]) > 0, "no flash accepted: {}", protected["outcomes"]);
    assert!(
        num(protected, &["hypervisor", "flashes_total"]) > 0,
        "no flash reached a BMC: {}",
        protected["hypervisor"]
    );
    assert_eq!(num(protected, &["damage", "flashes_without_operation"]), 0);
}

#[test]
fn a_flash_started_through_redfish_that_no_operation_owns_is_reported() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // A check of the checker: one flash started on a BMC through Redfish directly (and one VM),
    // which nothing owns: the run must find the flash in the Redfish tasks and fail.
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "30",
        "--concurrency",
        "4",
        "--flashes",
        "0.3",
        "--bmc",
        "redfish",
        "--plant-orphans",
        "1",
        "--max-duration",
        "120s",
    ]);
    let protected = run(&report, "protected");
    assert_eq!(protected["flashes_without_operation"], serde_json::json!(["node-0017: faultline-planted-1"]));
    assert_eq!(num(protected, &["damage", "flashes_without_operation"]), 1);
    assert_eq!(num(protected, &["damage", "bricked_nodes"]), 0);
    assert_eq!(num(protected, &["outcomes", "failed"]), 0);
    assert_eq!(code, 1, "what nobody owns fails the run");
}
