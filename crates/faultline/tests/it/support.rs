//! What the faultline tests share: the binaries, one run at a time, and reading the report.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// One run at a time: each already keeps both cores busy.
pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

/// The leasebroker and lbctl binaries the runs start, from the workspace's test kit (built by
/// `cargo nextest run --workspace`; a missing one fails the test with one line saying so).
pub(crate) fn servers() -> (PathBuf, PathBuf) {
    (testkit::LEASEBROKER.path().to_path_buf(), testkit::LBCTL.path().to_path_buf())
}

/// Runs `faultline run` with the servers next to it, `--no-progress`, a temporary `--out` and
/// `args`; its exit code and its JSON report.
pub(crate) fn run_faultline(args: &[&str]) -> (i32, Value) {
    let (leasebroker, lbctl) = servers();
    let out = tempfile::tempdir().expect("temp dir");
    let output = Command::new(env!("CARGO_BIN_EXE_faultline"))
        .arg("run")
        .arg("--leasebroker")
        .arg(&leasebroker)
        .arg("--lbctl")
        .arg(&lbctl)
        .args(["--no-progress", "--out"])
        .arg(out.path())
        .args(args)
        .output()
        .expect("running faultline");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("--- faultline stdout\n{stdout}\n--- faultline stderr\n{stderr}");
    let report =
        std::fs::read(out.path().join("run.json")).unwrap_or_else(|e| panic!("no run.json ({e}); stderr:\n{stderr}"));
    (output.status.code().unwrap_or(-1), serde_json::from_slice(&report).expect("run.json is JSON"))
}

pub(crate) fn run<'a>(report: &'a Value, clients: &str) -> &'a Value {
    report["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .find(|r| r["clients"] == clients)
        .unwrap_or_else(|| panic!("no {clients} run in the report"))
}

pub(crate) fn num(v: &Value, path: &[&str]) -> i64 {
    let mut v = v;
    for p in path {
        v = &v[*p];
    }
    v.as_i64().unwrap_or_else(|| panic!("{path:?} is not a number: {v}"))
}

/// The invariant named `name` of a run.
pub(crate) fn invariant<'a>(run: &'a Value, name: &str) -> &'a Value {
    run["invariants"]
        .as_array()
        .expect("invariants")
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("no invariant {name:?} in {:#}", run["invariants"]))
}

/// The invariants of a run that broke.
pub(crate) fn broken(run: &Value) -> Vec<&Value> {
    run["invariants"].as_array().expect("invariants").iter().filter(|i| i["ok"] != true).collect()
}
