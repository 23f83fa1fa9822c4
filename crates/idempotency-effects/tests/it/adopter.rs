//! The second adopter (`examples/dns_records.rs`) as real processes: the service and its fake
//! DNS provider (`examples/fake_dns.rs`). The service is SIGKILLed while its call to the
//! provider is in flight, restarted on the same database, and the client retries with the same
//! key: exactly one DNS record exists, counted by the provider.

use std::time::Duration;

use serde_json::Value;
use testkit::{Launch, Proc};

/// Starts this crate's example `name` with `args` (`RUST_LOG=info`, its log kept in `log`) and
/// waits for its address; the process is killed (SIGKILL) when dropped.
fn start_example(name: &str, args: &[&str], log: &std::path::Path) -> Proc {
    Launch::of(testkit::example(name), args).env("RUST_LOG", "info").log_to(log).start()
}

async fn stats(http: &reqwest::Client, dns: &str) -> Value {
    http.get(format!("{dns}/stats")).send().await.expect("fake DNS answers").json().await.expect("json")
}

fn create(http: &reqwest::Client, svc: &str, key: &str) -> reqwest::RequestBuilder {
    http.post(format!("{svc}/v1/records"))
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("X-User", "team-a")
        .json(&serde_json::json!({ "name": "api.example.com", "value": "10.0.0.7" }))
}

/// Retries `key` until it answers 201 (each answer is 201, or 503/409 with Retry-After).
async fn retry_until_created(http: &reqwest::Client, svc: &str, key: &str, log: &std::path::Path) -> (Value, u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut tries = 0;
    loop {
        tries += 1;
        let res = create(http, svc, key).send().await.expect("the service answers");
        let status = res.status().as_u16();
        if status == 201 {
            return (res.json().await.expect("json"), tries);
        }
        assert!(res.headers().contains_key("retry-after"), "{status} without Retry-After");
        let text = res.text().await.unwrap_or_default();
        assert!(matches!(status, 503 | 409), "a retry answers 201, 503 or 409: {status} {text}");
        if tokio::time::Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!(
                "never created; last answer {status} {text}; service log:\n{}",
                &log[log.len().saturating_sub(3000)..]
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_service_killed_mid_call_and_restarted_makes_one_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("dns.db");
    let db = db.to_str().expect("utf-8 path");
    let _dns = start_example("fake_dns", &["--create-delay-ms", "1500"], &dir.path().join("dns.log"));
    let dns = _dns.url.clone();
    let svc_args = [
        "--db",
        db,
        "--dns-url",
        &dns,
        "--call-timeout",
        "3s",
        "--settle",
        "4s",
        "--in-flight-ttl",
        "1s",
        "--sweep-interval",
        "1s",
    ];
    let mut svc = start_example("dns_records", &svc_args, &dir.path().join("svc-1.log"));
    let http = reqwest::Client::new();

    let first = tokio::spawn(create(&http, &svc.url, "rec-1").send());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stats(&http, &dns).await["creates_received"] != 1 {
        assert!(tokio::time::Instant::now() < deadline, "the create never reached the provider");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    svc.sigkill(); // mid-call: the provider has the create, the service never hears back
    assert!(first.await.expect("task").is_err(), "the first call died with the service");
    assert_eq!(stats(&http, &dns).await["creates"], 0, "killed before the create landed");

    let svc = start_example("dns_records", &svc_args, &dir.path().join("svc-2.log"));
    let (body, tries) = retry_until_created(&http, &svc.url, "rec-1", &dir.path().join("svc-2.log")).await;
    let s = stats(&http, &dns).await;
    assert_eq!((s["creates_received"].as_u64(), s["records"].as_u64()), (Some(1), Some(1)), "{s}");
    let listed: Value = http.get(format!("{dns}/records?tag_prefix=sk-")).send().await.unwrap().json().await.unwrap();
    assert_eq!(listed[0]["id"], body["id"], "the answer names the one record: {listed}");
    eprintln!("created after {tries} tries: {body}");

    // A replay answers the same; a new key makes a second record (the count can move).
    let again = create(&http, &svc.url, "rec-1").send().await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.json::<Value>().await.unwrap(), body);
    let (other, tries) = retry_until_created(&http, &svc.url, "rec-2", &dir.path().join("svc-2.log")).await;
    assert_eq!(tries, 1, "a healthy call answers 201 at once (its answer is read for what the contract promises only)");
    assert_ne!(other["id"], body["id"]);
    assert_eq!(stats(&http, &dns).await["records"], 2);

    // The inventory sweep leaves both alone: finished operations own them. Two more ticks of
    // the restarted service (its log) pass first.
    let log = dir.path().join("svc-2.log");
    let ticks = || std::fs::read_to_string(&log).unwrap_or_default().matches("background tick").count();
    let (seen, deadline) = (ticks(), tokio::time::Instant::now() + Duration::from_secs(30));
    while ticks() < seen + 2 {
        assert!(tokio::time::Instant::now() < deadline, "the background tick never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stats(&http, &dns).await["deletes"], 0);
    assert_eq!(stats(&http, &dns).await["records"], 2);

    // Bad input: a problem, nothing sent, and no row for the reaper (refused before any effect).
    let bad = http
        .post(format!("{}/v1/records", svc.url))
        .header("Idempotency-Key", "\"rec-3\"")
        .header("X-User", "team-a")
        .header("content-type", "application/json")
        .body("{\"name\":")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.headers()["content-type"], "application/problem+json");
    assert_eq!(stats(&http, &dns).await["creates_received"], 2);
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{db}")).await.expect("open the service's database");
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT mark, COUNT(*) FROM fx_operations GROUP BY mark").fetch_all(&pool).await.unwrap();
    assert_eq!(rows, vec![(3, 2)], "two finished operations, and no row for the refused request");
}

/// Issue 24 hole 2 on the example: a create whose call times out (the provider holds it), never
/// retried. The reaper rolls the operation back (nothing found once the settle window passed);
/// then the provider's record lands, carrying a tag nobody owns, and the inventory sweep deletes
/// it: at the end nothing runs that nobody owns. The landing is placed after the rollback
/// exactly (the provider holds creates until told), not by timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_landing_after_its_rollback_is_removed_by_the_inventory_sweep() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("dns.db");
    let _dns = start_example("fake_dns", &["--hold-creates"], &dir.path().join("dns.log"));
    let dns = _dns.url.clone();
    let log = dir.path().join("svc.log");
    let args = [
        "--db",
        db.to_str().expect("utf-8 path"),
        "--dns-url",
        &dns,
        "--call-timeout",
        "1s",
        "--settle",
        "2s",
        "--in-flight-ttl",
        "1s",
        "--abandon-after",
        "1s",
        "--sweep-interval",
        "1s",
    ];
    let svc = start_example("dns_records", &args, &log);
    let http = reqwest::Client::new();
    let first = create(&http, &svc.url, "rec-1").send().await.expect("answers");
    assert_eq!(first.status(), 503, "the call timed out: it may still land");

    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    // The tick's summary is logged after the rollback's own line, which is then complete.
    while !read_log().contains("rolled_back: 1") {
        assert!(tokio::time::Instant::now() < deadline, "never rolled back:\n{}", read_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log_now = read_log();
    let rollback = log_now.lines().find(|l| l.contains("reaper: rolled back an abandoned operation")).expect("logged");
    assert!(rollback.ends_with("undone=0"), "nothing had landed when it rolled back: {rollback}");
    assert_eq!(stats(&http, &dns).await["creates"], 0);
    // The held create lands now, after its operation was rolled back.
    let landed = http.post(format!("{dns}/admin/land")).send().await.expect("fake DNS answers");
    assert_eq!(landed.status(), 204);
    loop {
        let s = stats(&http, &dns).await;
        if s["creates"] == 1 && s["records"] == 0 {
            assert_eq!(s["deletes"], 1, "{s}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the late landing was never removed: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        read_log().contains("inventory sweep: undid a resource that no operation owns"),
        "the sweep removed it:\n{}",
        read_log()
    );
}
