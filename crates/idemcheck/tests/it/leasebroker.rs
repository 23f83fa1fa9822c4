//! Every vector passes against the real leasebroker binary (SQLite, the in-process simulator).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::kit;

const TOKENS: [&str; 3] = ["tok-alice-idemcheck-0001", "tok-bob-idemcheck-00002", "tok-admin-idemcheck-0003"];

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The leasebroker binary the workspace build put beside idemcheck's.
fn leasebroker_bin() -> Option<std::path::PathBuf> {
    let bin = std::path::Path::new(kit::BIN).with_file_name("leasebroker");
    bin.exists().then_some(bin)
}

/// Starts the leasebroker binary on a free port with the three tokens and `flags`; `None` (after
/// a loud SKIPPED line, a failure under `CI=true`) when it was not built.
fn start(flags: &[&str]) -> Option<(Server, String, tempfile::TempDir)> {
    let Some(bin) = leasebroker_bin() else {
        eprintln!("SKIPPED: no leasebroker binary beside idemcheck; build the workspace (cargo build --workspace)");
        assert!(std::env::var("CI").is_err(), "CI=true: the leasebroker binary must be built");
        return None;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}", dir.path().join("lb.db").display());
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &db])
        .args(flags)
        .args(["--token", &format!("{}=alice", TOKENS[0]), "--token", &format!("{}=bob", TOKENS[1])])
        .args(["--admin-token", TOKENS[2]])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start leasebroker");
    let stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = line.find("listening on http://") {
                let _ = tx.send(line[i + "listening on ".len()..].trim().to_owned());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("leasebroker did not report its address");
    Some((server, url, dir))
}

/// The flags the profile's README names for a full run.
const FULL_RUN: &[&str] = &[
    "--pool-nodes",
    "256",
    "--rate-limit",
    "0",
    // A create takes a while, so duplicates arrive while it runs (in flight, Prefer: wait).
    "--sim-latency-ms",
    "300",
    // The profile's 5xx: a create of an image the hypervisor does not have.
    "--sim-missing-image",
    "idemcheck-missing:1",
    // The other key sources the profile promises.
    "--key-sources",
    "repeatability,request-id",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_vector_passes_against_leasebroker() {
    let Some((server, url, _dir)) = start(FULL_RUN) else { return };
    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    println!("{}", run.stdout);
    assert!(run.failed().is_empty(), "failed: {:?}\n{}", run.failed(), run.stdout);
    let na: Vec<_> = run.results().into_iter().filter(|(_, r)| r != "pass").collect();
    assert!(na.is_empty(), "not passed: {na:?}");
    assert_eq!(run.results().len(), kit::vector_ids().len());
    assert_eq!(run.code, Some(0));
    assert_eq!(run.report["profile"], "leasebroker");
    drop(server);
}

/// Issue 45: against a leasebroker started with no flag but its tokens, nothing fails. The
/// vectors of what that target has not turned on are `n/a`, each with a reason read from the
/// target's answers, and naming the flag that turns it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_default_leasebroker_fails_nothing_and_the_rest_is_na_with_the_flag() {
    let Some((server, url, _dir)) = start(&[]) else { return };
    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    println!("{}", run.stdout);
    assert!(run.failed().is_empty(), "failed: {:?}\n{}", run.failed(), run.stdout);
    assert_eq!(run.code, Some(0), "{}", run.stdout);
    let reasons = run.reasons();
    // The features a default leasebroker leaves off, and the flag each vector's reason names.
    for (prefix, flag) in
        [("body-key-", "--key-sources"), ("repeatability-", "--key-sources"), ("not-stored-5xx", "--sim-missing-image")]
    {
        let vectors: Vec<_> = reasons.iter().filter(|(id, _)| id.starts_with(prefix)).collect();
        assert!(!vectors.is_empty(), "no vector {prefix}*");
        for (id, (result, reason)) in vectors {
            assert_eq!(result, "n/a", "{id}: {reason}");
            assert!(reason.contains(flag), "{id}: the reason names {flag}: {reason}");
        }
    }
    let passed = reasons.values().filter(|(r, _)| r == "pass").count();
    assert!(passed >= 25, "only {passed} passed:\n{}", run.stdout);
    drop(server);
}
