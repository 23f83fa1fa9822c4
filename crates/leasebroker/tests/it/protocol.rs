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
pub(crate) async fn create_in_flight(base: &str, key: &str) -> tokio::task::JoinHandle<Reply> {
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
            for name in ["repeatability-request-id", "repeatability-first-sent"] {
                assert!(has(name), "{method} {path} has no {name} parameter");
            }
            for (status, response) in op["responses"].as_object().expect("responses") {
                let headers = &response["headers"];
                assert!(
                    headers["Idempotency-Key-Expires"]["description"]
                        .as_str()
                        .is_some_and(|d| d.contains("IMF-fixdate")),
                    "{method} {path} {status}: {response}"
                );
                assert!(headers["Preference-Applied"].is_object(), "{method} {path} {status}");
                assert!(headers["Repeatability-Result"].is_object(), "{method} {path} {status}");
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
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "29s"]);
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
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv: Proc = sim(&["--latency-ms", "3000"]);
    let args = ["--hypervisor-url", hv.url.as_str(), "--hypervisor-timeout", "29s"];
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

/// `--key-sources`: the other keys docs/protocol.md#records names, on the real binary.
mod key_sources {
    use super::*;
    use crate::support::{ADMIN, send};

    /// `method url` with the Repeatability headers (`first_sent`: seconds ago) and `body`.
    async fn repeatable(
        method: Method,
        url: &str,
        token: &str,
        id: &str,
        first_sent: Option<u64>,
        body: Option<&Value>,
    ) -> Reply {
        let mut req = http().request(method, url).bearer_auth(token).header("Repeatability-Request-ID", id);
        if let Some(ago) = first_sent {
            req = req.header(
                "Repeatability-First-Sent",
                httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(ago)),
            );
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(serde_json::to_vec(b).expect("json"));
        }
        let resp = req.send().await.expect("request");
        Reply {
            status: resp.status(),
            headers: resp.headers().clone(),
            body: resp.bytes().await.expect("body").to_vec(),
        }
    }

    /// A POST with `body` and no key header.
    async fn post_body(url: &str, token: &str, body: &Value) -> Reply {
        send(Method::POST, url, token, None, Some(body)).await
    }

    fn result(r: &Reply) -> &str {
        r.headers.get("repeatability-result").and_then(|v| v.to_str().ok()).unwrap_or("(none)")
    }

    #[tokio::test]
    async fn sixteen_creates_with_one_repeatability_request_id_boot_one_vm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lb = serve(
            &sqlite_url(&dir),
            &["--key-sources", "repeatability", "--sim-latency-ms", "1500", "--rate-limit", "0"],
        );
        let url = format!("{}/v1/workers", lb.url);
        let body = worker_body();
        let answers = futures::future::join_all(
            (0..16).map(|_| repeatable(Method::POST, &url, TOKEN, "rr-create-1", Some(0), Some(&body))),
        )
        .await;
        let created: Vec<&Reply> = answers.iter().filter(|r| r.status == StatusCode::CREATED).collect();
        assert!(!created.is_empty(), "{:?}", answers.iter().map(|r| r.status).collect::<Vec<_>>());
        for r in &answers {
            match r.status {
                StatusCode::CREATED => {
                    assert_eq!(result(r), "accepted");
                    assert_eq!(r.body, created[0].body, "every 201 is the one create");
                }
                StatusCode::CONFLICT => {
                    assert_eq!((r.problem_type().as_str(), result(r)), ("request-in-progress", "rejected"));
                }
                other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&r.body)),
            }
        }
        // The same key in Idempotency-Key names the same record.
        let replay = create(&lb.url, TOKEN, "rr-create-1", &body).await;
        assert!(replay.replayed(), "{} {}", replay.status, String::from_utf8_lossy(&replay.body));
        assert_eq!(replay.body, created[0].body);
        assert_eq!(fleet(&lb.url).await["vm_boots_total"], 1, "one boot for sixteen requests and a replay");
    }

    #[tokio::test]
    async fn repeatability_refusals_change_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lb = serve(&sqlite_url(&dir), &["--key-sources", "repeatability", "--retention", "1h"]);
        let url = format!("{}/v1/workers", lb.url);
        let body = worker_body();

        // First sent longer ago than the retention: the record may be gone, so nothing runs.
        let old = repeatable(Method::POST, &url, TOKEN, "rr-old", Some(2 * 3600), Some(&body)).await;
        assert_eq!(
            (old.status, old.problem_type().as_str()),
            (StatusCode::PRECONDITION_FAILED, "repeatability-expired")
        );
        assert_eq!(result(&old), "rejected");
        // No First-Sent.
        let bare = repeatable(Method::POST, &url, TOKEN, "rr-bare", None, Some(&body)).await;
        assert_eq!((bare.status, bare.problem_type().as_str()), (StatusCode::BAD_REQUEST, "idempotency-key-invalid"));
        // Two different keys on one request.
        let two = http()
            .post(&url)
            .bearer_auth(TOKEN)
            .header("Idempotency-Key", "rr-one")
            .header("Repeatability-Request-ID", "rr-two")
            .header("Repeatability-First-Sent", httpdate::fmt_http_date(SystemTime::now()))
            .json(&body)
            .send()
            .await
            .expect("request");
        assert_eq!(two.status(), StatusCode::BAD_REQUEST);
        let f = fleet(&lb.url).await;
        assert_eq!((f["vm_boots_total"].as_i64(), f["workers_active"].as_i64()), (Some(0), Some(0)), "{f}");

        // Reboot and delete take it too, once each.
        let created = repeatable(Method::POST, &url, TOKEN, "rr-made", Some(0), Some(&body)).await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
        let id = created.json()["id"].as_str().expect("id").to_owned();
        let reboot_url = format!("{url}/{id}/reboot");
        for _ in 0..2 {
            let r = repeatable(Method::POST, &reboot_url, TOKEN, "rr-reboot", Some(0), None).await;
            assert!(r.status.is_success(), "{} {}", r.status, String::from_utf8_lossy(&r.body));
            assert_eq!(result(&r), "accepted");
        }
        let worker = send(Method::GET, &format!("{url}/{id}"), TOKEN, None, None).await.json();
        assert_eq!(worker["reboot_count"], 1, "{worker}");
        for _ in 0..2 {
            let r = repeatable(Method::DELETE, &format!("{url}/{id}"), TOKEN, "rr-delete", Some(0), None).await;
            assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&r.body));
        }
        assert_eq!(fleet(&lb.url).await["workers_active"], 0);
    }

    #[tokio::test]
    async fn the_body_request_id_keys_a_create_and_a_flash() {
        let hv = sim(&["--flash-ms", "300"]);
        let dir = tempfile::tempdir().expect("tempdir");
        let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, "--key-sources", "request-id"]);
        let url = format!("{}/v1/workers", lb.url);
        let mut body = worker_body();
        body["request_id"] = json!("aip-155-create-1");

        let first = post_body(&url, TOKEN, &body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
        assert!(first.json().get("request_id").is_none(), "the key is not part of the worker");
        let again = post_body(&url, TOKEN, &body).await;
        assert!(again.replayed(), "{} {}", again.status, String::from_utf8_lossy(&again.body));
        assert_eq!(again.body, first.body);
        // The same value in the header is the same key (and the same request).
        let header = create(&lb.url, TOKEN, "aip-155-create-1", &body).await;
        assert!(header.replayed() && header.body == first.body);
        // A different request_id is another create.
        body["request_id"] = json!("aip-155-create-2");
        assert_eq!(post_body(&url, TOKEN, &body).await.status, StatusCode::CREATED);
        // Not a string: refused, nothing runs.
        body["request_id"] = json!(42);
        let bad = post_body(&url, TOKEN, &body).await;
        assert_eq!((bad.status, bad.problem_type().as_str()), (StatusCode::BAD_REQUEST, "idempotency-key-invalid"));
        assert_eq!(sim_stats(&hv.url).await["boots_total"], 2);

        let flash_url = format!("{}/admin/v1/nodes/node-0005/firmware", lb.url);
        let fw = json!({"version": "2.4.1", "request_id": "aip-155-flash-1"});
        let first = post_body(&flash_url, ADMIN, &fw).await;
        assert_eq!(first.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&first.body));
        let again = post_body(&flash_url, ADMIN, &fw).await;
        assert!(
            again.replayed() && again.body == first.body,
            "{} {}",
            again.status,
            String::from_utf8_lossy(&again.body)
        );
        let op_id = first.json()["id"].as_str().expect("id").to_owned();
        assert_eq!(crate::flashes::until_ended(&lb.url, &op_id).await["state"], "succeeded");
        assert_eq!(crate::flashes::flashes_and_bricked(&hv.url).await, (1, 0, 0));
    }

    #[tokio::test]
    async fn without_the_flag_a_body_request_id_is_refused_and_not_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lb = serve(&sqlite_url(&dir), &[]);
        let mut body = worker_body();
        body["request_id"] = json!("aip-155-unasked");
        // No key header: the layer asks for one (the body is not read for a key).
        let keyless = post_body(&format!("{}/v1/workers", lb.url), TOKEN, &body).await;
        assert_eq!(keyless.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&keyless.body));
        // A key header and a request_id the service does not read: 422, saying why.
        let r = create(&lb.url, TOKEN, "k-unasked", &body).await;
        assert_eq!((r.status, r.problem_type().as_str()), (StatusCode::UNPROCESSABLE_ENTITY, "validation-failed"));
        assert!(r.json()["detail"].as_str().is_some_and(|d| d.contains("--key-sources request-id")), "{}", r.json());
        // Repeatability-Request-ID alone is not a key either.
        let rr = repeatable(
            Method::POST,
            &format!("{}/v1/workers", lb.url),
            TOKEN,
            "rr-unasked",
            Some(0),
            Some(&worker_body()),
        )
        .await;
        assert_eq!(rr.status, StatusCode::BAD_REQUEST);
        assert_eq!(fleet(&lb.url).await["vm_boots_total"], 0);
    }
}
