//! `--bmc redfish`: the simulator serves its BMCs as Redfish (`hypervisor-sim --bmc redfish`) and
//! the servers flash through `--bmc-url redfish+http://...` (`UpdateService.SimpleUpdate`, task
//! monitors); the flash invariants are read from the simulator's stats and its Redfish tasks.

use crate::support::{SERIAL, broken, invariant, num, run, run_faultline};

#[test]
fn flashes_through_redfish_hold_the_flash_invariants_and_a_planted_flash_is_reported() {
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
        // A check of the checker: one flash started on a BMC through Redfish directly, which no
        // operation owns (and one VM): the run must find it in the Redfish tasks.
        "--plant-orphans",
        "1",
        "--max-duration",
        "200s",
    ]);
    let protected = run(&report, "protected");
    assert_eq!(protected["setup"]["bmc"], "redfish");
    // Flashes went through Redfish and reached the BMCs (the simulator serves no native BMC API
    // in this mode: a flash sent there would fail its operation).
    assert!(num(protected, &["outcomes", "flashes_ok"]) > 0, "no flash accepted: {}", protected["outcomes"]);
    assert!(
        num(protected, &["hypervisor", "flashes_total"]) > 0,
        "no flash reached a BMC: {}",
        protected["hypervisor"]
    );
    for name in [
        "nodes bricked (a second flash while one wrote)",
        "duplicate_flash_tags",
        "accepted flash operations not ended (stuck running)",
        "fleet firmware_flashes_total == BMC flashes",
        "BMC flashes: one per succeeded flash op, at most one per accepted or abandoned one",
    ] {
        assert_eq!(invariant(protected, name)["ok"], true, "{name}: {:#}", invariant(protected, name));
    }
    // What broke is what was planted, and only that: the planted flash read from the Redfish
    // tasks (node 17, which no operation flashes) and the planted VM.
    let broken: Vec<&str> = broken(protected).iter().map(|i| i["name"].as_str().expect("name")).collect();
    assert_eq!(
        broken,
        [
            "nothing runs that nobody owns: VMs without a worker",
            "nothing runs that nobody owns: flashes without an operation"
        ],
        "{:#}",
        protected["invariants"]
    );
    assert_eq!(protected["flashes_without_operation"], serde_json::json!(["node-0017: faultline-planted-1"]));
    assert_eq!(code, 1, "a planted orphan fails the run");
}
