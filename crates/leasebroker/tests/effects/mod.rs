//! Issue 11: one boot, one reboot, nothing held, when the hypervisor is slow, refuses, or the
//! client walks away. Each test runs the real binary against an independent hypervisor (the
//! standalone simulator, or a fake one served from the test) and counts side effects from ground
//! truth: the simulator's stats and the fleet endpoint.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{
    BIN, Reply, TOKEN, assert_one_worker_node_and_lease, create, create_until_done, fleet, http, send, serve,
    set_faults, sim, sim_stats, sqlite_url, worker_body,
};

/// Polls `check` every 200 ms until it returns true or `within` has passed; returns the last answer.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The value of a counter on `/metrics` (0 when absent).
async fn metric(base: &str, name: &str) -> f64 {
    let text = http().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// (workers, allocated nodes, leases, running VMs) as the fleet endpoint counts them.
async fn held(base: &str) -> (i64, i64, i64, i64) {
    let f = fleet(base).await;
    let n = |k: &str| f[k].as_i64().unwrap_or(-1);
    (n("workers_active"), n("nodes_allocated"), n("leases_active"), n("vms_running"))
}

async fn reboot(base: &str, id: &str, key: &str) -> Reply {
    send(reqwest::Method::POST, &format!("{base}/v1/workers/{id}/reboot"), TOKEN, Some(key), None).await
}

/// Item 1: the first boot times out after 1 s but lands after 2.5 s. The retries that come
/// before it lands find nothing by tag and must wait (503 + Retry-After), not boot again.
#[tokio::test]
async fn a_hypervisor_slower_than_the_timeout_boots_once_per_tag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&["--latency-ms", "2500"]);
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "1s"]);
    let first = create(&lb.url, TOKEN, "slow-1", &worker_body()).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    let early = create(&lb.url, TOKEN, "slow-1", &worker_body()).await;
    if sim_stats(&hv.url).await["boots_total"] == 0 {
        // Not landed yet: the retry waits instead of booting.
        assert_eq!(early.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&early.body));
        assert!(early.headers.contains_key("retry-after"), "{:?}", early.headers);
    }
    let done = create_until_done(&lb.url, "slow-1", &worker_body(), Duration::from_secs(60)).await;
    assert_eq!(done.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&done.body));
    // Anything still on its way has landed 2.5 s after it was sent.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let stats = sim_stats(&hv.url).await;
    assert_eq!(
        (stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64(), stats["running"].as_i64()),
        (Some(1), Some(0), Some(1)),
        "{stats}"
    );
    assert_one_worker_node_and_lease(&lb.url).await;
}

/// Item 1, reboot: one reboot per key even when the reboot lands after the caller's timeout.
#[tokio::test]
async fn a_slow_reboot_happens_once_per_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&[]);
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "1s"]);
    let created = create(&lb.url, TOKEN, "rb-create", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let id = created.json()["id"].as_str().expect("id").to_owned();
    set_faults(&hv.url, 0.0, 0.0, 2500).await;
    let first = reboot(&lb.url, &id, "rb-1").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    let deadline = Instant::now() + Duration::from_secs(60);
    let last = loop {
        let r = reboot(&lb.url, &id, "rb-1").await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(last.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&last.body));
    assert_eq!(last.json()["reboot_count"], 1);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let stats = sim_stats(&hv.url).await;
    assert_eq!(
        (stats["reboots_total"].as_i64(), stats["duplicate_reboot_tags"].as_i64()),
        (Some(1), Some(0)),
        "{stats}"
    );
    assert_eq!(fleet(&lb.url).await["reboots_total"], 1);
}

/// Item 1: a settle window shorter than the call timeout is refused at start.
#[tokio::test]
async fn a_settle_window_shorter_than_the_timeout_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &db])
        .args(["--hypervisor-timeout", "2s", "--hypervisor-settle", "1s"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(stderr.contains("--hypervisor-settle") && stderr.contains("at least --hypervisor-timeout"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}

/// Item 1, the safety net: with a settle window set too short (equal to the timeout, shorter
/// than the hypervisor takes), a retry boots a second time and the first boot lands later. The
/// VM that was adopted stays; the other is deleted and counted.
#[tokio::test]
async fn a_late_landing_past_a_short_settle_window_is_destroyed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&["--latency-ms", "2500"]);
    let lb = serve(
        &sqlite_url(&dir),
        &[
            "--hypervisor-url",
            &hv.url,
            "--hypervisor-timeout",
            "1s",
            "--hypervisor-settle",
            "1s",
            "--sweep-interval",
            "1s",
        ],
    );
    let done = create_until_done(&lb.url, "late-1", &worker_body(), Duration::from_secs(60)).await;
    assert_eq!(done.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&done.body));
    let vm_id = done.json()["vm_id"].as_str().expect("vm_id").to_owned();
    let landed = eventually(Duration::from_secs(30), || async {
        let s = sim_stats(&hv.url).await;
        s["boots_total"].as_i64() >= Some(2) && s["running"] == 1
    })
    .await;
    let stats = sim_stats(&hv.url).await;
    assert!(landed, "a second boot landed and was destroyed: {stats}");
    let vms: Value = http().get(format!("{}/v1/vms", hv.url)).send().await.expect("vms").json().await.expect("json");
    assert_eq!(vms["vms"][0]["vm_id"], vm_id.as_str(), "the adopted VM is the one kept: {vms}");
    assert!(metric(&lb.url, "leasebroker_duplicate_vms_destroyed_total").await >= 1.0);
    assert_one_worker_node_and_lease(&lb.url).await;
}

/// A hypervisor that refuses every boot with a 422 and lists no VMs; counts the boots it refused.
async fn refusing_hypervisor() -> (String, Arc<AtomicUsize>) {
    use axum::routing::get;
    let refused = Arc::new(AtomicUsize::new(0));
    let counter = refused.clone();
    let app = axum::Router::new().route(
        "/v1/vms",
        get(|| async { axum::Json(json!({"vms": []})) }).post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                (
                    axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                    "hv-canary-body: image not allowed on this cluster (http://10.9.8.7/internal)",
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, refused)
}

/// Item 2: a definite refusal (4xx) gives back the node and lease before answering. It is
/// answered as an unstored 502, so the retry runs again (and is refused again): nothing is held
/// between or after.
#[tokio::test]
async fn a_refused_boot_holds_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (hv, refused) = refusing_hypervisor().await;
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv]);
    let r = create(&lb.url, TOKEN, "refused-1", &worker_body()).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem_type(), "upstream-unavailable");
    assert_eq!(held(&lb.url).await, (0, 0, 0, 0), "nothing stays held after a refusal");
    let text = String::from_utf8_lossy(&r.body);
    assert!(!text.contains("hv-canary") && !text.contains("10.9.8.7") && !text.contains(&hv), "{text}");
    let again = create(&lb.url, TOKEN, "refused-1", &worker_body()).await;
    assert_eq!(again.status, StatusCode::BAD_GATEWAY);
    assert!(!again.replayed(), "a refusal is not stored: the retry runs again");
    assert_eq!(refused.load(Ordering::SeqCst), 2);
    assert_eq!(held(&lb.url).await, (0, 0, 0, 0));
}

/// Item 3: the reaper never rolls back a create that finished, however short --abandon-after.
#[tokio::test]
async fn the_reaper_never_touches_a_finished_create() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(
        &sqlite_url(&dir),
        &["--hypervisor-settle", "10s", "--abandon-after", "1s", "--sweep-interval", "1s", "--in-flight-ttl", "1s"],
    );
    let done = create(&lb.url, TOKEN, "kept", &worker_body()).await;
    assert_eq!(done.status, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(held(&lb.url).await, (1, 1, 1, 1));
    let again = create(&lb.url, TOKEN, "kept", &worker_body()).await;
    assert!(again.replayed());
    assert_eq!(again.body, done.body);
}
