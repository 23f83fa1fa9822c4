//! Issue 28: records that survive a failover. The Redis record store with
//! `--record-store-replicas 1` against a real primary and replica: a transition the replica
//! does not acknowledge answers `503 store-unavailable`, runs no handler, and is not answered
//! as final; its retry completes or replays once the replica answers. And the service on a real
//! HA PostgreSQL (Patroni, etcd, HAProxy: `idempotency_sqlx::testing::ha`) through a switchover
//! and a kill of the primary.

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::support::*;

fn have_redis() -> bool {
    if idempotency_redis::testing::have_redis_binaries() {
        return true;
    }
    assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
    eprintln!("SKIPPED: the Redis replica test: redis-server or redis-cli is not installed");
    false
}

fn wait_for_link(replica: &idempotency_redis::testing::Node) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !replica.replication_info().contains("master_link_status:up") {
        assert!(Instant::now() < deadline, "the replica did not link to its primary");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_store_unavailable(r: &Reply) {
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert_eq!(r.problem_type(), "store-unavailable");
    assert!(r.headers.contains_key("retry-after"), "a 503 says when to retry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_replica_that_does_not_acknowledge_answers_503_and_nothing_runs_twice() {
    if !have_redis() {
        return;
    }
    let redis_dir = tempfile::tempdir().expect("tempdir");
    let primary = idempotency_redis::testing::start_server(redis_dir.path(), &[]);
    let replica = idempotency_redis::testing::start_server(
        redis_dir.path(),
        &["--replicaof", "127.0.0.1", &primary.port.to_string()],
    );
    wait_for_link(&replica);
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&["--latency-ms", "3000"]);
    let store = primary.url();
    let lb = serve(
        &sqlite_url(&dir),
        &[
            "--hypervisor-url",
            &hv.url,
            "--record-store",
            &store,
            "--record-store-replicas",
            "1",
            "--record-store-replica-timeout",
            "300ms",
        ],
    );
    let base = lb.url.clone();
    let first = create(&base, TOKEN, "wait-first", &worker_body()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));

    // The replica stops answering: a new key's claim is not acknowledged, so no handler runs.
    replica.pause();
    let refused = create(&base, TOKEN, "wait-refused", &worker_body()).await;
    assert_store_unavailable(&refused);
    assert_eq!(sim_stats(&hv.url).await["boots_total"], 1, "a claim not acknowledged ran its handler");
    replica.resume();
    wait_for_link(&replica);

    // A create in flight when the replica stops: its handler ran, but its completion is not
    // acknowledged, so it is not answered as final.
    // Its handler holds a node once its claim is acknowledged, then waits in the hypervisor's
    // latency.
    let in_flight = {
        let base = base.clone();
        tokio::spawn(async move { create(&base, TOKEN, "wait-cut", &worker_body()).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while fleet(&base).await["nodes_allocated"].as_i64() != Some(2) {
        assert!(Instant::now() < deadline, "the create's handler did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    replica.pause();
    let cut = in_flight.await.expect("task");
    assert_store_unavailable(&cut);
    replica.resume();
    wait_for_link(&replica);

    // The retries: the refused key runs now, the cut one replays its stored response.
    let retried = create_until_done(&base, "wait-refused", &worker_body(), Duration::from_secs(60)).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retried.body));
    let replay = create_until_done(&base, "wait-cut", &worker_body(), Duration::from_secs(60)).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&replay.body));
    assert!(replay.replayed(), "the completed response is replayed, not run again");
    let stats = sim_stats(&hv.url).await;
    assert_eq!(stats["duplicate_boot_tags"], 0, "{stats}");
    assert_eq!(stats["boots_total"], 3, "one boot per key: {stats}");
    let f = fleet(&base).await;
    assert_eq!(f["workers_active"].as_i64(), Some(3), "{f}");
}

/// The service on a real HA PostgreSQL (three Patroni members, synchronous replication, HAProxy
/// in front following the primary): a switchover and then a kill of the primary, each with
/// creates in flight. While there is no primary, requests get `503` promptly and `/readyz` is
/// not ready; the service recovers by itself; every create acknowledged before either failover
/// replays its worker afterwards, and nothing was booted twice or leaked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_failover_answers_503_then_recovers_and_loses_nothing_acknowledged() {
    use idempotency_sqlx::testing::ha::{HaPostgres, Replication, missing_binaries};

    use super::database::{assert_one_of_everything, creates_in_flight, readyz};

    let missing = missing_binaries();
    if !missing.is_empty() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "missing {missing:?}, and CI=true");
        eprintln!("SKIPPED: the PostgreSQL failover test: missing {}", missing.join(", "));
        return;
    }
    let pg = tokio::task::spawn_blocking(|| HaPostgres::start(Replication::Synchronous))
        .await
        .expect("task")
        .unwrap_or_else(|e| panic!("the HA cluster did not start: {e}"));
    let hv = sim(&["--latency-ms", "300"]);
    let lb = serve(&pg.url(), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "5s", "--in-flight-ttl", "2s"]);
    let base = lb.url.clone();

    let mut acknowledged = std::collections::BTreeMap::new();
    for i in 0..4 {
        let key = format!("ha-before-{i}");
        let r = create(&base, TOKEN, &key, &worker_body()).await;
        assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
        acknowledged.insert(key, r.json()["id"].as_str().expect("id").to_owned());
    }

    // A switchover with creates in flight.
    let mut keys: Vec<String> = (0..4).map(|i| format!("ha-switch-{i}")).collect();
    let in_flight = creates_in_flight(&base, &keys);
    let (mut pg, switched) = tokio::task::spawn_blocking(move || {
        let mut pg = pg;
        let r = pg.switchover();
        (pg, r)
    })
    .await
    .expect("task");
    switched.unwrap_or_else(|e| panic!("switchover: {e}"));
    answered(in_flight).await;

    // The primary dies, with creates in flight.
    let crash: Vec<String> = (0..4).map(|i| format!("ha-crash-{i}")).collect();
    let in_flight = creates_in_flight(&base, &crash);
    let killed = tokio::task::block_in_place(|| pg.kill_primary()).unwrap_or_else(|e| panic!("kill: {e}"));
    keys.extend(crash);
    // No primary yet (the leader lock outlives the kill by its ttl): a prompt 503, not ready.
    let asked = Instant::now();
    let down = create(&base, TOKEN, "ha-while-down", &worker_body()).await;
    assert_503_problem(&down);
    assert!(asked.elapsed() < Duration::from_secs(20), "the 503 took {:?}", asked.elapsed());
    assert_eq!(readyz(&base).await, StatusCode::SERVICE_UNAVAILABLE);
    answered(in_flight).await;

    // A replica is promoted; the service is ready again by itself.
    let deadline = Instant::now() + Duration::from_secs(120);
    while readyz(&base).await != StatusCode::OK {
        assert!(Instant::now() < deadline, "not ready 120 s after the primary died");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let pg = tokio::task::spawn_blocking(move || {
        pg.restart(killed).unwrap_or_else(|e| panic!("the killed member did not rejoin: {e}"));
        pg
    })
    .await
    .expect("task");

    // Nothing acknowledged was lost: each replays the worker it answered.
    for (key, id) in &acknowledged {
        let r = create(&base, TOKEN, key, &worker_body()).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&r.body));
        assert!(r.replayed(), "{key} ran again after the failover");
        assert_eq!(r.json()["id"].as_str(), Some(id.as_str()), "{key}");
    }
    keys.extend(acknowledged.into_keys());
    keys.push("ha-while-down".to_owned());
    assert_one_of_everything(&base, &hv.url, &keys).await;
    drop(pg);
}

/// Every first answer during a failover is a success or a `503` problem with `Retry-After`.
async fn answered(in_flight: Vec<tokio::task::JoinHandle<Reply>>) {
    for t in in_flight {
        let r = t.await.expect("task");
        if r.status != StatusCode::CREATED {
            assert_503_problem(&r);
        }
    }
}

/// A `503` problem with `Retry-After` (the domain's database errors and the store's are two
/// problem types today, hence no check of the type here).
fn assert_503_problem(r: &Reply) {
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["content-type"], "application/problem+json");
    assert!(r.headers.contains_key("retry-after"), "a 503 says when to retry");
}
