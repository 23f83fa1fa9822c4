//! Issue 30: the admin records API on the real binary: list, read, forget (with its audit line
//! and row), refused to tenants, a record in flight never forgotten.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::support::{ADMIN, Launch, Logged, OTHER, Reply, TOKEN, create, fleet, send, sqlite_url, worker_body};

fn serve_logged(db: &str, extra: &[&str]) -> Logged {
    Launch::serve(db, &testkit::leasebroker::with_pool_nodes("16", extra)).env("RUST_LOG", "info").start()
}

async fn admin_get(base: &str, path_and_query: &str) -> Reply {
    send(Method::GET, &format!("{base}{path_and_query}"), ADMIN, None, None).await
}

async fn forget(base: &str, id: &str, key: Option<&str>) -> Reply {
    send(Method::DELETE, &format!("{base}/admin/v1/records/{id}"), ADMIN, key, None).await
}

/// Every record the listing shows for `query`, page by page with `limit`.
async fn all_pages(base: &str, query: &str, limit: u32) -> Vec<Value> {
    let mut records = vec![];
    let mut cursor: Option<String> = None;
    for _ in 0..1000 {
        let mut url = format!("/admin/v1/records?limit={limit}{query}");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page = admin_get(base, &url).await;
        assert_eq!(page.status, StatusCode::OK, "{}", String::from_utf8_lossy(&page.body));
        let page = page.json();
        let got = page["records"].as_array().expect("records").clone();
        assert!(got.len() <= limit as usize);
        records.extend(got);
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return records,
        }
    }
    panic!("the listing never ended");
}

/// actor, action, record_id, principal, endpoint, key, request_key.
type AuditRow = (String, String, String, String, String, String, Option<String>);

fn assert_problem(r: &Reply, status: StatusCode, name: &str) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem_type(), name, "{}", String::from_utf8_lossy(&r.body));
}

#[tokio::test]
async fn an_operator_lists_reads_and_forgets_records_and_each_forget_is_audited() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let lb = serve_logged(&db, &[]);
    let base = lb.url.as_str();

    let first = create(base, TOKEN, "alice-create-1", &worker_body()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let first_worker = first.json()["id"].as_str().expect("id").to_owned();
    assert_eq!(create(base, OTHER, "bob-create-1", &worker_body()).await.status, StatusCode::CREATED);

    // Tenants are refused every records route.
    for (method, path) in [(Method::GET, "/admin/v1/records"), (Method::GET, "/admin/v1/records/00")] {
        let r = send(method, &format!("{base}{path}"), TOKEN, None, None).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    let r = send(Method::DELETE, &format!("{base}/admin/v1/records/00"), TOKEN, Some("t-1"), None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    // Both records, one per page, each once; then alice's alone.
    let all = all_pages(base, "", 1).await;
    assert_eq!(all.len(), 2, "{all:?}");
    let alice = all_pages(base, "&principal=alice", 100).await;
    assert_eq!(alice.len(), 1);
    let record = &alice[0];
    assert_eq!(record["endpoint"], "POST /v1/workers");
    assert_eq!(record["key"], "alice-create-1");
    assert_eq!(record["state"], "completed");
    assert_eq!(record["response_status"], 201);
    assert!(record["fingerprint"].as_str().expect("fingerprint").starts_with("sha256:"));
    assert!(record.get("response_body").is_none(), "no body unless asked");
    let id = record["id"].as_str().expect("id").to_owned();
    assert!(all_pages(base, "&state=in_flight", 100).await.is_empty());
    assert_eq!(all_pages(base, "&state=completed", 100).await.len(), 2);
    assert!(all_pages(base, "&older_than=1h", 100).await.is_empty(), "both attempts started just now");

    // One record, and its stored response with ?body=true.
    let got = admin_get(base, &format!("/admin/v1/records/{id}")).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(&got.json(), record);
    let with_body = admin_get(base, &format!("/admin/v1/records/{id}?body=true")).await.json();
    assert_eq!(with_body["response_body_encoding"], "utf-8");
    let stored: Value = serde_json::from_str(with_body["response_body"].as_str().expect("body")).expect("json");
    assert_eq!(stored["id"], first_worker.as_str());

    // Bad input: a clear 400 or 404, nothing changed.
    for bad in ["?state=running", "?limit=0", "?limit=501", "?limit=x", "?older_than=soon", "?cursor=not-ours"] {
        let r = admin_get(base, &format!("/admin/v1/records{bad}")).await;
        assert_problem(&r, StatusCode::BAD_REQUEST, "invalid-query");
    }
    assert_problem(
        &admin_get(base, &format!("/admin/v1/records/{id}?body=yes")).await,
        StatusCode::BAD_REQUEST,
        "invalid-query",
    );
    for unknown in ["0123456789abcdef0123456789abcdef", "not-an-id", "%2e%2e"] {
        assert_problem(
            &admin_get(base, &format!("/admin/v1/records/{unknown}")).await,
            StatusCode::NOT_FOUND,
            "not-found",
        );
        assert_problem(&forget(base, unknown, Some("f-unknown")).await, StatusCode::NOT_FOUND, "not-found");
    }
    // Forget needs a key, like every mutating route.
    assert_problem(&forget(base, &id, None).await, StatusCode::BAD_REQUEST, "idempotency-key-missing");
    assert_eq!(admin_get(base, &format!("/admin/v1/records/{id}")).await.status, StatusCode::OK);

    // Forget: 204, replayed on retry; the record is gone.
    let done = forget(base, &id, Some("forget-alice-1")).await;
    assert_eq!(done.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&done.body));
    let again = forget(base, &id, Some("forget-alice-1")).await;
    assert_eq!((again.status, again.replayed()), (StatusCode::NO_CONTENT, true));
    assert_problem(&admin_get(base, &format!("/admin/v1/records/{id}")).await, StatusCode::NOT_FOUND, "not-found");

    // The audit line in the log, and the row in the table.
    let line = lb.wait_for_line(&["audit", &id]);
    for part in ["actor=admin", "action=forget", "principal=alice", "alice-create-1", "forget-alice-1"] {
        assert!(line.contains(part), "{part} not in {line}");
    }
    let pool = sqlx::SqlitePool::connect(&db).await.expect("open the database");
    let rows: Vec<AuditRow> =
        sqlx::query_as("SELECT actor, action, record_id, principal, endpoint, key, request_key FROM lb_record_audit")
            .fetch_all(&pool)
            .await
            .expect("audit rows");
    assert_eq!(
        rows,
        vec![(
            "admin".into(),
            "forget".into(),
            id.clone(),
            "alice".into(),
            "POST /v1/workers".into(),
            "alice-create-1".into(),
            Some("forget-alice-1".into())
        )],
        "one row per forget, not per retry"
    );

    // The forgotten key runs as a new operation: a second worker.
    let rerun = create(base, TOKEN, "alice-create-1", &worker_body()).await;
    assert_eq!((rerun.status, rerun.replayed()), (StatusCode::CREATED, false));
    assert_ne!(rerun.json()["id"].as_str(), Some(first_worker.as_str()));
    assert_eq!(fleet(base).await["workers_active"], 3);
}

#[tokio::test]
async fn a_record_in_flight_is_listed_as_stuck_and_never_forgotten() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Every hypervisor call takes 3 s: the create stays in flight that long.
    let lb = serve_logged(&sqlite_url(&dir), &["--sim-latency-ms", "3000"]);
    let base = lb.url.clone();
    let slow = tokio::spawn({
        let base = base.clone();
        async move { create(&base, TOKEN, "alice-slow-1", &worker_body()).await }
    });

    let deadline = Instant::now() + Duration::from_secs(60);
    let record = loop {
        let listed = all_pages(&base, "&state=in_flight&principal=alice", 10).await;
        if let Some(r) = listed.into_iter().next() {
            break r;
        }
        assert!(Instant::now() < deadline, "the create never showed in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let id = record["id"].as_str().expect("id").to_owned();
    assert_eq!(record["response_status"], Value::Null);

    let refused = forget(&base, &id, Some("forget-slow-1")).await;
    assert_problem(&refused, StatusCode::CONFLICT, "record-in-flight");
    assert_eq!(admin_get(&base, &format!("/admin/v1/records/{id}")).await.json()["state"], "in_flight");

    // The create finishes as usual; its record was never taken from it.
    let created = slow.await.expect("create task");
    assert_eq!(created.status, StatusCode::CREATED);
    let after = admin_get(&base, &format!("/admin/v1/records/{id}")).await.json();
    assert_eq!((after["state"].as_str(), after["response_status"].as_i64()), (Some("completed"), Some(201)));
    assert!(!lb.log().contains("an operator forgot"), "nothing was audited");
}

/// Two replicas on one PostgreSQL database, each with its replay cache (on by default): the
/// replays on the second are answered from its copy, and a forget through the first reaches that
/// copy (the store's announcement) within a second: the key then runs again on the second, as a
/// new worker, where a stale copy would replay the forgotten one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_on_one_replica_reaches_the_replay_cache_of_another() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let (a, b) = (serve_logged(pg.url(), &[]), serve_logged(pg.url(), &[]));
    let first = create(&a.url, TOKEN, "cached-create-1", &worker_body()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
    // Replays on B until its copy has answered three of them (B's announcement feed connects in
    // the background at its start; until it listens, B reads the store): B's /metrics counts
    // the copy's answers.
    let mut hits = 0.0;
    for _ in 0..200 {
        let replayed = create(&b.url, TOKEN, "cached-create-1", &worker_body()).await;
        assert_eq!((replayed.status, replayed.replayed()), (StatusCode::CREATED, true));
        assert_eq!(replayed.body, first.body);
        let metrics = reqwest::get(format!("{}/metrics", b.url)).await.expect("metrics").text().await.expect("text");
        hits = metrics
            .lines()
            .find_map(|l| l.strip_prefix("idempotency_replay_cache_hits_total "))
            .and_then(|n| n.trim().parse().ok())
            .expect("the replay cache's counter");
        if hits >= 3.0 {
            break;
        }
    }
    assert!(hits >= 3.0, "{hits} of 200 replays from the cache");
    let listed = all_pages(&a.url, "&principal=alice", 100).await;
    let id = listed.iter().find(|r| r["key"] == "cached-create-1").expect("the create's record")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let forgot = forget(&a.url, &id, Some("forget-cached-1")).await;
    assert_eq!(forgot.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&forgot.body));

    tokio::time::sleep(idempotency::conformance::INVALIDATION_BOUND).await;
    let again = create(&b.url, TOKEN, "cached-create-1", &worker_body()).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, false),
        "{}",
        String::from_utf8_lossy(&again.body)
    );
    assert_ne!(again.json()["id"], first.json()["id"], "the forgotten create runs again as a new worker");
}
