//! Issue 45 item 2 on the real binary: a record in flight never expires under its running
//! attempt, so a key never runs twice however short the retention; a retention that is not longer
//! than the in-flight TTL is refused at start, as a usage error.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::protocol::create_in_flight;
use crate::support::{TOKEN, bin, create, fleet, serve, sim, sim_stats, sqlite_url, worker_body};

/// `leasebroker serve` with `args` (and a fresh database), expected to refuse at once: its exit
/// code and stderr. The test fails if it starts serving instead (it says where it listens).
fn refused_at_start(args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = std::process::Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &sqlite_url(&dir)])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, listening) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let started = BufReader::new(stdout).lines().map_while(Result::ok).any(|l| l.contains("listening on"));
        let _ = tx.send(started);
    });
    // The reader answers once stdout closes (the process exited) or the server says it listens.
    let started = listening.recv_timeout(Duration::from_secs(60)).unwrap_or(true);
    if started {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!started, "serve {args:?} started instead of refusing: {stderr}");
    (out.status.code(), stderr)
}

/// The configuration (`--retention 2s --in-flight-ttl 60s`, where a create slower than
/// 2 s ran twice) and an equal pair are refused in one line naming both settings, exit 2 like
/// clap's usage errors; so is any other flag that contradicts another.
#[test]
fn a_retention_not_longer_than_the_in_flight_ttl_is_refused_at_start() {
    for (retention, ttl) in [("2s", "60s"), ("60s", "1m")] {
        let (code, stderr) = refused_at_start(&["--retention", retention, "--in-flight-ttl", ttl]);
        assert_eq!(code, Some(2), "--retention {retention} --in-flight-ttl {ttl}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains("--retention") && stderr.contains("--in-flight-ttl"), "{stderr}");
    }
    let (code, stderr) = refused_at_start(&["--hypervisor-timeout", "2s", "--hypervisor-settle", "1s"]);
    assert_eq!((code, stderr.trim().lines().count()), (Some(2), 1), "{stderr}");
}

/// Every other contradiction `serve` checks at start is refused the same way: exit 2, one line
/// naming the settings.
#[test]
fn every_contradiction_serve_refuses_exits_2_with_one_line() {
    let token = "tok-both-sides-0123456789";
    let tenant = format!("{token}=alice");
    for (args, names) in [
        (vec!["--token", tenant.as_str(), "--admin-token", token], "--token"),
        (vec!["--record-store-replicas", "1"], "--record-store-replicas"),
    ] {
        let (code, stderr) = refused_at_start(&args);
        assert_eq!((code, stderr.trim().lines().count()), (Some(2), 1), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
    }
}

/// The legal configuration closest to the issue's: a retention just longer than the TTL, and a
/// create (8 s on the simulator) slower than both. A retry after the retention finds the create
/// in flight (`409`), never a free key; afterwards it replays. One worker, one boot.
#[tokio::test]
async fn a_create_slower_than_the_retention_runs_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&["--latency-ms", "8000"]);
    let retention = Duration::from_secs(3);
    let lb = serve(
        &sqlite_url(&dir),
        &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "20s", "--hypervisor-settle", "30s"]
            .into_iter()
            .chain(["--in-flight-ttl", "2s", "--retention", "3s"])
            .collect::<Vec<_>>(),
    );
    let slow = create_in_flight(&lb.url, "slow-1").await;
    // The claim was made before its record showed in flight; wait out its retention.
    let past = Instant::now() + retention + Duration::from_millis(500);
    while Instant::now() < past {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!slow.is_finished(), "the create finished before the retry: the test proves nothing");
    let retry = create(&lb.url, TOKEN, "slow-1", &worker_body()).await;
    assert_eq!(
        (retry.status, retry.problem_type().as_str()),
        (StatusCode::CONFLICT, "request-in-progress"),
        "{}",
        String::from_utf8_lossy(&retry.body)
    );

    let first = slow.await.expect("create");
    assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
    let replay = create(&lb.url, TOKEN, "slow-1", &worker_body()).await;
    assert!(replay.replayed(), "{}", String::from_utf8_lossy(&replay.body));
    assert_eq!(replay.json()["id"], first.json()["id"]);
    assert_eq!(fleet(&lb.url).await["workers_active"], 1);
    assert_eq!(sim_stats(&hv.url).await["boots_total"], 1);
}
