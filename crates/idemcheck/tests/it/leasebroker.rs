//! Every vector passes against the real leasebroker binary (SQLite, the in-process simulator).

use crate::kit;

/// The two tenants' and the operator's tokens the server is started with.
const TOKENS: [&str; 3] = testkit::tokens::ALL;

/// Starts the leasebroker binary (from the workspace's test kit) on a free port with the three
/// tokens and `flags`, on a database in a directory of its own.
fn start(flags: &[&str]) -> (testkit::Proc, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = testkit::Launch::serve(&testkit::sqlite_url(&dir), flags).start();
    let url = server.url.clone();
    (server, url, dir)
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
    let (server, url, _dir) = start(FULL_RUN);
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
    let (server, url, _dir) = start(&[]);
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
