//! `idemcheck client`: a fixture client (`client_fixture.py`, Python's standard library) passes
//! every scenario when right, and each of its deliberate mistakes fails exactly the scenarios that
//! mistake breaks, so no scenario passes vacuously. The Rust SDK (its example adapter) and lbctl
//! (conformance/clients/lbctl/adapter) pass every scenario.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::kit;

/// Every scenario, in the order a run plays them.
const SCENARIOS: [&str; 11] = [
    "lost-answer",
    "retry-after-503",
    "retry-after-429",
    "in-progress-409",
    "mismatch-409",
    "mismatch-422",
    "mismatch-400",
    "refused-422",
    "gives-up",
    "new-operation-new-key",
    "kill-and-rerun",
];

/// The fixture's broken modes and the scenarios each must fail.
const BROKEN: [(&str, &[&str]); 6] = [
    (
        "fresh-key",
        &["lost-answer", "retry-after-503", "retry-after-429", "in-progress-409", "gives-up", "kill-and-rerun"],
    ),
    ("ignore-retry-after", &["retry-after-503", "retry-after-429"]),
    ("retry-refusals", &["mismatch-409", "mismatch-422", "mismatch-400", "refused-422"]),
    ("no-journal", &["kill-and-rerun"]),
    ("no-budget", &["gives-up"]),
    ("one-key", &["new-operation-new-key"]),
];

/// The budget the tests give (IDEMCHECK_MAX_ELAPSED): short, so the give-up and the retried
/// refusals end soon.
const BUDGET: &str = "3";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What one `idemcheck client` run printed and reported.
#[derive(Debug)]
struct Checked {
    code: Option<i32>,
    stdout: String,
    report: Value,
}

impl Checked {
    fn scenarios(&self) -> Vec<String> {
        let scenarios = self.report["scenarios"].as_array().expect("scenarios");
        scenarios.iter().map(|s| s["scenario"].as_str().expect("name").to_owned()).collect()
    }

    fn failed(&self) -> BTreeSet<String> {
        let scenarios = self.report["scenarios"].as_array().expect("scenarios");
        scenarios
            .iter()
            .filter(|s| s["result"] == "fail")
            .map(|s| s["scenario"].as_str().expect("name").to_owned())
            .collect()
    }
}

/// `idemcheck client --budget 3 OPTIONS --report <tmp>.json -- COMMAND...`, with `env` added.
fn check(options: &[&str], env: &[(&str, &Path)], command: &[&str]) -> Checked {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = dir.path().join("report.json");
    let out = Command::new(kit::BIN)
        .args(["client", "--budget", BUDGET])
        .args(options)
        .arg("--report")
        .arg(&report)
        .arg("--")
        .args(command)
        .envs(env.iter().copied())
        .current_dir(repo())
        .output()
        .expect("run idemcheck client");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        panic!("no report ({e}); stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr))
    });
    Checked { code: out.status.code(), stdout, report: serde_json::from_str(&text).expect("report JSON") }
}

/// Whether `what` can be run; if not the test is skipped, loudly, and fails under CI=true.
fn available(what: &Path, how: &str) -> bool {
    if what.exists() || Command::new(what).arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    eprintln!("SKIPPED: {} is missing ({how})", what.display());
    assert!(std::env::var("CI").is_err(), "CI=true: {} must be there ({how})", what.display());
    false
}

fn fixture(mode: &str) -> Option<Checked> {
    if !available(Path::new("python3"), "install Python 3") {
        return None;
    }
    let script = format!("{}/tests/it/client_fixture.py", env!("CARGO_MANIFEST_DIR"));
    Some(check(&[], &[], &["python3", &script, mode]))
}

/// Runs the fixture in a broken mode: exactly `expected` fail, and the run says so and exits 1.
fn fails_exactly(mode: &str) {
    let (_, expected) = BROKEN.iter().find(|(m, _)| *m == mode).expect("a broken mode");
    let Some(run) = fixture(mode) else { return };
    let expected: BTreeSet<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(run.failed(), expected, "{mode}:\n{}", run.stdout);
    assert_eq!(run.code, Some(1), "{}", run.stdout);
    let summary = format!("{} passed, {} failed", SCENARIOS.len() - expected.len(), expected.len());
    assert_eq!(run.stdout.lines().last(), Some(summary.as_str()), "{}", run.stdout);
    for name in &expected {
        assert!(run.stdout.lines().any(|l| l.starts_with("FAIL") && l.contains(name.as_str())), "{}", run.stdout);
    }
}

#[test]
fn a_right_client_passes_every_scenario() {
    let Some(run) = fixture("good") else { return };
    assert_eq!(run.failed(), BTreeSet::new(), "{}", run.stdout);
    assert_eq!(run.code, Some(0), "{}", run.stdout);
    assert_eq!(run.scenarios(), SCENARIOS);
    assert_eq!(run.stdout.lines().filter(|l| l.starts_with("PASS ")).count(), SCENARIOS.len(), "{}", run.stdout);
    assert_eq!(run.stdout.lines().last(), Some("11 passed, 0 failed"), "{}", run.stdout);
    // The evidence: the kill-and-rerun's rerun sent the key its killed run had sent, and the work ran once.
    let kill = &run.report["scenarios"][10];
    let arrivals = kill["arrivals"].as_array().expect("arrivals");
    assert!(arrivals.iter().any(|a| a["run"] == 1), "{kill}");
    assert!(arrivals.iter().all(|a| a["key"] == arrivals[0]["key"] && a["key"].is_string()), "{kill}");
    assert_eq!(kill["executions"], 1, "{kill}");
    assert_eq!(kill["runs"][0]["exit"], "killed", "{kill}");
}

#[test]
fn every_scenario_fails_under_some_broken_client() {
    let broken: BTreeSet<&str> = BROKEN.iter().flat_map(|(_, failing)| failing.iter().copied()).collect();
    let all: BTreeSet<&str> = SCENARIOS.into_iter().collect();
    assert_eq!(broken, all);
}

#[test]
fn a_fresh_key_per_attempt_fails_every_retry() {
    fails_exactly("fresh-key");
}

#[test]
fn ignoring_retry_after_fails_the_503_and_the_429() {
    fails_exactly("ignore-retry-after");
}

#[test]
fn retrying_refusals_fails_the_mismatches_and_the_422() {
    fails_exactly("retry-refusals");
}

#[test]
fn no_journal_fails_the_kill_and_rerun() {
    fails_exactly("no-journal");
}

#[test]
fn no_budget_fails_the_give_up() {
    fails_exactly("no-budget");
}

#[test]
fn one_key_for_every_operation_fails_the_new_operation() {
    fails_exactly("one-key");
}

#[test]
fn the_rust_sdk_passes_every_scenario() {
    let adapter = testkit::example("idemcheck_adapter");
    let run = check(&[], &[], &[adapter.to_str().expect("utf-8 path")]);
    assert_eq!((run.failed(), run.code), (BTreeSet::new(), Some(0)), "{}", run.stdout);
}

#[test]
fn lbctl_passes_every_scenario() {
    let lbctl = testkit::LBCTL.path();
    let worker = std::fs::read_to_string(repo().join("conformance/clients/lbctl/worker.json")).expect("worker.json");
    let options = ["--path", "/v1/workers", "--answer", worker.trim()];
    let run = check(&options, &[("LBCTL_BIN", lbctl)], &["conformance/clients/lbctl/adapter"]);
    assert_eq!((run.failed(), run.code), (BTreeSet::new(), Some(0)), "{}", run.stdout);
}

#[test]
fn the_report_has_every_attempt_in_both_forms() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (md, json) = (dir.path().join("r.md"), dir.path().join("r.json"));
    let script = format!("{}/tests/it/client_fixture.py", env!("CARGO_MANIFEST_DIR"));
    if !available(Path::new("python3"), "install Python 3") {
        return;
    }
    let out = Command::new(kit::BIN)
        .args(["client", "--scenario", "lost-answer", "--scenario", "mismatch-409", "--report"])
        .arg(&md)
        .arg("--report")
        .arg(&json)
        .args(["--", "python3", &script, "retry-refusals"])
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("1 passed, 1 failed"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("JSON");
    let lost = &report["scenarios"][0];
    assert_eq!((lost["scenario"].as_str(), lost["result"].as_str()), (Some("lost-answer"), Some("pass")));
    let arrivals = lost["arrivals"].as_array().expect("arrivals");
    assert_eq!(arrivals.len(), 2, "{lost}");
    assert!(arrivals[0]["answer"].as_str().expect("answer").contains("answer lost"), "{lost}");
    assert_eq!(arrivals[1]["answer"], "201 (replayed)", "{lost}");
    let md = std::fs::read_to_string(&md).expect("md");
    assert!(md.contains("| `mismatch-409` | fail |"), "{md}");
    let key = arrivals[0]["key"].as_str().expect("key");
    assert!(md.contains(key), "the markdown names each attempt's key:\n{md}");
}

#[test]
fn the_kits_own_errors_are_one_line_and_exit_2() {
    for args in [
        vec!["client", "--", "/nonexistent/idemcheck-client-command"],
        vec!["client", "--answer", "{not json", "--", "true"],
        vec!["client", "--path", "v1/things", "--", "true"],
        vec!["client", "--report", "out.txt", "--", "true"],
    ] {
        let out = Command::new(kit::BIN).args(&args).output().expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("idemcheck: "), "{stderr}");
    }
}
