//! Requests to leasebroker's API and its simulator's, and the ground truth tests read from them
//! (the fleet, the simulator's counters).

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::tokens::{ADMIN, ALICE};

/// A client with a 30 s timeout.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client")
}

/// An answer, read whole.
#[derive(Debug)]
pub struct Reply {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: reqwest::header::HeaderMap,
    /// Its body.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON (`null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The last segment of a problem's `type` (`request-in-progress`), or empty.
    pub fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned()
    }

    /// Whether it says `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
}

/// Sends `method url` with the bearer `token`, an `Idempotency-Key` and a JSON body if given.
pub async fn send(method: reqwest::Method, url: &str, token: &str, key: Option<&str>, body: Option<&Value>) -> Reply {
    let mut req = http().request(method, url).bearer_auth(token);
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(serde_json::to_vec(b).expect("json"));
    }
    let resp = req.send().await.expect("request");
    Reply { status: resp.status(), headers: resp.headers().clone(), body: resp.bytes().await.expect("body").to_vec() }
}

/// `POST /v1/workers` with the key `key`.
pub async fn create(base: &str, token: &str, key: &str, body: &Value) -> Reply {
    send(reqwest::Method::POST, &format!("{base}/v1/workers"), token, Some(key), Some(body)).await
}

/// `GET /admin/v1/fleet` with the operator's token.
pub async fn fleet(base: &str) -> Value {
    send(reqwest::Method::GET, &format!("{base}/admin/v1/fleet"), ADMIN, None, None).await.json()
}

/// The simulator's counters (`GET /v1/stats`).
pub async fn sim_stats(sim: &str) -> Value {
    http().get(format!("{sim}/v1/stats")).send().await.expect("stats").json().await.expect("json")
}

/// Sets the simulator's faults: the chance a call fails before and after it acts, and a latency.
pub async fn set_faults(sim: &str, fail_before: f64, fail_after: f64, latency_ms: u64) {
    let r = http()
        .put(format!("{sim}/v1/faults"))
        .json(&json!({"fail_before": fail_before, "fail_after": fail_after, "latency_ms": latency_ms}))
        .send()
        .await
        .expect("faults");
    assert!(r.status().is_success(), "setting faults: {}", r.status());
}

/// The fleet holds exactly one worker, one allocated node and one lease: nothing leaked.
pub async fn assert_one_worker_node_and_lease(base: &str) {
    let f = fleet(base).await;
    assert_eq!(
        (f["workers_active"].as_i64(), f["nodes_allocated"].as_i64(), f["leases_active"].as_i64()),
        (Some(1), Some(1), Some(1)),
        "{f}"
    );
}

/// A worker every pool has room for.
pub fn worker_body() -> Value {
    json!({"image": "worker-base:2025.11", "cpu": 16, "memory_gb": 64, "labels": {"team": "ml-eval"}})
}

/// Retries `create` (as alice) with one key until it is not a 409 in-progress / 502 / 503, like a
/// client would, or `within` has passed.
pub async fn create_until_done(base: &str, key: &str, body: &Value, within: Duration) -> Reply {
    let deadline = Instant::now() + within;
    loop {
        let r = create(base, ALICE, key, body).await;
        let retryable = r.status == StatusCode::SERVICE_UNAVAILABLE
            || r.status == StatusCode::BAD_GATEWAY
            || (r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress");
        if !retryable || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
