//! `faultline run --gateway`: the client faults through the real `idempotency-gateway` in front of
//! the Python upstream that counts its own executions, and the same clients straight to that
//! upstream beside it. The checker is proven able to fail by the run without the gateway: the
//! same checks there count the operations the upstream ran twice.

use std::process::Command;

use serde_json::Value;

use crate::support::{SERIAL, broken, num, run};

/// Runs `faultline run --gateway` with the workspace's gateway, `--no-progress`, a temporary
/// `--out` and `args`; its exit code, its JSON report and its stderr.
fn run_gateway(args: &[&str]) -> (i32, Value, String) {
    let out = tempfile::tempdir().expect("temp dir");
    let output = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args(["run", "--gateway", "--gateway-binary"])
        .arg(testkit::GATEWAY.path())
        .args(["--no-progress", "--out"])
        .arg(out.path())
        .args(args)
        .output()
        .expect("running faultline");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    eprintln!("--- faultline stdout\n{stdout}\n--- faultline stderr\n{stderr}");
    let report = std::fs::read(out.path().join("gateway.json"))
        .map(|bytes| serde_json::from_slice(&bytes).expect("gateway.json is JSON"))
        .unwrap_or(Value::Null);
    (output.status.code().unwrap_or(-1), report, stderr)
}

/// Every fault the gateway run has, on a small workload.
const FAULTS: [&str; 14] = [
    "--ops",
    "80",
    "--concurrency",
    "8",
    "--client-faults",
    "0.3",
    "--upstream-slow",
    "0.1",
    "--upstream-resets",
    "0.1",
    "--upstream-5xx",
    "0.05",
    "--max-duration",
    "240s",
];

fn assert_held_through_the_gateway(protected: &Value, ops: i64) {
    assert!(broken(protected).is_empty(), "{:#}", protected["invariants"]);
    assert_eq!(num(protected, &["upstream", "run_more_than_once"]), 0);
    assert_eq!(num(protected, &["outcomes", "succeeded"]) + num(protected, &["outcomes", "held"]), ops);
    // The faults really happened: first attempts the gateway lost the upstream's answer to.
    assert!(num(protected, &["outcomes", "uncertain_504"]) > 0, "{:#}", protected["outcomes"]);
    assert!(num(protected, &["client_faults", "response_lost"]) > 0, "{:#}", protected["client_faults"]);
}

#[test]
fn through_the_gateway_nothing_runs_twice_and_without_it_the_upstream_counts_duplicates() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut args = FAULTS.to_vec();
    args.extend(["--server-kills", "1"]);
    let (code, report, _) = run_gateway(&args);
    assert_eq!(code, 0, "the run through the gateway holds");
    let protected = run(&report, "protected");
    assert_held_through_the_gateway(protected, 80);
    assert_eq!(protected["setup"]["record_store"], "sqlite");
    assert_eq!(num(protected, &["gateway_kills"]), 1);
    // With the probe route every uncertain outcome is looked up: nothing is held.
    assert_eq!(num(protected, &["outcomes", "held"]), 0);
    let naive = run(&report, "naive");
    assert_eq!(naive["setup"]["through"], "upstream");
    assert!(num(naive, &["upstream", "run_more_than_once"]) > 0, "{:#}", naive["upstream"]);
    let names: Vec<&str> = broken(naive).iter().filter_map(|i| i["name"].as_str()).collect();
    assert!(names.contains(&"operations the upstream ran more than once"), "{names:?}");
}

#[test]
fn without_a_probe_an_uncertain_outcome_is_held_and_never_sent_again() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report, _) = run_gateway(&[
        "--no-naive",
        "--no-probe",
        "--ops",
        "30",
        "--concurrency",
        "6",
        "--client-faults",
        "0",
        "--upstream-slow",
        "0.3",
        "--max-duration",
        "120s",
    ]);
    assert_eq!(code, 0);
    let protected = run(&report, "protected");
    assert!(broken(protected).is_empty(), "{:#}", protected["invariants"]);
    assert_eq!(protected["setup"]["probe"], false);
    let held = num(protected, &["outcomes", "held"]);
    assert_eq!(held, num(protected, &["upstream_faults", "slow"]), "every slow first attempt is held");
    assert!(held > 0);
    // Held, not lost: the upstream ran each of them once.
    assert_eq!(num(protected, &["upstream", "executions"]), 30);
}

#[test]
fn two_gateway_replicas_on_postgresql_run_nothing_twice() {
    let Some(url) = std::env::var("TEST_POSTGRES_URL").ok().filter(|u| !u.is_empty()) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "TEST_POSTGRES_URL is not set: the PostgreSQL gateway run cannot be skipped under CI"
        );
        eprintln!("SKIPPED two_gateway_replicas_on_postgresql_run_nothing_twice: set TEST_POSTGRES_URL to run it");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut args = FAULTS.to_vec();
    args.extend(["--no-naive", "--postgres", &url, "--replicas", "2", "--server-kills", "2"]);
    let (code, report, _) = run_gateway(&args);
    assert_eq!(code, 0);
    let protected = run(&report, "protected");
    assert_held_through_the_gateway(protected, 80);
    assert_eq!(
        (protected["setup"]["record_store"].as_str(), num(protected, &["setup", "replicas"])),
        (Some("postgres"), 2)
    );
    assert_eq!(num(protected, &["gateway_kills"]), 2);
}

#[test]
fn a_leasebroker_mode_is_refused_with_the_gateway() {
    let (code, report, stderr) = run_gateway(&["--hv-fail-before", "0.1"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--hv-fail-before") && stderr.contains("cannot be used with"), "{stderr}");
    assert!(report.is_null(), "nothing ran");
}
