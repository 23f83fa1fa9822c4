//! Running the real `idemcheck` binary and reading its JSON report.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_idemcheck");

pub(crate) fn vectors_dir() -> String {
    format!("{}/../../conformance/vectors", env!("CARGO_MANIFEST_DIR"))
}

/// What one run printed and reported.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) report: Value,
}

impl Run {
    /// Each vector's result (`pass`, `fail`, `n/a`), by id.
    pub(crate) fn results(&self) -> BTreeMap<String, String> {
        self.report["vectors"]
            .as_array()
            .expect("vectors")
            .iter()
            .map(|v| (v["id"].as_str().expect("id").to_owned(), v["result"].as_str().expect("result").to_owned()))
            .collect()
    }

    /// Each vector's result and reason (empty for a pass), by id.
    pub(crate) fn reasons(&self) -> BTreeMap<String, (String, String)> {
        self.report["vectors"]
            .as_array()
            .expect("vectors")
            .iter()
            .map(|v| {
                let (id, result) = (v["id"].as_str().expect("id"), v["result"].as_str().expect("result"));
                (id.to_owned(), (result.to_owned(), v["reason"].as_str().unwrap_or_default().to_owned()))
            })
            .collect()
    }

    pub(crate) fn failed(&self) -> Vec<String> {
        self.results().into_iter().filter(|(_, r)| r == "fail").map(|(id, _)| id).collect()
    }
}

/// `idemcheck run --url URL --profile P --token T... --report <tmp>.json`, in a blocking thread.
pub(crate) async fn run(url: &str, profile: &str, tokens: &[&str]) -> Run {
    run_with(url, profile, tokens, &[]).await
}

/// The same with `extra` arguments after the tokens (`--route`, `--body`, `--counter`...).
pub(crate) async fn run_with(url: &str, profile: &str, tokens: &[&str], extra: &[&str]) -> Run {
    let (url, profile) = (url.to_owned(), profile.to_owned());
    let tokens: Vec<String> = tokens.iter().map(|t| (*t).to_owned()).collect();
    let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("tempdir");
        let report = dir.path().join("report.json");
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--url", &url, "--profile", &profile, "--vectors", &vectors_dir()]);
        for t in &tokens {
            cmd.args(["--token", t]);
        }
        cmd.args(&extra);
        cmd.arg("--report").arg(&report);
        let out = cmd.output().expect("run idemcheck");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!("no report ({e}); stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr))
        });
        Run { code: out.status.code(), stdout, report: serde_json::from_str(&text).expect("report JSON") }
    })
    .await
    .expect("idemcheck thread")
}

/// Every vector id in the directory.
pub(crate) fn vector_ids() -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(vectors_dir())
        .expect("vectors dir")
        .filter_map(|e| e.ok())
        .filter_map(|e| e.path().file_stem().and_then(|s| s.to_str()).map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

#[test]
fn list_names_every_vector_with_its_source() {
    let out = Command::new(BIN).args(["list", "--vectors", &vectors_dir()]).output().expect("list");
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ids = vector_ids();
    assert!(ids.len() >= 30, "only {} vectors", ids.len());
    for id in &ids {
        assert!(stdout.contains(id.as_str()), "{id} not listed");
    }
    assert!(stdout.contains(&format!("{} vectors", ids.len())));
    assert_eq!(stdout.matches("source: ").count(), ids.len());
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    for args in [
        vec!["run", "--url", "ftp://x"],
        vec!["run", "--url", "http://127.0.0.1:1", "--route", "GET /x"],
        vec!["run", "--url", "http://127.0.0.1:1", "--route", "POST /x", "--body", "{not json"],
        vec!["run", "--url", "http://127.0.0.1:1", "--vectors", "/nonexistent-idemcheck-dir"],
        vec!["run", "--url", "http://127.0.0.1:1", "--counter", "counter"],
        vec!["run", "--url", "http://127.0.0.1:1", "--counter", "/counter#count"],
        vec!["run", "--url", "http://127.0.0.1:1", "--report", "out.txt"],
    ] {
        let out = Command::new(BIN).args(&args).output().expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("idemcheck: "), "{stderr}");
    }
}
