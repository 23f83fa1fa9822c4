//! Issue 11: one boot, one reboot, nothing held, when the hypervisor is slow, refuses, or the
//! client walks away. Each test runs the real binary against an independent hypervisor (the
//! standalone simulator, or a fake one served from the test) and counts side effects from ground
//! truth: the simulator's stats and the fleet endpoint.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idempotency::Store;
use idempotency::conformance::{FaultyStore, Op};
use leasebroker::app::Application;
use leasebroker::config::{Cli, Command};
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::{
    ADMIN, BIN, Reply, TOKEN, assert_one_worker_node_and_lease, create, create_until_done, fleet, http, send, serve,
    set_faults, sim, sim_stats, sqlite_url, worker_body,
};

/// Polls `check` every 200 ms until it returns true or `within` has passed; returns the last answer.
pub(crate) async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
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

/// The sum of a counter's series on `/metrics` (0 when absent); `name` may end in a label
/// (`name{label="value"`).
pub(crate) async fn metric(base: &str, name: &str) -> f64 {
    let text = http().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && (name.ends_with('"') || l[name.len()..].starts_with([' ', '{'])))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// (workers, allocated nodes, leases, running VMs) as the fleet endpoint counts them.
pub(crate) async fn held(base: &str) -> (i64, i64, i64, i64) {
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

/// A reboot that races a delete of its worker: the delete removes the VM first, so the reboot
/// finds the worker row but the hypervisor answers 404 for its VM. That is the worker going
/// away, not a hypervisor failure: 404 `not-found`, never a 5xx (found by schemathesis with two
/// workers).
#[tokio::test]
async fn a_reboot_whose_vm_is_gone_answers_404() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&[]);
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv.url]);
    let created = create(&lb.url, TOKEN, "gone-create", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let id = created.json()["id"].as_str().expect("id").to_owned();
    let vm_id = created.json()["vm_id"].as_str().expect("vm_id").to_owned();
    // What a concurrent delete does first.
    let gone = http().delete(format!("{}/v1/vms/{vm_id}", hv.url)).send().await.expect("delete the VM");
    assert_eq!(gone.status(), StatusCode::NO_CONTENT);

    let r = reboot(&lb.url, &id, "gone-rb").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem_type(), "not-found");
    assert_eq!(sim_stats(&hv.url).await["reboots_total"], 0);
}

/// Item 1, and issue 45: a settle window no longer than the call timeout is refused at start
/// (docs/protocol.md#side-effects: it is longer than the call timeout), equal included: one line naming both, exit 2
/// as a usage error.
#[tokio::test]
async fn a_settle_window_not_longer_than_the_timeout_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    for settle in ["1s", "2s"] {
        let out = std::process::Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--database", &db])
            .args(["--hypervisor-timeout", "2s", "--hypervisor-settle", settle])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "settle {settle}: {stderr}");
        assert!(
            stderr.contains("--hypervisor-settle") && stderr.contains("longer than --hypervisor-timeout"),
            "{stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
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
            "900ms",
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
    // Counted once the delete is known done: at once, or (its answer lost to the slow
    // hypervisor) when the next sweep's listing shows the VM gone.
    let counted = eventually(Duration::from_secs(10), || async {
        metric(&lb.url, "leasebroker_duplicate_vms_destroyed_total").await >= 1.0
    })
    .await;
    assert!(counted, "the duplicate was deleted but never counted");
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

/// A server on SQLite in `dir` against the simulator `hv`, whose reaper acts soon: settle 1 s,
/// abandoned after 2 s, looked at every second.
fn reaping_server(dir: &tempfile::TempDir, hv: &crate::support::Proc) -> crate::support::Proc {
    let args = [
        "--hypervisor-url",
        hv.url.as_str(),
        "--hypervisor-timeout",
        "900ms",
        "--hypervisor-settle",
        "1s",
        "--abandon-after",
        "2s",
        "--sweep-interval",
        "1s",
    ];
    serve(&sqlite_url(dir), &args)
}

/// Item 3: a create whose client gives up after a 5xx (the boot happened, its answer was lost)
/// is rolled back by the reaper once nobody retried it for --abandon-after: VM deleted, lease and
/// node freed, record removed. The same key afterwards runs as a new operation (new sub-keys: a
/// new boot tag, not the old one booted again).
#[tokio::test]
async fn an_abandoned_create_is_rolled_back_and_its_key_runs_afresh() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&[]);
    let lb = reaping_server(&dir, &hv);
    set_faults(&hv.url, 0.0, 1.0, 0).await;
    let first = create(&lb.url, TOKEN, "walk-away", &worker_body()).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    set_faults(&hv.url, 0.0, 0.0, 0).await;
    assert_eq!(held(&lb.url).await, (0, 1, 1, 1), "the attempt holds a node, a lease and a VM");
    let rolled_back = eventually(Duration::from_secs(30), || async { held(&lb.url).await == (0, 0, 0, 0) }).await;
    assert!(rolled_back, "still held: {:?}", held(&lb.url).await);
    assert!(metric(&lb.url, "leasebroker_reaper_rolled_back_total").await >= 4.0, "operation, vm, lease, node");

    let retry = create(&lb.url, TOKEN, "walk-away", &worker_body()).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retry.body));
    assert!(!retry.replayed());
    let stats = sim_stats(&hv.url).await;
    assert_eq!(
        (stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64(), stats["running"].as_i64()),
        (Some(2), Some(0), Some(1)),
        "a new operation boots under a new tag: {stats}"
    );
    assert_one_worker_node_and_lease(&lb.url).await;
}

/// The reaper's patience covers the `Retry-After` the service gave. A boot outlives its call
/// (timeout 300 ms, the simulator makes it take 800 ms), an immediate retry finds no VM yet and is
/// told to wait out the rest of the settle window (1.5 s from the send stamp, which lies 1 s ahead
/// of the clock: about 2.2 s, rounded up to `Retry-After: 3`), the boot lands. The abandon window
/// (1 s) is shorter than the settle window. A client that retries exactly when told
/// must find its create still there (the landed VM adopted: one boot), not rolled back behind its
/// back (the VM deleted) and booted again as a new operation: the mechanism of faultline's smoke
/// run that booted 81 VMs for 80 creates.
#[tokio::test]
async fn the_reaper_waits_out_the_retry_after_the_service_gave() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&[]);
    let args = [
        "--hypervisor-url",
        hv.url.as_str(),
        "--hypervisor-timeout",
        "300ms",
        "--hypervisor-settle",
        "1500ms",
        "--abandon-after",
        "1s",
        "--in-flight-ttl",
        "1s",
        "--sweep-interval",
        "200ms",
    ];
    let lb = serve(&sqlite_url(&dir), &args);
    let slow = |slow: f64| {
        let faults = json!({"fail_before": 0.0, "fail_after": 0.0, "latency_ms": 0, "slow": slow, "slow_ms": 800});
        let url = format!("{}/v1/faults", hv.url);
        async move { assert!(http().put(url).json(&faults).send().await.expect("faults").status().is_success()) }
    };
    // The boot outlives its call: 503, the intent stays pending, the VM lands after 800 ms.
    slow(1.0).await;
    let first = create(&lb.url, TOKEN, "patient", &worker_body()).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    slow(0.0).await;
    // An immediate retry finds no VM yet: it is told to wait out the rest of the settle window.
    let waiting = create(&lb.url, TOKEN, "patient", &worker_body()).await;
    assert_eq!(waiting.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&waiting.body));
    let retry_after: u64 = waiting.headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!(retry_after >= 2, "Retry-After: {retry_after}");
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let done = create(&lb.url, TOKEN, "patient", &worker_body()).await;
    assert_eq!(done.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&done.body));
    let stats = sim_stats(&hv.url).await;
    assert_eq!(
        (stats["boots_total"].as_i64(), stats["running"].as_i64()),
        (Some(1), Some(1)),
        "the retry adopted the VM that landed (not rolled back and booted again): {stats}"
    );
    assert_eq!(metric(&lb.url, "leasebroker_reaper_rolled_back_total{resource=\"operation\"").await, 0.0);
    assert_one_worker_node_and_lease(&lb.url).await;
}

/// Item 3: the reaper never rolls back a create that finished, however short --abandon-after,
/// and once operations finished their intents are gone and their rows are compact marks
/// (pruned after the retention, issue 24): no domain table grows with every request beyond it.
#[tokio::test]
async fn the_reaper_never_touches_a_finished_create_and_cleans_up_after_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let lb = serve(
        &db,
        &[
            "--hypervisor-timeout",
            "900ms",
            "--hypervisor-settle",
            "1s",
            "--abandon-after",
            "1s",
            "--sweep-interval",
            "1s",
        ],
    );
    let done = create(&lb.url, TOKEN, "kept", &worker_body()).await;
    assert_eq!(done.status, StatusCode::CREATED);
    let id = done.json()["id"].as_str().expect("id").to_owned();
    for key in ["rb-a", "rb-b"] {
        assert_eq!(reboot(&lb.url, &id, key).await.status, StatusCode::ACCEPTED);
    }
    let rows = || async {
        let pool = sqlx::SqlitePool::connect(&db).await.expect("open");
        let counts: (i64, i64) = sqlx::query_as(
            "SELECT (SELECT COUNT(*) FROM fx_operations WHERE mark <> 3), (SELECT COUNT(*) FROM fx_intents)",
        )
        .fetch_one(&pool)
        .await
        .expect("count");
        pool.close().await;
        counts
    };
    assert!(eventually(Duration::from_secs(30), || async { rows().await == (0, 0) }).await, "{:?}", rows().await);
    assert_eq!(held(&lb.url).await, (1, 1, 1, 1));
    let f = fleet(&lb.url).await;
    assert_eq!((f["vm_boots_total"].as_i64(), f["reboots_total"].as_i64()), (Some(1), Some(2)), "{f}");
    let again = create(&lb.url, TOKEN, "kept", &worker_body()).await;
    assert!(again.replayed());
    assert_eq!(again.body, done.body);
}

/// A server built in process from the real router, on a store that fails on demand, with the
/// in-process simulator; a short in-flight TTL so a retry after a failed completion comes soon.
struct InProcess {
    url: String,
    faults: Arc<FaultyStore<Arc<dyn Store>>>,
    _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn in_process() -> InProcess {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let token = format!("{TOKEN}=alice");
    let cli = Cli::parse_from([
        "leasebroker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database",
        &db,
        "--token",
        &token,
        "--admin-token",
        ADMIN,
        "--pool-nodes",
        "16",
        "--in-flight-ttl",
        "1s",
    ]);
    let Command::Serve(args) = cli.command else { panic!("serve") };
    let mut slot = None;
    let app = Application::build_with_store(*args, |store| {
        let faulty = Arc::new(FaultyStore::new(store));
        slot = Some(faulty.clone());
        faulty
    })
    .await
    .expect("build");
    let url = format!("http://{}", app.local_addr());
    let server = tokio::spawn(app.run_until_stopped(std::future::pending()));
    InProcess { url, faults: slot.expect("wrapped"), _dir: dir, server }
}

/// Sends `send` again while the record is in flight (409 request-in-progress), up to 30 s.
async fn past_in_progress<F, Fut>(mut send: F) -> Reply
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Reply>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = send().await;
        let busy = r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress";
        if !busy || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Item 4: the delete committed, but its record never completed (the store failed at
/// completion). The retry finds no worker but its own tombstone: 204, never 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_delete_whose_completion_failed_answers_204() {
    let lb = in_process().await;
    let created = create(&lb.url, TOKEN, "c-4", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let url = format!("{}/v1/workers/{}", lb.url, created.json()["id"].as_str().expect("id"));

    lb.faults.fail_always(Op::Complete);
    let first = send(reqwest::Method::DELETE, &url, TOKEN, Some("d-4"), None).await;
    assert_eq!(first.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&first.body));
    fail_every_completion_retry(&lb).await;

    let retry = past_in_progress(|| send(reqwest::Method::DELETE, &url, TOKEN, Some("d-4"), None)).await;
    assert_eq!(retry.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&retry.body));
    assert!(!retry.replayed(), "the retry ran the handler again and found its tombstone");
    let again = send(reqwest::Method::DELETE, &url, TOKEN, Some("d-4"), None).await;
    assert!(again.replayed() && again.status == StatusCode::NO_CONTENT);
    let other = send(reqwest::Method::DELETE, &url, TOKEN, Some("d-4b"), None).await;
    assert_eq!(other.status, StatusCode::NOT_FOUND, "another delete's tombstone is not this one's");
    assert_eq!(held(&lb.url).await, (0, 0, 0, 0));
}

/// The layer retries a failed completion in the background (once, then
/// `DEFAULT_COMPLETION_RETRIES` more times): waits until every one of them has failed, then lets
/// the store work again. The record stays in flight, as after a store outage that outlasted the
/// retries.
async fn fail_every_completion_retry(lb: &InProcess) {
    let all = 1 + idempotency_tower::DEFAULT_COMPLETION_RETRIES as u64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while lb.faults.injected(Op::Complete) < all {
        assert!(tokio::time::Instant::now() < deadline, "the completion retries did not run");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lb.faults.heal(Op::Complete);
}

/// Item 5: the create's record never completed (the store failed at completion), then the
/// worker was deleted. The retry of the create must not bring it back: it answers 410
/// worker-deleted (stored) and takes no node, lease or VM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_after_its_worker_was_deleted_is_gone() {
    let lb = in_process().await;
    lb.faults.fail_always(Op::Complete);
    let created = create(&lb.url, TOKEN, "c-5", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    fail_every_completion_retry(&lb).await;
    let id = created.json()["id"].as_str().expect("id").to_owned();
    let deleted = send(reqwest::Method::DELETE, &format!("{}/v1/workers/{id}", lb.url), TOKEN, Some("d-5"), None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    let boots = fleet(&lb.url).await["vm_boots_total"].clone();

    let body = worker_body();
    let retry = past_in_progress(|| create(&lb.url, TOKEN, "c-5", &body)).await;
    assert_eq!(retry.status, StatusCode::GONE, "{}", String::from_utf8_lossy(&retry.body));
    assert_eq!(retry.problem_type(), "worker-deleted");
    assert_eq!(held(&lb.url).await, (0, 0, 0, 0), "no node, lease, worker or VM came back");
    assert_eq!(fleet(&lb.url).await["vm_boots_total"], boots, "nothing booted");
    let again = create(&lb.url, TOKEN, "c-5", &worker_body()).await;
    assert!(again.replayed() && again.status == StatusCode::GONE, "the 410 is stored");
}

/// Item 3, raced: two replicas on one PostgreSQL database both run the reaper while clients
/// come back to their abandoned creates, some before the reaper, some while it works, some
/// after. Whoever takes the record's claim first wins; the other never acts on the same
/// operation: each key ends with one worker on one node, one lease and one running VM, and no
/// tag is booted twice.
#[tokio::test]
async fn the_reaper_and_late_retries_on_two_replicas_never_both_act() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv = sim(&[]);
    let args = [
        "--hypervisor-url",
        hv.url.as_str(),
        "--hypervisor-timeout",
        "900ms",
        "--hypervisor-settle",
        "1s",
        "--abandon-after",
        "1s",
        "--in-flight-ttl",
        "1s",
        "--sweep-interval",
        "300ms",
    ];
    let a = serve(pg.url(), &args);
    let b = serve(pg.url(), &args);
    const KEYS: usize = 12;
    set_faults(&hv.url, 0.0, 1.0, 0).await;
    for i in 0..KEYS {
        let r = create(&a.url, TOKEN, &format!("race-{i}"), &worker_body()).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&r.body));
    }
    set_faults(&hv.url, 0.0, 0.0, 0).await;
    let mut tasks = Vec::new();
    for i in 0..KEYS {
        for (j, base) in [&a.url, &b.url].into_iter().enumerate() {
            let base = base.clone();
            tasks.push(tokio::spawn(async move {
                // Spread the retries over the reaper's window: 0 to ~3 s after the abandon.
                tokio::time::sleep(Duration::from_millis((i * 250 + j * 120) as u64)).await;
                let r = create_until_done(&base, &format!("race-{i}"), &worker_body(), Duration::from_secs(60)).await;
                (i, r)
            }));
        }
    }
    let mut ids: Vec<std::collections::HashSet<String>> = vec![Default::default(); KEYS];
    for t in tasks {
        let (i, r) = t.await.expect("task");
        assert_eq!(r.status, StatusCode::CREATED, "race-{i}: {}", String::from_utf8_lossy(&r.body));
        ids[i].insert(r.json()["id"].as_str().expect("id").to_owned());
    }
    for (i, set) in ids.iter().enumerate() {
        assert_eq!(set.len(), 1, "race-{i} made workers {set:?}");
    }
    // A few more reaper ticks: nothing a finished worker holds may be rolled back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let n = KEYS as i64;
    assert_eq!(held(&a.url).await, (n, n, n, n), "one worker, node, lease and VM per key");
    let stats = sim_stats(&hv.url).await;
    assert_eq!(stats["duplicate_boot_tags"], 0, "{stats}");
    let rolled_back = metric(&a.url, "leasebroker_reaper_rolled_back_total{resource=\"operation\"").await
        + metric(&b.url, "leasebroker_reaper_rolled_back_total{resource=\"operation\"").await;
    eprintln!("abandoned creates rolled back: {rolled_back} of {KEYS} (the rest resumed by a retry); {stats}");
    // Each key booted once before it was abandoned; a key rolled back booted once more, under its
    // new operation's tag; a key resumed by a retry adopted its VM.
    assert_eq!(stats["boots_total"].as_f64(), Some(KEYS as f64 + rolled_back), "{stats}");
}

/// Item 3, deletes: a delete whose VM was deleted but whose answer was lost, and whose client
/// never came back, would leave a worker without a VM holding its node and lease. A delete cannot
/// be rolled back, so the reaper finishes it, and a late retry with the key replays 204.
#[tokio::test]
async fn an_abandoned_delete_is_finished() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&[]);
    let lb = reaping_server(&dir, &hv);
    let created = create(&lb.url, TOKEN, "c-del", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let url = format!("{}/v1/workers/{}", lb.url, created.json()["id"].as_str().expect("id"));
    set_faults(&hv.url, 0.0, 1.0, 0).await;
    let first = send(reqwest::Method::DELETE, &url, TOKEN, Some("d-walk-away"), None).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    set_faults(&hv.url, 0.0, 0.0, 0).await;
    assert_eq!(held(&lb.url).await, (1, 1, 1, 0), "the VM is gone, the worker, node and lease are not");
    let finished = eventually(Duration::from_secs(30), || async { held(&lb.url).await == (0, 0, 0, 0) }).await;
    assert!(finished, "still held: {:?}", held(&lb.url).await);
    let retry = send(reqwest::Method::DELETE, &url, TOKEN, Some("d-walk-away"), None).await;
    assert_eq!(retry.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&retry.body));
    assert!(retry.replayed(), "the reaper stored the delete's 204");
}

/// Two or more attempts of one operation that each believe they hold its claim: what a stale
/// reclaim gives while the first holder still runs (its heartbeats could not reach a database
/// that was restarting, so its claim went stale and a retry on another replica took it). The
/// claim cannot keep them apart then; the intent must. Each attempt takes the intent's send
/// stamp by compare-and-set on the stamp it decided from, so exactly one of them calls.
mod racing_attempts {
    use std::time::Duration;

    use idempotency::{ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, Scope};
    use leasebroker::db::Db;
    use leasebroker::domain::Domain;
    use leasebroker::hypervisor::{BootRequest, HypervisorClient, SimConfig, Simulator};
    use leasebroker::service::{CreateWorker, Hook, Limits, RequestRecord, Step, Workers};

    const ATTEMPTS: usize = 16;
    /// The principal every racing attempt acts for.
    static ALICE: std::sync::LazyLock<Principal> = std::sync::LazyLock::new(|| Principal::new("alice"));

    struct Rig {
        workers: Workers,
        sim: Simulator,
        db: Db,
        _dir: tempfile::TempDir,
    }

    /// A service on its own SQLite file and in-process simulator, with a 1 s settle window: longer
    /// than the slow hypervisor takes (300 ms) with room for a loaded machine, so that an attempt
    /// that reads the intent after the winner's send finds its VM instead of a window passed.
    async fn rig() -> Rig {
        rig_with(Hook::default()).await
    }

    /// [`rig`] with `hook` run at the handlers' named steps.
    async fn rig_with(hook: Hook) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = crate::support::sqlite_url(&dir);
        rig_on(&url, dir, hook).await
    }

    /// [`rig_with`] on the database at `url` (`dir` is kept for as long as the rig).
    async fn rig_on(url: &str, dir: tempfile::TempDir, hook: Hook) -> Rig {
        let db = Db::connect(url).await.expect("db");
        db.migrate().await.expect("migrate");
        let domain = Domain::new(db.clone());
        domain.seed_nodes(16, 64, 256).await.expect("nodes");
        let sim = Simulator::new(SimConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(leasebroker::hypervisor::serve(listener, sim.clone(), std::future::pending()));
        let workers = Workers {
            domain,
            hypervisor: HypervisorClient::new(&url, Duration::from_secs(10)).expect("client"),
            settle: Duration::from_secs(1),
            limits: Limits { node_cpu: 64, node_memory_gb: 256 },
            quota: 0,
            hook,
        };
        Rig { workers, sim, db, _dir: dir }
    }

    fn operation(method: &str, path: &str) -> RequestRecord {
        let now = idempotency::now();
        let scope = Scope::new(
            Principal::new("alice"),
            Endpoint::new(method, path),
            IdempotencyKey::try_from("racing-1").expect("key"),
        );
        RequestRecord::new(
            ClaimRequest {
                scope,
                fingerprint: Fingerprint::from_stored("sha256:"),
                now,
                in_flight_ttl: Duration::ZERO,
                expires_at: now,
            }
            .new_record(),
        )
    }

    /// A live claim, taken now in `store`, on `POST path` by `principal` with `key`, stale after
    /// `in_flight_ttl` without a heartbeat (it expires in an hour).
    async fn claimed(
        store: &std::sync::Arc<dyn idempotency::Store>,
        principal: &str,
        path: &str,
        key: &str,
        in_flight_ttl: Duration,
    ) -> idempotency::Claim {
        let now = idempotency::now();
        let scope = Scope::new(
            Principal::new(principal),
            Endpoint::new("POST", path),
            IdempotencyKey::try_from(key).expect("key"),
        );
        let request = ClaimRequest {
            scope,
            fingerprint: Fingerprint::from_stored("sha256:"),
            now,
            in_flight_ttl,
            expires_at: now + chrono::Duration::hours(1),
        };
        let outcome = store.claim(request).await.expect("claim");
        let idempotency::ClaimOutcome::Owned(claim) = outcome else { panic!("owned: {outcome:?}") };
        claim
    }

    /// An earlier attempt's call failed without certainty (the intent stays pending): its settle
    /// window passes (1 s from a send stamp up to 1 s ahead of the clock), then the hypervisor
    /// turns slow enough for the racing attempts to overlap.
    async fn first_call_failed_then_slow(sim: &Simulator) {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        sim.set_faults(SimConfig { latency: Duration::from_millis(300), ..SimConfig::default() });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_creates_boot_once() {
        let rig = rig().await;
        let op = operation("POST", "/v1/workers");
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        rig.sim.set_faults(SimConfig { fail_before: 1.0, ..SimConfig::default() });
        assert!(rig.workers.create(&ALICE, &req, &op).await.is_err(), "the first call fails");
        first_call_failed_then_slow(&rig.sim).await;
        let results = futures::future::join_all((0..ATTEMPTS).map(|_| rig.workers.create(&ALICE, &req, &op))).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(rig.sim.stats().boots_total, 1, "one boot for {ATTEMPTS} racing attempts ({ok} answered)");
        assert!(ok >= 1, "one attempt finished: {results:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_reboots_reboot_once() {
        let rig = rig().await;
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        let worker = rig.workers.create(&ALICE, &req, &operation("POST", "/v1/workers")).await.expect("create");
        let op = operation("POST", &format!("/v1/workers/{}/reboot", worker.worker_id));
        rig.sim.set_faults(SimConfig { fail_before: 1.0, ..SimConfig::default() });
        assert!(rig.workers.reboot(&ALICE, &worker.worker_id, &op).await.is_err(), "the first call fails");
        first_call_failed_then_slow(&rig.sim).await;
        let results =
            futures::future::join_all((0..ATTEMPTS).map(|_| rig.workers.reboot(&ALICE, &worker.worker_id, &op))).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(rig.sim.stats().reboots_total, 1, "one reboot for {ATTEMPTS} racing attempts ({ok} answered)");
        assert!(ok >= 1, "one attempt finished: {results:?}");
    }

    /// The reaper rolled back an abandoned create while an attempt of it still ran (its claim
    /// went stale while it waited, as on a restarting database, so the reaper could take the
    /// record). That attempt then takes, calls and shows nothing: no node, lease, VM or worker
    /// comes back for an operation nobody will finish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempt_that_outlives_its_rollback_does_nothing() {
        use idempotency::{ClaimOutcome, Store};
        let rig = rig().await;
        let store = rig.db.idempotency_store();
        let now = idempotency::now();
        let scope = Scope::new(
            Principal::new("alice"),
            Endpoint::new("POST", "/v1/workers"),
            IdempotencyKey::try_from("outlived-1").expect("key"),
        );
        let claimed = store
            .claim(ClaimRequest {
                scope,
                fingerprint: Fingerprint::from_stored("sha256:"),
                now,
                in_flight_ttl: Duration::from_secs(1),
                expires_at: now + chrono::Duration::hours(1),
            })
            .await
            .expect("claim");
        let ClaimOutcome::Owned(claim) = claimed else { panic!("a new key is owned") };
        let op = RequestRecord::new(claim.record().clone());
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        // The first attempt's boot may or may not have happened; its client never comes back.
        rig.sim.set_faults(SimConfig { fail_before: 1.0, ..SimConfig::default() });
        assert!(rig.workers.create(&ALICE, &req, &op).await.is_err(), "the first call fails");
        store.fail(&claim).await.expect("fail");
        tokio::time::sleep(Duration::from_millis(2500)).await; // past the settle window
        let reaper = leasebroker::reaper::Reaper::new(
            store.clone(),
            rig.workers.domain.clone(),
            rig.workers.hypervisor.clone(),
            leasebroker::reaper::ReaperSettings {
                settle: rig.workers.settle,
                abandon_after: Duration::ZERO,
                retry_grace: Duration::ZERO,
                in_flight_ttl: Duration::from_secs(1),
                retention: Duration::from_secs(3600),
            },
        );
        let report = reaper.run_once().await;
        assert_eq!(report.rolled_back, 1, "{report:?}");
        // The attempt that still ran goes on, against a healthy hypervisor.
        rig.sim.set_faults(SimConfig::default());
        let late = rig.workers.create(&ALICE, &req, &op).await;
        assert!(late.is_err(), "a rolled-back operation does not finish: {late:?}");
        let counts = rig.workers.domain.counts().await.expect("counts");
        assert_eq!(
            (counts.workers_active, counts.nodes_allocated, counts.leases_active, rig.sim.stats().boots_total),
            (0, 0, 0, 0),
            "nothing held after the rollback: {counts:?}"
        );
        // The reaper's next tick finds nothing more to roll back.
        assert_eq!(reaper.run_once().await.rolled_back, 0);
    }

    /// The first attempt that reaches a step, held there until released.
    struct Held {
        reached: tokio::sync::oneshot::Receiver<()>,
        release: tokio::sync::oneshot::Sender<()>,
    }

    impl Held {
        /// Waits until the held attempt is at its step (it has read what it decides from).
        async fn reached(&mut self) {
            tokio::time::timeout(Duration::from_secs(60), &mut self.reached)
                .await
                .expect("the attempt reached its step")
                .expect("hook");
        }
    }

    /// A hook that holds the first attempt reaching `at` until [`Held::release`] is sent; every
    /// later attempt passes.
    fn hold_first(at: Step) -> (Hook, Held) {
        let (reached_tx, reached) = tokio::sync::oneshot::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
        let slot = std::sync::Arc::new(std::sync::Mutex::new(Some((reached_tx, release_rx))));
        let hook = Hook::new(move |step| {
            let slot = slot.clone();
            async move {
                if step != at {
                    return;
                }
                let taken = slot.lock().expect("lock").take();
                if let Some((reached, release)) = taken {
                    let _ = reached.send(());
                    let _ = release.await;
                }
            }
        });
        (hook, Held { reached, release })
    }

    /// Issue 24, hole 1: attempt A1 read that the worker does not exist and was not deleted, then
    /// stalled (a frozen VM, a database stall) past its claim. A retry A2 of the same record
    /// finished the create, and the client deleted the worker. A1 wakes: it boots no second VM,
    /// takes no node or lease, and does not bring the worker back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_create_waking_after_its_worker_was_deleted_does_nothing() {
        let (hook, held) = hold_first(Step::CreateDecide);
        stalled_create_case(rig_with(hook).await, held).await;
    }

    /// The same on PostgreSQL, where the fence is a row lock rather than the one write lock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_create_waking_after_its_worker_was_deleted_does_nothing_on_postgres() {
        let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
        let (hook, held) = hold_first(Step::CreateDecide);
        let dir = tempfile::tempdir().expect("tempdir");
        stalled_create_case(rig_on(pg.url(), dir, hook).await, held).await;
    }

    async fn stalled_create_case(rig: Rig, mut held: Held) {
        let op = operation("POST", "/v1/workers");
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        let a1 = {
            let (workers, op, req) = (rig.workers.clone(), op.clone(), req.clone());
            tokio::spawn(async move { workers.create(&ALICE, &req, &op).await })
        };
        held.reached().await;
        let w = rig.workers.create(&ALICE, &req, &op).await.expect("A2 creates the worker");
        let delete = operation("DELETE", &format!("/v1/workers/{}", w.worker_id));
        rig.workers.delete(&ALICE, &w.worker_id, &delete).await.expect("the client deletes it");
        assert_eq!((rig.sim.stats().boots_total, rig.sim.stats().running), (1, 0));

        held.release.send(()).expect("release A1");
        let late = a1.await.expect("A1");
        assert!(late.is_err(), "a stalled attempt does not finish the create again: {late:?}");
        let counts = rig.workers.domain.counts().await.expect("counts");
        let stats = rig.sim.stats();
        assert_eq!(
            (counts.workers_active, counts.nodes_allocated, counts.leases_active, stats.boots_total, stats.running),
            (0, 0, 0, 1, 0),
            "the stalled attempt brought something back: {counts:?} {stats:?}"
        );
    }

    /// Issue 24, hole 1, reboot: attempt A1 read the worker and stalled; a retry A2 rebooted it,
    /// the record completed, and the reaper cleaned up after the finished operation. A1 wakes and
    /// sends nothing: one reboot for the key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_reboot_waking_after_the_reboot_finished_sends_nothing() {
        use idempotency::{ClaimOutcome, Store, StoredBody, StoredResponse};
        let (hook, mut held) = hold_first(Step::RebootDecide);
        let rig = rig_with(hook).await;
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        let w = rig.workers.create(&ALICE, &req, &operation("POST", "/v1/workers")).await.expect("create");
        let store = rig.db.idempotency_store();
        let now = idempotency::now();
        let scope = Scope::new(
            Principal::new("alice"),
            Endpoint::new("POST", &format!("/v1/workers/{}/reboot", w.worker_id)),
            IdempotencyKey::try_from("stalled-reboot").expect("key"),
        );
        let request = ClaimRequest {
            scope,
            fingerprint: Fingerprint::from_stored("sha256:"),
            now,
            in_flight_ttl: Duration::from_secs(1),
            expires_at: now + chrono::Duration::hours(1),
        };
        let ClaimOutcome::Owned(claim) = store.claim(request).await.expect("claim") else { panic!("owned") };
        let op = RequestRecord::new(claim.record().clone());
        let a1 = {
            let (workers, op, id) = (rig.workers.clone(), op.clone(), w.worker_id.clone());
            tokio::spawn(async move { workers.reboot(&ALICE, &id, &op).await })
        };
        held.reached().await;
        assert_eq!(rig.workers.reboot(&ALICE, &w.worker_id, &op).await.expect("A2 reboots"), 1);
        let accepted =
            StoredResponse { status: 202, headers: Vec::new(), body: StoredBody::encode(Default::default(), 1024) };
        store.complete(&claim, &accepted, now + chrono::Duration::hours(1)).await.expect("complete");
        tokio::time::sleep(Duration::from_millis(1500)).await; // past the settle window: the reaper looks
        let reaper = leasebroker::reaper::Reaper::new(
            store.clone(),
            rig.workers.domain.clone(),
            rig.workers.hypervisor.clone(),
            leasebroker::reaper::ReaperSettings {
                settle: rig.workers.settle,
                abandon_after: Duration::ZERO,
                retry_grace: Duration::ZERO,
                in_flight_ttl: Duration::from_secs(1),
                retention: Duration::from_secs(3600),
            },
        );
        reaper.run_once().await;

        held.release.send(()).expect("release A1");
        let late = a1.await.expect("A1");
        assert_eq!(rig.sim.stats().reboots_total, 1, "A1 ({late:?}) rebooted a second time");
        let counts = rig.workers.domain.counts().await.expect("counts");
        assert_eq!(counts.reboots_done, 1, "{counts:?}");
    }

    /// Issue 24, hole 4, held exactly: the create has decided to boot and asks for the database,
    /// whose one connection another task holds for 1.5 s (longer than the send stamp's lead).
    /// The queue must not turn the create into a 503: the stamp is taken once it holds the
    /// connection, not before waiting for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_that_queued_for_the_database_still_boots() {
        let pool: std::sync::Arc<std::sync::OnceLock<sqlx::SqlitePool>> = Default::default();
        let slot = pool.clone();
        let hook = Hook::new(move |step| {
            let slot = slot.clone();
            async move {
                if step != Step::CreateDecide {
                    return;
                }
                let conn = slot.get().expect("pool").acquire().await.expect("acquire");
                // Someone else's work holds the database for longer than the stamp's lead.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    drop(conn);
                });
            }
        });
        let rig = rig_with(hook).await;
        let Db::Sqlite(sqlite) = &rig.db else { panic!("the rig runs on SQLite") };
        pool.set(sqlite.clone()).expect("set once");
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        let created = rig.workers.create(&ALICE, &req, &operation("POST", "/v1/workers")).await;
        assert!(created.is_ok(), "a create that waited for the database was refused: {created:?}");
        assert_eq!(rig.sim.stats().boots_total, 1);
    }

    /// Issue 24, hole 3: 100,000 operations the reaper must wait on (abandoned reboots, whose
    /// failed records live for days), older than everything else, inserted directly in the
    /// database. An abandoned create is still rolled back within two reaper passes once its
    /// settle window has passed: a row the reaper waits on never delays another.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoned_create_is_rolled_back_behind_100_000_waiting_rows() {
        use idempotency::Store;
        const WAITING: i64 = 100_000;
        let rig = rig().await;
        let Db::Sqlite(sqlite) = &rig.db else { panic!("the rig runs on SQLite") };
        let now_us = idempotency::now().timestamp_micros();
        let (old, expires) = (now_us - 3_600_000_000, now_us + 7 * 86_400_000_000);
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $1) \
             INSERT INTO idempotency_records (principal, endpoint, key, record_id, fingerprint, state, generation, \
             created_at, started_at, expires_at) \
             SELECT 'alice', 'POST /v1/workers/wkr-waiting/reboot', 'waiting-' || i, randomblob(16), 'sha256:', \
             'failed', 1, $2, $2, $3 FROM n",
        )
        .bind(WAITING)
        .bind(old)
        .bind(expires)
        .execute(sqlite)
        .await
        .expect("records");
        sqlx::query(
            "INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at, \
             next_check_at) \
             SELECT 'sk-' || key, 'reboot', principal, endpoint, key, lower(hex(record_id)), 0, $1, $1 \
             FROM idempotency_records WHERE key LIKE 'waiting-%'",
        )
        .bind(old)
        .execute(sqlite)
        .await
        .expect("operations");

        let store = rig.db.idempotency_store();
        let claim = claimed(&store, "alice", "/v1/workers", "victim-1", Duration::from_secs(1)).await;
        let op = RequestRecord::new(claim.record().clone());
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        rig.sim.set_faults(SimConfig { fail_before: 1.0, ..SimConfig::default() });
        assert!(rig.workers.create(&ALICE, &req, &op).await.is_err(), "the victim's boot fails");
        rig.sim.set_faults(SimConfig::default());
        store.fail(&claim).await.expect("fail");
        assert_eq!(rig.workers.domain.counts().await.expect("counts").nodes_allocated, 1);
        tokio::time::sleep(Duration::from_millis(2500)).await; // past the settle window
        let reaper = leasebroker::reaper::Reaper::new(
            store.clone(),
            rig.workers.domain.clone(),
            rig.workers.hypervisor.clone(),
            leasebroker::reaper::ReaperSettings {
                settle: rig.workers.settle,
                abandon_after: Duration::ZERO,
                retry_grace: Duration::ZERO,
                in_flight_ttl: Duration::from_secs(1),
                retention: Duration::from_secs(3600),
            },
        );
        let first = reaper.run_once().await;
        let second = reaper.run_once().await;
        assert_eq!(first.rolled_back + second.rolled_back, 1, "{first:?} {second:?}");
        let counts = rig.workers.domain.counts().await.expect("counts");
        assert_eq!((counts.nodes_allocated, counts.leases_active), (0, 0), "{counts:?}");
    }

    /// Issue 24, hole 6 (`adopt_boot`): attempt A1 found the boot intent pending (the first
    /// boot's answer was lost) and stalled before reconciling; A2 adopted the VM and finished;
    /// then a late landing put a second VM with the same tag and a lower id on the hypervisor.
    /// A1 wakes: it must not keep the second VM chosen from its stale read and delete the one
    /// the worker runs on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_adoption_never_deletes_the_vm_another_attempt_adopted() {
        let (hook, mut held) = hold_first(Step::CreateAdopt);
        let rig = rig_with(hook).await;
        let op = operation("POST", "/v1/workers");
        let req = CreateWorker { image: "img".into(), cpu: 2, memory_gb: 4, labels: None };
        rig.sim.set_faults(SimConfig { fail_after: 1.0, ..SimConfig::default() });
        assert!(rig.workers.create(&ALICE, &req, &op).await.is_err(), "the first boot's answer is lost");
        rig.sim.set_faults(SimConfig::default());
        let a1 = {
            let (workers, op, req) = (rig.workers.clone(), op.clone(), req.clone());
            tokio::spawn(async move { workers.create(&ALICE, &req, &op).await })
        };
        held.reached().await;
        let w = rig.workers.create(&ALICE, &req, &op).await.expect("A2 adopts the VM");
        let hv = &rig.workers.hypervisor;
        let boot =
            BootRequest { image: "img".into(), cpu: 2, memory_gb: 4, tag: op.derive("boot").as_str().to_owned() };
        loop {
            let late = hv.boot(&boot).await.expect("a late landing");
            if late.vm_id < w.vm_id {
                break;
            }
            hv.delete(&late.vm_id).await.expect("delete");
        }
        held.release.send(()).expect("release A1");
        let late = a1.await.expect("A1");
        assert!(hv.get(&w.vm_id).await.expect("get").is_some(), "A1 ({late:?}) deleted the VM the worker runs on");
    }

    /// A firmware service on the rig's database whose flashes go to a Redfish BMC like
    /// sushy-tools' (no task list, no payload, no inventory: a flash whose answer is unknown
    /// cannot be read), served in process, with `hook` at its named steps.
    async fn redfish_firmware(rig: &Rig, hook: Hook) -> (leasebroker::firmware::Firmware, Simulator) {
        use leasebroker::hypervisor::{RedfishBmc, RedfishOptions};
        let options = RedfishOptions {
            systems: 16,
            keep_payload: false,
            terse: true,
            list_tasks: false,
            inventory: false,
            ..RedfishOptions::default()
        };
        let sim =
            Simulator::new(SimConfig::default()).with_flash_time(Duration::from_millis(300)).with_redfish(options);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("redfish+http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(leasebroker::hypervisor::serve(listener, sim.clone(), std::future::pending()));
        // The call timeout (500 ms) is shorter than the rig's settle window (1 s).
        let bmc = RedfishBmc::new(&url, Duration::from_millis(500), None, "http://images.test/fw").expect("bmc");
        let firmware = leasebroker::firmware::Firmware {
            domain: rig.workers.domain.clone(),
            bmc: std::sync::Arc::new(bmc),
            settle: rig.workers.settle,
            hook,
        };
        (firmware, sim)
    }

    /// Waits (up to a minute) until the settle window has passed since the send stamp of the
    /// flash tagged `tag`: a call sent under that stamp can no longer land.
    async fn settled(domain: &Domain, tag: &str, settle: Duration) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let intent = domain.ledger().intent(tag).await.expect("read").expect("the flash's intent");
            let since = idempotency::now().timestamp_micros() - intent.sent_at;
            if since >= i64::try_from(settle.as_micros()).expect("micros") {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the settle window never passed: {intent:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a flash of `node` under `op` that `held` holds at [`Step::FlashSend`] (its intent
    /// recorded with its send stamp, its `SimpleUpdate` not sent), and returns once the settle
    /// window has passed since that stamp.
    async fn held_past_its_window(
        firmware: &leasebroker::firmware::Firmware,
        op: &RequestRecord,
        node: &'static str,
        held: &mut Held,
    ) -> tokio::task::JoinHandle<Result<leasebroker::domain::FlashRow, leasebroker::service::ServiceError>> {
        let a1 = {
            let (firmware, op) = (firmware.clone(), op.clone());
            let version = leasebroker::service::FlashFirmware::new("2.0");
            tokio::spawn(async move { firmware.flash(node, &version, &op).await })
        };
        held.reached().await;
        settled(&firmware.domain, op.derive("flash").as_str(), firmware.settle).await;
        a1
    }

    /// Issue 45, item 1: an attempt recorded its flash with its send stamp and is held before the
    /// `SimpleUpdate` (a frozen VM), its claim still live. The settle window passes, and the BMC
    /// cannot say what came of the flash. The watcher must not conclude the operation while an
    /// attempt holds its request's claim: the attempt may be sending. Released, the attempt
    /// sends, and the operation is accepted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_watcher_concludes_nothing_while_an_attempt_holds_the_claim() {
        use leasebroker::firmware::{WatchSettings, Watcher};
        let (hook, mut held) = hold_first(Step::FlashSend);
        let rig = rig().await;
        let (firmware, bmc) = redfish_firmware(&rig, hook).await;
        let store = rig.db.idempotency_store();
        let path = "/admin/v1/nodes/node-0002/firmware";
        let claim = claimed(&store, "admin", path, "held-flash", Duration::from_secs(300)).await;
        let op = RequestRecord::new(claim.record().clone());
        let tag = op.derive("flash").as_str().to_owned();
        let a1 = held_past_its_window(&firmware, &op, "node-0002", &mut held).await;
        let settings = WatchSettings {
            poll: Duration::from_millis(100),
            settle: rig.workers.settle,
            abandon_after: Duration::from_secs(3600),
            in_flight_ttl: Duration::from_secs(300),
        };
        let watcher = Watcher::new(rig.workers.domain.clone(), firmware.bmc.clone(), store, "w".into(), settings);
        watcher.run_once().await;
        let row = rig.workers.domain.flash_by_tag(&tag).await.expect("read").expect("the operation");
        assert_eq!(row.state, leasebroker_api::OperationState::Running, "concluded under a live claim: {row:?}");

        held.release.send(()).expect("release A1");
        let accepted = a1.await.expect("A1").expect("the flash");
        assert!(accepted.is_accepted() && !accepted.is_finished(), "{accepted:?}");
        assert_eq!(bmc.stats().flashes_total, 1);
    }

    /// Issue 45, item 1, the retry path after a pause: an attempt recorded its flash with its send
    /// stamp and is held before the `SimpleUpdate`, past its claim. A retry of the request waits
    /// out the settle window, finds that the BMC cannot say what came of the flash, and ends the
    /// operation `uncertain` (never `failed` on a guess), moving the send stamp first. The held
    /// attempt wakes: it finds the stamp moved and sends nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_flash_waking_after_a_retry_concluded_sends_nothing() {
        use leasebroker::service::FlashFirmware;
        let (hook, mut held) = hold_first(Step::FlashSend);
        let rig = rig().await;
        let (firmware, bmc) = redfish_firmware(&rig, hook).await;
        let op = operation("POST", "/admin/v1/nodes/node-0003/firmware");
        let tag = op.derive("flash").as_str().to_owned();
        let a1 = held_past_its_window(&firmware, &op, "node-0003", &mut held).await;
        let retry = firmware.flash("node-0003", &FlashFirmware::new("2.0"), &op).await.expect("the retry's answer");
        assert_eq!(retry.state, leasebroker_api::OperationState::Uncertain, "{retry:?}");

        held.release.send(()).expect("release A1");
        let late = a1.await.expect("A1");
        assert_eq!(bmc.stats().flashes_total, 0, "A1 ({late:?}) sent after the retry concluded");
        let row = rig.workers.domain.flash_by_tag(&tag).await.expect("read").expect("the operation");
        assert_eq!(row.state, leasebroker_api::OperationState::Uncertain, "{row:?}");
    }

    /// Issue 24, hole 3, the flash watcher: 500 running operations whose flash was never sent
    /// (their requests walked away; they wait out `--abandon-after`), older than a flash the BMC
    /// accepted just now. The watcher still follows the new one within two passes: it reads the
    /// least recently watched first, not the oldest 500.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_flash_watcher_reaches_a_new_flash_behind_500_waiting_ones() {
        use leasebroker::firmware::{Firmware, WatchSettings, Watcher};
        use leasebroker::service::FlashFirmware;
        let rig = rig().await;
        let Db::Sqlite(sqlite) = &rig.db else { panic!("the rig runs on SQLite") };
        let created = idempotency::now().timestamp_micros() - 60_000_000;
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500) \
             INSERT INTO lb_nodes (node_id, cpu, memory_gb) SELECT 'node-w' || i, 64, 256 FROM n",
        )
        .execute(sqlite)
        .await
        .expect("nodes");
        sqlx::query(
            "INSERT INTO lb_flash_operations (op_id, node_id, version, state, intent, tag, created_at) \
             SELECT 'op-0' || node_id, node_id, '9.9', 'running', 'unsent', 'sk-w' || node_id, $1 \
             FROM lb_nodes WHERE node_id LIKE 'node-w%'",
        )
        .bind(created)
        .execute(sqlite)
        .await
        .expect("operations");
        let firmware = Firmware {
            domain: rig.workers.domain.clone(),
            bmc: std::sync::Arc::new(leasebroker::firmware::ApiBmc::new(rig.workers.hypervisor.clone())),
            settle: rig.workers.settle,
            hook: Hook::default(),
        };
        let op = operation("POST", "/admin/v1/nodes/node-0001/firmware");
        let flash = firmware
            .flash("node-0001", &FlashFirmware { version: "2.0".into(), force: false }, &op)
            .await
            .expect("accepted");
        assert!(flash.is_accepted(), "{flash:?}");
        let watcher = Watcher::new(
            rig.workers.domain.clone(),
            firmware.bmc.clone(),
            rig.db.idempotency_store(),
            "watcher-1".into(),
            WatchSettings {
                poll: Duration::from_millis(100),
                settle: rig.workers.settle,
                abandon_after: Duration::from_secs(3600),
                in_flight_ttl: Duration::from_secs(300),
            },
        );
        watcher.run_once().await;
        watcher.run_once().await;
        let intent = rig.workers.domain.ledger().intent(&flash.tag).await.expect("read").expect("the flash's intent");
        assert_eq!(intent.watcher.as_deref(), Some("watcher-1"), "the new flash was never watched: {intent:?}");
    }
}
