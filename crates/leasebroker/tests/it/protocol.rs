//! Issue 29 on the real binary: `Idempotency-Key-Expires` on every keyed response with a record
//! (and in the OpenAPI document), and `Prefer: wait=N` attaching a retry to the create in flight
//! with its key, counted on the simulator.

use std::time::{Duration, Instant, SystemTime};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{Proc, Reply, TOKEN, create, fleet, http, serve, sim, sim_stats, sqlite_url, worker_body};

/// `POST /v1/workers` with `key` and `Prefer: prefer`.
async fn create_preferring(base: &str, key: &str, prefer: &str) -> Reply {
    let resp = http()
        .post(format!("{base}/v1/workers"))
        .bearer_auth(TOKEN)
        .header("Idempotency-Key", key)
        .header("Prefer", prefer)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&worker_body()).expect("json"))
        .send()
        .await
        .expect("request");
    Reply { status: resp.status(), headers: resp.headers().clone(), body: resp.bytes().await.expect("body").to_vec() }
}

fn expires(r: &Reply) -> SystemTime {
    let v = r
        .headers
        .get("idempotency-key-expires")
        .unwrap_or_else(|| panic!("no Idempotency-Key-Expires on {} {}", r.status, String::from_utf8_lossy(&r.body)));
    let v = v.to_str().expect("ascii");
    assert!(v.ends_with(" GMT") && v.len() == 29, "not an IMF-fixdate: {v}");
    httpdate::parse_http_date(v).expect("an HTTP-date")
}

/// Starts a create with `key` in the background and waits until its record is in flight (the
/// admin records API says so).
async fn create_in_flight(base: &str, key: &str) -> tokio::task::JoinHandle<Reply> {
    let slow = tokio::spawn({
        let (base, key) = (base.to_owned(), key.to_owned());
        async move { create(&base, TOKEN, &key, &worker_body()).await }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = crate::support::send(
            Method::GET,
            &format!("{base}/admin/v1/records?state=in_flight&principal=alice"),
            crate::support::ADMIN,
            None,
            None,
        )
        .await
        .json();
        if listed["records"].as_array().is_some_and(|r| r.iter().any(|r| r["key"] == key)) {
            return slow;
        }
        assert!(Instant::now() < deadline, "the create never showed in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_keyed_response_with_a_record_says_when_the_record_expires() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--retention", "2h", "--sim-latency-ms", "2000"]);
    let retention = Duration::from_secs(2 * 3600);
    let before = SystemTime::now();

    let slow = create_in_flight(&lb.url, "exp-1").await;
    let busy = create(&lb.url, TOKEN, "exp-1", &worker_body()).await;
    assert_eq!((busy.status, busy.problem_type().as_str()), (StatusCode::CONFLICT, "request-in-progress"));
    let in_flight = expires(&busy);

    let created = slow.await.expect("create");
    let after = SystemTime::now();
    assert_eq!(created.status, StatusCode::CREATED);
    let stored = expires(&created);
    let (low, high) = (before + retention - Duration::from_secs(1), after + retention + Duration::from_secs(1));
    assert!(low <= stored && stored <= high, "{stored:?} is not about two hours from now");
    assert!(low <= in_flight && in_flight <= high, "{in_flight:?}");

    let replay = create(&lb.url, TOKEN, "exp-1", &worker_body()).await;
    assert!(replay.replayed());
    assert_eq!(expires(&replay), stored);

    let other = json!({"image": "worker-base:2025.11", "cpu": 1, "memory_gb": 1});
    let mismatch = create(&lb.url, TOKEN, "exp-1", &other).await;
    assert_eq!((mismatch.status, mismatch.problem_type().as_str()), (StatusCode::CONFLICT, "idempotency-key-reused"));
    assert_eq!(expires(&mismatch), stored);

    // No record, no expiry: a request refused before any record exists.
    let missing =
        crate::support::send(Method::POST, &format!("{}/v1/workers", lb.url), TOKEN, None, Some(&other)).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(missing.headers.get("idempotency-key-expires").is_none());
}

#[tokio::test]
async fn the_openapi_document_describes_the_headers_on_every_protected_operation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let doc: Value =
        http().get(format!("{}/openapi.json", lb.url)).send().await.expect("get").json().await.expect("json");
    let mut protected = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("item") {
            let params = op["parameters"].as_array().cloned().unwrap_or_default();
            let has =
                |name: &str| params.iter().any(|p| p["name"].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name)));
            if !has("idempotency-key") {
                continue;
            }
            protected += 1;
            assert!(has("prefer"), "{method} {path} has no Prefer parameter");
            for (status, response) in op["responses"].as_object().expect("responses") {
                let headers = &response["headers"];
                assert!(
                    headers["Idempotency-Key-Expires"]["description"]
                        .as_str()
                        .is_some_and(|d| d.contains("IMF-fixdate")),
                    "{method} {path} {status}: {response}"
                );
                assert!(headers["Preference-Applied"].is_object(), "{method} {path} {status}");
            }
        }
    }
    // POST/DELETE workers, reboot, firmware, forget record.
    assert!(protected >= 5, "only {protected} protected operations found");
}

#[tokio::test]
async fn a_retry_that_prefers_to_wait_gets_the_running_creates_response() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--sim-latency-ms", "4000"]);
    let slow = create_in_flight(&lb.url, "wait-1").await;
    let waited = create_preferring(&lb.url, "wait-1", "respond-async, wait=10").await;
    let created = slow.await.expect("create");
    assert_eq!(created.status, StatusCode::CREATED);
    assert_eq!(waited.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&waited.body));
    assert!(waited.replayed());
    assert_eq!(waited.body, created.body, "byte for byte the first response");
    // Only a request that waited says so: it was attached, not answered after the fact.
    assert_eq!(waited.headers["preference-applied"], "wait=10");
    assert_eq!(fleet(&lb.url).await["vm_boots_total"], 1);
}

#[tokio::test]
async fn a_wait_shorter_than_the_create_ends_in_the_usual_409() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--sim-latency-ms", "6000"]);
    let slow = create_in_flight(&lb.url, "wait-2").await;
    let busy = create_preferring(&lb.url, "wait-2", "wait=1").await;
    assert_eq!((busy.status, busy.problem_type().as_str()), (StatusCode::CONFLICT, "request-in-progress"));
    assert!(busy.headers.contains_key("retry-after"));
    assert_eq!(busy.headers["preference-applied"], "wait=1");
    assert!(!slow.is_finished(), "the create ended before the 409: the wait proved nothing");
    assert_eq!(slow.await.expect("create").status, StatusCode::CREATED);
}

#[tokio::test]
async fn max_wait_bounds_what_a_request_may_ask_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--sim-latency-ms", "6000", "--max-wait", "1s"]);
    let slow = create_in_flight(&lb.url, "wait-3").await;
    let busy = create_preferring(&lb.url, "wait-3", "wait=30").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.headers["preference-applied"], "wait=1");
    assert!(!slow.is_finished());
    slow.await.expect("create");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_waiters_attach_to_one_create_and_one_boot() {
    let hv: Proc = sim(&["--latency-ms", "3000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "30s"]);
    let slow = create_in_flight(&lb.url, "wait-32").await;
    let waiters: Vec<_> = (0..32)
        .map(|_| {
            let base = lb.url.clone();
            tokio::spawn(async move { create_preferring(&base, "wait-32", "wait=30").await })
        })
        .collect();
    let created = slow.await.expect("create");
    assert_eq!(created.status, StatusCode::CREATED);
    for w in waiters {
        let r = w.await.expect("waiter");
        assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body, created.body);
    }
    let stats = sim_stats(&hv.url).await;
    assert_eq!((stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64()), (Some(1), Some(0)), "{stats}");
    assert_eq!(fleet(&lb.url).await["workers_active"], 1);
}

/// Two replicas on one PostgreSQL database and one hypervisor: retries that prefer to wait
/// attach to a create running on the other replica (woken by its announcement), and the
/// hypervisor boots once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_on_another_replica_attach_to_the_running_create() {
    let Some(pg) = idempotency_sqlx::testing::TestDatabase::create().await else { return };
    let hv: Proc = sim(&["--latency-ms", "3000"]);
    let args = ["--hypervisor-url", hv.url.as_str(), "--hypervisor-timeout", "30s"];
    let (a, b) = (serve(pg.url(), &args), serve(pg.url(), &args));
    let slow = create_in_flight(&a.url, "replicas-1").await;
    let waiters: Vec<_> = (0..16)
        .map(|i| {
            let base = if i % 2 == 0 { b.url.clone() } else { a.url.clone() };
            tokio::spawn(async move { create_preferring(&base, "replicas-1", "wait=30").await })
        })
        .collect();
    let created = slow.await.expect("create");
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    for w in waiters {
        let r = w.await.expect("waiter");
        assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body, created.body);
    }
    let stats = sim_stats(&hv.url).await;
    assert_eq!((stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64()), (Some(1), Some(0)), "{stats}");
}

/// Key propagation on the real binary: a create's boot and a reboot reach the (standalone)
/// hypervisor with their tag as `Idempotency-Key: "<tag>"`, which the simulator counts; a
/// replayed create reaches it not at all.
#[tokio::test]
async fn downstream_calls_carry_their_tag_as_their_idempotency_key() {
    let hv: Proc = sim(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url]);
    let created = create(&lb.url, TOKEN, "propagate-1", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let replayed = create(&lb.url, TOKEN, "propagate-1", &worker_body()).await;
    assert_eq!(replayed.status, StatusCode::CREATED);
    let id = created.json()["id"].as_str().expect("worker id").to_owned();
    let rebooted = crate::support::send(
        Method::POST,
        &format!("{}/v1/workers/{id}/reboot", lb.url),
        TOKEN,
        Some("propagate-reboot-1"),
        None,
    )
    .await;
    assert!(rebooted.status.is_success(), "{} {}", rebooted.status, String::from_utf8_lossy(&rebooted.body));
    let stats = sim_stats(&hv.url).await;
    assert_eq!(
        (stats["boots_total"].as_i64(), stats["reboots_total"].as_i64(), stats["tag_keyed_calls"].as_i64()),
        (Some(1), Some(1), Some(2)),
        "{stats}"
    );
}
