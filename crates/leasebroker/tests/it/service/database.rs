//! The database goes away while creates are in flight (issue 12 item 9, docs/protocol.md#running-leasebroker): requests get
//! prompt `503` problems, `/readyz` says not ready, the service recovers by itself when the
//! database returns, and afterwards nothing was booted twice and nothing is held.
//!
//! PostgreSQL: a cluster of the test's own (initdb and pg_ctl, as user `postgres` when the test
//! runs as root, on a free port, removed after), stopped with `-m immediate` mid-run. SQLite: the
//! database file is locked by another connection (`BEGIN EXCLUSIVE`) for longer than the
//! service's busy timeout, so its writes fail; reads (and so `/readyz`) still work, as they do in
//! WAL mode.
//!
//! Both run with the default `--in-flight-ttl` (5 minutes): the creates the outage cut are
//! released as soon as the database answers again (issue 34), so their retries resume at once.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use testkit::postgres::LocalServer;

use crate::support::*;

pub(super) async fn readyz(base: &str) -> StatusCode {
    http().get(format!("{base}/readyz")).send().await.expect("readyz").status()
}

/// Starts one create per key at once (each held in the hypervisor's latency, so they are in
/// flight when the database goes), returning their first answers when they come.
pub(super) fn creates_in_flight(base: &str, keys: &[String]) -> Vec<tokio::task::JoinHandle<Reply>> {
    keys.iter()
        .map(|key| {
            let (base, key) = (base.to_owned(), key.clone());
            tokio::spawn(async move { create(&base, TOKEN, &key, &worker_body()).await })
        })
        .collect()
}

/// Every first answer is a success or a `503` problem, never another error, and the outage
/// really caught some of the creates mid-flight (they were held in the hypervisor's latency).
async fn assert_created_or_503(in_flight: Vec<tokio::task::JoinHandle<Reply>>) {
    let mut unavailable = 0;
    for t in in_flight {
        let r = t.await.expect("task");
        if r.status != StatusCode::CREATED {
            assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(r.headers["content-type"], "application/problem+json");
            assert_eq!(r.problem_type(), "store-unavailable", "{}", String::from_utf8_lossy(&r.body));
            assert!(r.headers.contains_key("retry-after"), "a 503 says when to retry");
            unavailable += 1;
        }
    }
    assert!(unavailable > 0, "no create was in flight when the database went away");
}

/// Every key ends in one worker of its own; the hypervisor booted each once; the fleet holds
/// exactly those workers, one node, lease and VM each.
pub(super) async fn assert_one_of_everything(base: &str, sim_url: &str, keys: &[String]) {
    let mut ids = std::collections::HashSet::new();
    for key in keys {
        let r = create_until_done(base, key, &worker_body(), Duration::from_secs(90)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&r.body));
        ids.insert(r.json()["id"].as_str().expect("id").to_owned());
    }
    assert_eq!(ids.len(), keys.len(), "one worker per key: {ids:?}");
    let n = keys.len() as i64;
    let stats = sim_stats(sim_url).await;
    assert_eq!(stats["duplicate_boot_tags"], 0, "{stats}");
    assert_eq!((stats["boots_total"].as_i64(), stats["running"].as_i64()), (Some(n), Some(n)), "{stats}");
    let f = fleet(base).await;
    let counts = ["workers_active", "nodes_allocated", "leases_active", "vms_running"].map(|k| f[k].as_i64());
    assert_eq!(counts, [Some(n); 4], "{f}");
}

#[tokio::test]
async fn postgres_restart_with_creates_in_flight_answers_503_then_recovers_without_duplicates() {
    let Some(mut pg) = LocalServer::start() else { return };
    let hv = sim(&["--latency-ms", "600"]);
    let lb = serve(&pg.url("postgres"), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "5s"]);
    let base = lb.url.clone();
    let warm = create(&base, TOKEN, "pg-warm", &worker_body()).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&warm.body));

    let mut keys: Vec<String> = (0..8).map(|i| format!("pg-flight-{i}")).collect();
    let in_flight = creates_in_flight(&base, &keys);
    tokio::time::sleep(Duration::from_millis(250)).await;
    pg.stop();

    // Down: a new request gets a 503 problem promptly (the pool gives up on connecting well before
    // the client's 30 s timeout), and /readyz is not ready.
    let asked = Instant::now();
    let down = create(&base, TOKEN, "pg-while-down", &worker_body()).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&down.body));
    assert_eq!(down.headers["content-type"], "application/problem+json");
    assert!(asked.elapsed() < Duration::from_secs(20), "the 503 took {:?}", asked.elapsed());
    assert_eq!(readyz(&base).await, StatusCode::SERVICE_UNAVAILABLE);
    assert_created_or_503(in_flight).await;

    // Back: the same process becomes ready again by itself.
    pg.start_again();
    let deadline = Instant::now() + Duration::from_secs(60);
    while readyz(&base).await != StatusCode::OK {
        assert!(Instant::now() < deadline, "not ready 60 s after the database came back");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    keys.extend(["pg-warm".to_owned(), "pg-while-down".to_owned()]);
    assert_one_of_everything(&base, &hv.url, &keys).await;
}

#[tokio::test]
async fn sqlite_locked_past_the_busy_timeout_answers_503_then_recovers_without_duplicates() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let hv = sim(&["--latency-ms", "600"]);
    let lb = serve(&db, &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "5s"]);
    let base = lb.url.clone();
    let warm = create(&base, TOKEN, "sq-warm", &worker_body()).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&warm.body));

    let mut keys: Vec<String> = (0..8).map(|i| format!("sq-flight-{i}")).collect();
    let in_flight = creates_in_flight(&base, &keys);
    tokio::time::sleep(Duration::from_millis(250)).await;
    // Another process's writer holds the lock past the service's 10 s busy timeout.
    let mut locker = sqlx::SqliteConnection::connect(&db).await.expect("open the database");
    sqlx::raw_sql("BEGIN EXCLUSIVE").execute(&mut locker).await.expect("lock");
    let asked = Instant::now();
    let down = create(&base, TOKEN, "sq-while-locked", &worker_body()).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&down.body));
    assert_eq!(down.headers["content-type"], "application/problem+json");
    assert!(asked.elapsed() < Duration::from_secs(28), "the 503 took {:?}", asked.elapsed());
    // The creates caught in the middle reached their next write after the hypervisor's 600 ms:
    // hold the lock past their busy timeout too, then let go (each statement waits out the busy
    // timeout on its own, so a request held longer would take several of them), and collect
    // their first answers.
    tokio::time::sleep(Duration::from_secs(14).saturating_sub(asked.elapsed())).await;
    sqlx::raw_sql("ROLLBACK").execute(&mut locker).await.expect("unlock");
    locker.close().await.expect("close");
    assert_created_or_503(in_flight).await;

    assert_eq!(readyz(&base).await, StatusCode::OK);
    keys.extend(["sq-warm".to_owned(), "sq-while-locked".to_owned()]);
    assert_one_of_everything(&base, &hv.url, &keys).await;
}
