//! Runs the real `faultline` binary against real `leasebroker` and `lbctl` processes: a short run
//! with every fault kind must hold every invariant with protected clients, must really have
//! injected each kind of fault, and must show damage with naive clients.
//!
//! The PostgreSQL variant runs when `TEST_POSTGRES_URL` is set (a server URL on loopback); without
//! it the test says so on stderr and passes, except under `CI=true`, where it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// One run at a time: each already keeps both cores busy.
static SERIAL: Mutex<()> = Mutex::new(());

/// `target/<profile>/`, where cargo put the faultline binary and the servers live next to it.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_faultline")).parent().expect("the binary has a directory").to_path_buf()
}

/// The leasebroker and lbctl binaries, built first if they are missing.
fn servers() -> (PathBuf, PathBuf) {
    let dir = target_dir();
    let (leasebroker, lbctl) = (dir.join("leasebroker"), dir.join("lbctl"));
    if !leasebroker.is_file() || !lbctl.is_file() {
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "-p", "leasebroker", "-p", "lbctl"]);
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build");
        assert!(status.success(), "cargo build -p leasebroker -p lbctl failed");
    }
    (leasebroker, lbctl)
}

fn run_faultline(extra: &[&str]) -> (i32, Value) {
    let (leasebroker, lbctl) = servers();
    let out = tempfile::tempdir().expect("temp dir");
    let output = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .arg("run")
        .arg("--leasebroker")
        .arg(&leasebroker)
        .arg("--lbctl")
        .arg(&lbctl)
        .args(["--ops", "150", "--concurrency", "8", "--client-faults", "0.3", "--server-kills", "1"])
        .args(["--hv-fail-before", "0.1", "--hv-fail-after", "0.1", "--lbctl-share", "0.2"])
        // A small share of the slow, refusing and abandoning modes (the full run has more).
        .args(["--hv-slow", "0.05", "--hv-refuse", "0.05", "--abandon", "0.08", "--abandon-after", "2s"])
        .args(["--flashes", "0.15"])
        .args(["--no-progress", "--max-duration", "150s", "--out"])
        .arg(out.path())
        .args(extra)
        .output()
        .expect("running faultline");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("--- faultline stdout\n{stdout}\n--- faultline stderr\n{stderr}");
    let report =
        std::fs::read(out.path().join("run.json")).unwrap_or_else(|e| panic!("no run.json ({e}); stderr:\n{stderr}"));
    (output.status.code().unwrap_or(-1), serde_json::from_slice(&report).expect("run.json is JSON"))
}

fn run<'a>(report: &'a Value, clients: &str) -> &'a Value {
    report["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .find(|r| r["clients"] == clients)
        .unwrap_or_else(|| panic!("no {clients} run in the report"))
}

fn num(v: &Value, path: &[&str]) -> i64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_i64().unwrap_or_else(|| panic!("{path:?} is not a number: {v}"))
}

fn assert_protected_and_naive(code: i32, report: &Value, replicas: i64) {
    let protected = run(report, "protected");
    let broken: Vec<&Value> =
        protected["invariants"].as_array().expect("invariants").iter().filter(|i| i["ok"] != true).collect();
    assert!(
        broken.is_empty(),
        "protected run broke invariants: {broken:#?}\nwhy operations failed: {:#}\nrefusals: {:#}",
        protected["failures"],
        protected["refusals"]
    );
    assert_eq!(code, 0, "faultline exits 0 when the protected run holds");
    assert_eq!(report["protected_passed"], true);
    assert_eq!(num(protected, &["setup", "replicas"]), replicas);

    // The faults were really injected, each kind.
    for kind in ["never_reached", "response_lost", "gave_up_mid_flight", "client_killed"] {
        assert!(num(protected, &["faults", kind]) > 0, "no {kind} fault was injected: {}", protected["faults"]);
    }
    assert_eq!(num(protected, &["server_kills"]), 1);
    assert!(num(protected, &["attempts"]) > 150, "faults must have caused retries");

    // Nothing duplicated or lost, every operation done.
    for field in ["phantom_workers", "lost_workers", "leaked_leases", "leaked_nodes", "extra_boots", "extra_reboots"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
    assert_eq!(num(protected, &["outcomes", "failed"]), 0);
    let abandoned = num(protected, &["outcomes", "abandoned"]);
    assert!(abandoned > 0, "no client abandoned an operation");
    assert_eq!(num(protected, &["outcomes", "succeeded"]) + num(protected, &["outcomes", "refused"]) + abandoned, 150);
    for field in ["leaked_vms", "duplicate_boot_tags", "duplicate_reboot_tags"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
    assert!(num(protected, &["fleet", "workers_active"]) > 0);
    // Firmware flashes: accepted ones ended, none twice, no node bricked.
    assert!(num(protected, &["outcomes", "flashes_ok"]) > 0, "no flash was accepted: {}", protected["outcomes"]);
    for field in ["bricked_nodes", "duplicate_flash_tags", "stuck_operations", "extra_flashes"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }

    // The naive clients ran into the same faults and paid for it.
    let naive = run(report, "naive");
    assert!(num(naive, &["faults", "response_lost"]) > 0);
    let damage = num(naive, &["damage", "phantom_workers"])
        + num(naive, &["damage", "extra_boots"])
        + num(naive, &["damage", "extra_reboots"])
        + num(naive, &["damage", "duplicate_boot_tags"])
        + num(naive, &["damage", "duplicate_reboot_tags"]);
    assert!(damage > 0, "naive clients left no phantom or duplicate: {}", naive["damage"]);
    assert_eq!(naive["passed"], false);
}

#[test]
fn sqlite_one_replica_holds_under_faults() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[]);
    assert_protected_and_naive(code, &report, 1);
    assert_eq!(run(&report, "protected")["setup"]["database"], "sqlite");
}

#[test]
fn postgres_two_replicas_hold_under_faults() {
    let Some(url) = std::env::var("TEST_POSTGRES_URL").ok().filter(|u| !u.is_empty()) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "TEST_POSTGRES_URL is not set: the PostgreSQL fault run cannot be skipped under CI"
        );
        eprintln!("SKIPPED postgres_two_replicas_hold_under_faults: set TEST_POSTGRES_URL to run it");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&["--postgres", &url, "--replicas", "2"]);
    assert_protected_and_naive(code, &report, 2);
    assert_eq!(run(&report, "protected")["setup"]["database"], "postgres");
}
