//! Issue 15: firmware flashes as idempotent long-running operations. Each test runs the real
//! binary against a standalone simulator (its BMCs brick a node flashed while flashing) and
//! counts flashes from ground truth: the simulator's stats and the BMCs' own state.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{ADMIN, Reply, TOKEN, fleet, http, send, serve, sim, sim_stats, sqlite_url};

/// Flashes `node` with `key` on `base`, once.
pub(crate) async fn flash(base: &str, node: &str, key: &str, version: &str) -> Reply {
    let url = format!("{base}/admin/v1/nodes/{node}/firmware");
    send(Method::POST, &url, ADMIN, Some(key), Some(&json!({"version": version}))).await
}

/// Flashes like a client that retries with one key: past `409 request-in-progress` and `503`.
pub(crate) async fn flash_until_answered(base: &str, node: &str, key: &str, version: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = flash(base, node, key, version).await;
        let retry = r.status == StatusCode::SERVICE_UNAVAILABLE
            || (r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress");
        if !retry || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn operation(base: &str, op_id: &str) -> Reply {
    send(Method::GET, &format!("{base}/admin/v1/operations/{op_id}"), ADMIN, None, None).await
}

/// Polls the operation until it is no longer `running` (or 60 s passed); returns it.
pub(crate) async fn until_ended(base: &str, op_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let op = operation(base, op_id).await.json();
        if op["state"] != "running" || Instant::now() > deadline {
            return op;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn bmc(sim: &str, node: &str) -> Value {
    http().get(format!("{sim}/v1/bmc/{node}")).send().await.expect("bmc").json().await.expect("json")
}

/// The flashes the simulator's BMCs took, and how many nodes they bricked.
pub(crate) async fn flashes_and_bricked(sim: &str) -> (i64, i64, i64) {
    let s = sim_stats(sim).await;
    (
        s["flashes_total"].as_i64().unwrap_or(-1),
        s["duplicate_flash_tags"].as_i64().unwrap_or(-1),
        s["bricked_nodes"].as_i64().unwrap_or(-1),
    )
}

/// A counter's value in a Prometheus text page (0 when absent).
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const POLL: [&str; 2] = ["--operation-poll", "100ms"];

#[tokio::test]
async fn a_retry_during_a_running_flash_gets_the_same_operation_at_once() {
    let hv = sim(&["--flash-ms", "2000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, POLL[0], POLL[1]]);

    let first = flash(&lb.url, "node-0003", "fw-1", "2.4.1").await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&first.body));
    let op = first.json();
    let op_id = op["id"].as_str().expect("id").to_owned();
    assert!(op_id.starts_with("op-"), "{op}");
    assert_eq!(first.headers["location"], format!("/admin/v1/operations/{op_id}").as_str());
    assert_eq!((op["kind"].as_str(), op["node_id"].as_str()), (Some("firmware-flash"), Some("node-0003")), "{op}");
    assert_eq!((op["state"].as_str(), op["version"].as_str()), (Some("running"), Some("2.4.1")), "{op}");
    for field in ["error", "created_at", "finished_at"] {
        assert!(op.get(field).is_some(), "the operation lacks {field}: {op}");
    }

    // The retry while the flash writes: the same 202, byte for byte, replayed.
    let retry = flash(&lb.url, "node-0003", "fw-1", "2.4.1").await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    assert!(retry.replayed(), "a retry replays the stored 202");
    assert_eq!(retry.body, first.body);
    assert_eq!(bmc(&hv.url, "node-0003").await["state"], "flashing", "the retry came while the flash still wrote");

    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    assert!(ended["finished_at"].is_string() && ended["error"].is_null(), "{ended}");
    let node = bmc(&hv.url, "node-0003").await;
    assert_eq!((node["state"].as_str(), node["firmware"].as_str()), (Some("ok"), Some("2.4.1")), "{node}");
    let after = flash(&lb.url, "node-0003", "fw-1", "2.4.1").await;
    assert!(after.replayed() && after.body == first.body, "a retry after the end replays the 202 too");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));
    let f = fleet(&lb.url).await;
    assert_eq!((f["firmware_flashes_total"].as_i64(), f["nodes_bricked"].as_i64()), (Some(1), Some(0)), "{f}");
}

#[tokio::test]
async fn a_retry_while_the_first_attempt_is_accepting_is_pointed_at_the_operation() {
    let hv = sim(&["--flash-ms", "500", "--latency-ms", "1500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, POLL[0], POLL[1]]);
    let base = lb.url.clone();
    let first = tokio::spawn(async move { flash(&base, "node-0008", "fw-link", "1.0.1").await });
    tokio::time::sleep(Duration::from_millis(500)).await; // the BMC call is under way
    let retry = flash(&lb.url, "node-0008", "fw-link", "1.0.1").await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&retry.body));
    assert_eq!(retry.problem_type(), "request-in-progress");
    let link = retry.headers["link"].to_str().expect("ascii").to_owned();
    let first = first.await.expect("task");
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let location = first.headers["location"].to_str().expect("ascii");
    assert_eq!(link, format!("<{location}>; rel=\"monitor\""), "the retry is pointed at the operation");
}

#[tokio::test]
async fn thirty_two_concurrent_requests_with_one_key_give_one_flash() {
    let hv = sim(&["--flash-ms", "1500", "--latency-ms", "200"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, POLL[0], POLL[1]]);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let base = lb.url.clone();
            tokio::spawn(async move { flash_until_answered(&base, "node-0005", "fw-32", "3.0.0").await })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&r.body));
        ids.insert(r.json()["id"].as_str().expect("id").to_owned());
    }
    assert_eq!(ids.len(), 1, "one operation: {ids:?}");
    let op_id = ids.pop_first().expect("one");
    assert_eq!(until_ended(&lb.url, &op_id).await["state"], "succeeded");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "one flash, no node bricked");
}

#[tokio::test]
async fn a_different_key_on_a_flashing_node_is_refused_without_reaching_the_bmc() {
    let hv = sim(&["--flash-ms", "1500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, POLL[0], POLL[1]]);
    let first = flash(&lb.url, "node-0002", "fw-a", "1.1.0").await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let op_id = first.json()["id"].as_str().expect("id").to_owned();

    let other = flash(&lb.url, "node-0002", "fw-b", "1.2.0").await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&other.body));
    assert_eq!(other.problem_type(), "operation-conflict");
    assert_eq!(other.json()["operation_id"], op_id.as_str(), "the problem names the running operation");
    assert_eq!(other.headers["content-type"], "application/problem+json");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "the second key never reached the BMC");

    // Another node is free to flash meanwhile; the node itself, once its operation ended.
    assert_eq!(flash(&lb.url, "node-0001", "fw-c", "1.2.0").await.status, StatusCode::ACCEPTED);
    assert_eq!(until_ended(&lb.url, &op_id).await["state"], "succeeded");
    let later = flash_until_answered(&lb.url, "node-0002", "fw-d", "1.2.0").await;
    assert_eq!(later.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&later.body));
    let later_id = later.json()["id"].as_str().expect("id").to_owned();
    assert_eq!(until_ended(&lb.url, &later_id).await["state"], "succeeded");
    assert_eq!(flashes_and_bricked(&hv.url).await, (3, 0, 0));
    assert_eq!(bmc(&hv.url, "node-0002").await["firmware"], "1.2.0");
}

#[tokio::test]
async fn sigkill_during_a_flash_then_restart_the_operation_still_ends_succeeded() {
    let hv = sim(&["--flash-ms", "3000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let args = ["--hypervisor-url", hv.url.as_str(), POLL[0], POLL[1]];
    let mut lb = serve(&db, &args);
    let first = flash(&lb.url, "node-0004", "fw-kill", "5.0.0").await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&first.body));
    let op_id = first.json()["id"].as_str().expect("id").to_owned();
    // Killed once its watcher holds the operation: the new process must wait out that lease.
    tokio::time::sleep(Duration::from_millis(500)).await;
    lb.sigkill();

    let lb = serve(&db, &args);
    let retry = flash(&lb.url, "node-0004", "fw-kill", "5.0.0").await;
    assert!(retry.replayed() && retry.body == first.body, "the 202 survived the kill");
    // The dead process's watch lease expires and the new process takes the operation over.
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));
    assert_eq!(bmc(&hv.url, "node-0004").await["firmware"], "5.0.0");
}

#[tokio::test]
async fn sigkill_while_the_bmc_call_is_in_flight_then_a_retry_flashes_once() {
    let hv = sim(&["--flash-ms", "1000", "--latency-ms", "1500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let args = [
        "--hypervisor-url",
        hv.url.as_str(),
        "--in-flight-ttl",
        "1s",
        "--hypervisor-timeout",
        "3s",
        "--hypervisor-settle",
        "4s",
        POLL[0],
        POLL[1],
    ];
    let mut lb = serve(&db, &args);
    let base = lb.url.clone();
    let pending = tokio::spawn(async move { flash(&base, "node-0007", "fw-midcall", "6.0.0").await });
    tokio::time::sleep(Duration::from_millis(700)).await; // the BMC call is on its way
    lb.sigkill();
    let _ = pending.await;

    let lb = serve(&db, &args);
    let r = flash_until_answered(&lb.url, "node-0007", "fw-midcall", "6.0.0").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&r.body));
    let ended = until_ended(&lb.url, r.json()["id"].as_str().expect("id")).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    let (flashes, duplicates, bricked) = flashes_and_bricked(&hv.url).await;
    assert_eq!((flashes, duplicates, bricked), (1, 0, 0), "one flash, whether the first call landed or not");
}

#[tokio::test]
async fn two_replicas_never_watch_one_operation_twice() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv = sim(&["--flash-ms", "1500"]);
    let args = ["--hypervisor-url", hv.url.as_str(), POLL[0], POLL[1]];
    let a = serve(pg.url(), &args);
    let b = serve(pg.url(), &args);
    let mut ops = vec![];
    for i in 0..8 {
        let base = if i % 2 == 0 { &a.url } else { &b.url };
        let r = flash_until_answered(base, &format!("node-{:04}", i + 1), &format!("fw-replica-{i}"), "7.0.0").await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&r.body));
        ops.push(r.json()["id"].as_str().expect("id").to_owned());
    }
    for op_id in &ops {
        assert_eq!(until_ended(&a.url, op_id).await["state"], "succeeded", "{op_id}");
    }
    let mut watches = 0.0;
    for base in [&a.url, &b.url] {
        let text = http().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
        watches += counter(&text, "leasebroker_operation_watches_total");
    }
    assert_eq!(watches, 8.0, "each operation was taken up by one watcher, once");
    assert_eq!(flashes_and_bricked(&hv.url).await, (8, 0, 0));
}

#[tokio::test]
async fn a_flash_that_fails_ends_failed_and_names_why() {
    let hv = sim(&["--flash-ms", "500", "--flash-fail", "1.0"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, POLL[0], POLL[1]]);
    let r = flash(&lb.url, "node-0006", "fw-fail", "9.9.9").await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let ended = until_ended(&lb.url, r.json()["id"].as_str().expect("id")).await;
    assert_eq!(ended["state"], "failed", "{ended}");
    assert!(ended["error"].as_str().is_some_and(|e| e.contains("verification")), "{ended}");
    assert!(ended["finished_at"].is_string(), "{ended}");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));
}

#[tokio::test]
async fn bad_flash_requests_get_problems_and_change_nothing() {
    let hv = sim(&["--flash-ms", "500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url]);
    let url = format!("{}/admin/v1/nodes/node-0001/firmware", lb.url);
    let body = json!({"version": "1.0.0"});
    let cases: [(Reply, StatusCode, &str); 6] = [
        (send(Method::POST, &url, TOKEN, Some("k1"), Some(&body)).await, StatusCode::UNAUTHORIZED, "unauthorized"),
        (send(Method::POST, &url, ADMIN, None, Some(&body)).await, StatusCode::BAD_REQUEST, ""),
        (flash(&lb.url, "node-9999", "k2", "1.0.0").await, StatusCode::NOT_FOUND, "not-found"),
        (flash(&lb.url, "node-0001", "k3", "1.0 0").await, StatusCode::UNPROCESSABLE_ENTITY, "validation-failed"),
        (
            send(Method::POST, &url, ADMIN, Some("k4"), Some(&json!({"version": "1", "extra": 1}))).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation-failed",
        ),
        (operation(&lb.url, "op-0000000000000000").await, StatusCode::NOT_FOUND, "not-found"),
    ];
    for (i, (reply, status, problem)) in cases.iter().enumerate() {
        assert_eq!(reply.status, *status, "case {i}: {}", String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.headers["content-type"], "application/problem+json", "case {i}");
        if !problem.is_empty() {
            assert_eq!(reply.problem_type(), *problem, "case {i}");
        }
    }
    assert_eq!(flashes_and_bricked(&hv.url).await, (0, 0, 0), "nothing reached the BMC");
}
