//! The hypervisor simulator: an axum app serving the hypervisor API of SPEC 3.3, with injectable
//! faults and the counters the fault harness checks.
//!
//! Routes:
//! - `POST /v1/vms` `{"image", "cpu", "memory_gb", "tag"}` -> `201 {"vm_id", "tag", "state"}`
//! - `GET /v1/vms[?tag=T]` -> `200 {"vms": [...]}`; with `tag`, only VMs whose tag equals `T`
//!   exactly (so `?tag=` lists the untagged ones), without it every VM, oldest boot first
//! - `GET /v1/vms/{vm_id}` -> `200 {"vm_id", "tag", "state", "reboot_tags", "image", "cpu",
//!   "memory_gb"}` or `404`
//! - `POST /v1/vms/{vm_id}/reboot` `{"tag"}` -> `202` (the VM in full) or `404`
//! - `DELETE /v1/vms/{vm_id}` -> `204` or `404`
//! - `GET /v1/stats` -> [`SimStats`]
//! - the BMCs of SPEC 3.4: `POST /v1/bmc/{node_id}/flash`, `GET /v1/bmc/{node_id}`,
//!   `GET /v1/bmc?tag=T` (see [`bmc`]; a second flash while one writes bricks the node)
//! - Simulator extension, for tests and the harness: `GET /v1/faults` and
//!   `PUT /v1/faults` `{"fail_before", "fail_after", "latency_ms", "slow", "slow_ms", "refuse"}`
//!   read and replace the faults at runtime (`204`; a probability outside 0.0-1.0 is a `422`;
//!   absent fields are 0).
//!
//! Faults apply to the mutating requests (`POST`, `DELETE`) only, after the body was validated:
//! `refuse` answers `409` (problem `refused`) at once without doing anything, a definite refusal;
//! otherwise `latency` is slept first (plus `slow_ms` for the share `slow` of the calls, so a
//! caller with a shorter timeout gives up and the call lands after it), then `fail_before`
//! answers `503` without doing anything, or the work is done and `fail_after` drops the connection
//! without answering. The work (with its latency) runs in its own task, so a client that times out
//! and hangs up does not cancel it: like a real hypervisor, the VM still boots, which is exactly
//! the ambiguity callers must reconcile.
//!
//! Errors are JSON: `{"type": "/problems/<name>", "title", "status", "detail"}` with
//! `Content-Type: application/problem+json`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use super::api::{BootRequest, RebootRequest, SimStats, Vm, VmDetail, VmList, VmState};

/// The simulator's faults. `Default` is no faults at all.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Probability (0.0-1.0) that a mutating request is answered `503` without doing anything.
    pub fail_before: f64,
    /// Probability (0.0-1.0) that a mutating request does its work and then loses its answer: the
    /// connection is dropped without a response.
    pub fail_after: f64,
    /// Slept before each mutating request does its work.
    pub latency: Duration,
    /// Probability (0.0-1.0) that a mutating request is slow: [`SimConfig::slow_latency`] is slept
    /// on top of `latency`. With a caller whose timeout is shorter, its call lands late.
    pub slow: f64,
    /// The extra latency of a slow request.
    pub slow_latency: Duration,
    /// Probability (0.0-1.0) that a mutating request is refused for good: answered `409` at once,
    /// nothing done (a definite failure, unlike `fail_before`'s `503`).
    pub refuse: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            fail_before: 0.0,
            fail_after: 0.0,
            latency: Duration::ZERO,
            slow: 0.0,
            slow_latency: Duration::ZERO,
            refuse: 0.0,
        }
    }
}

impl SimConfig {
    /// Checks that both probabilities lie within 0.0-1.0.
    pub fn validate(&self) -> Result<(), String> {
        let probabilities = [
            ("fail_before", self.fail_before),
            ("fail_after", self.fail_after),
            ("slow", self.slow),
            ("refuse", self.refuse),
        ];
        for (name, p) in probabilities {
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{name} must be a probability between 0.0 and 1.0, got {p}"));
            }
        }
        Ok(())
    }

    /// The same faults with each probability forced into 0.0-1.0 (NaN counts as 0.0).
    fn clamped(self) -> Self {
        let clamp = |p: f64| if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        Self {
            fail_before: clamp(self.fail_before),
            fail_after: clamp(self.fail_after),
            slow: clamp(self.slow),
            refuse: clamp(self.refuse),
            ..self
        }
    }
}

/// The simulated hypervisor: its VMs, counters and faults.
///
/// Cloning is cheap and every clone shares one state, so the same simulator can be served over
/// HTTP and inspected in process ([`Simulator::stats`]) at once.
#[derive(Debug, Clone)]
pub struct Simulator {
    shared: Arc<Shared>,
    flash_time: Duration,
    flash_failure: f64,
}

pub mod bmc;

/// How long a BMC flash writes unless set otherwise (`--flash-ms`).
pub const DEFAULT_FLASH_TIME: Duration = Duration::from_millis(3000);

#[derive(Debug)]
struct Shared {
    state: Mutex<SimState>,
    faults: Mutex<SimConfig>,
}

#[derive(Debug, Default)]
struct SimState {
    vms: HashMap<String, SimVm>,
    /// Boot order, so listings are stable.
    next_seq: u64,
    /// Every non-empty tag ever booted, deleted VMs included: a re-boot of one is a duplicate.
    booted_tags: HashSet<String>,
    stats: SimStats,
    bmcs: bmc::Bmcs,
}

#[derive(Debug)]
struct SimVm {
    seq: u64,
    detail: VmDetail,
}

impl Simulator {
    /// A simulator with no VMs and the given faults (probabilities are clamped into 0.0-1.0).
    pub fn new(config: SimConfig) -> Self {
        Self {
            shared: Arc::new(Shared { state: Mutex::new(SimState::default()), faults: Mutex::new(config.clamped()) }),
            flash_time: DEFAULT_FLASH_TIME,
            flash_failure: 0.0,
        }
    }

    /// Sets how long a BMC flash writes (default [`DEFAULT_FLASH_TIME`]).
    #[must_use]
    pub fn with_flash_time(mut self, flash_time: Duration) -> Self {
        self.flash_time = flash_time;
        self
    }

    /// How long a BMC flash writes.
    pub fn flash_time(&self) -> Duration {
        self.flash_time
    }

    /// Sets the probability that a BMC flash fails its verification at the end of the write
    /// (`--flash-fail`): the node goes back to `ok` on the firmware it ran before, the tag stays
    /// in its `flash_tags`. Clamped into 0.0-1.0 (NaN counts as 0.0).
    #[must_use]
    pub fn with_flash_failure(mut self, probability: f64) -> Self {
        self.flash_failure = if probability.is_nan() { 0.0 } else { probability.clamp(0.0, 1.0) };
        self
    }

    /// The probability that a BMC flash fails its verification.
    pub fn flash_failure(&self) -> f64 {
        self.flash_failure
    }

    /// The HTTP API, ready to serve (see the module docs for the routes).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/vms", post(boot).get(list))
            .route("/v1/vms/{vm_id}", get(get_vm).delete(delete_vm))
            .route("/v1/vms/{vm_id}/reboot", post(reboot))
            .route("/v1/stats", get(stats))
            .route("/v1/bmc", get(bmc::list))
            .route("/v1/bmc/{node_id}", get(bmc::get))
            .route("/v1/bmc/{node_id}/flash", post(bmc::flash))
            .route("/v1/faults", get(get_faults).put(put_faults))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self.clone())
    }

    /// The counters as they are now.
    pub fn stats(&self) -> SimStats {
        let state = self.state();
        SimStats { running: state.vms.len() as u64, ..state.stats }
    }

    /// Replaces the faults; later requests see the new ones (probabilities are clamped into
    /// 0.0-1.0).
    pub fn set_faults(&self, config: SimConfig) {
        *lock(&self.shared.faults) = config.clamped();
    }

    /// The faults in force.
    pub fn faults(&self) -> SimConfig {
        *lock(&self.shared.faults)
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        lock(&self.shared.state)
    }

    /// Runs one mutating request's work under the faults in force: `Ok` with the work's result,
    /// or `Err` with what to answer instead (the `refuse` 409, the `fail_before` 503, the
    /// `fail_after` dropped connection).
    ///
    /// The work runs in a task of its own so that a caller who hangs up during the latency does
    /// not cancel it; `work` itself is synchronous under the lock, so it is all-or-nothing.
    async fn mutate<T, F>(&self, work: F) -> Result<T, Response>
    where
        T: Send + 'static,
        F: FnOnce(&mut SimState) -> T + Send + 'static,
    {
        let faults = self.faults();
        if roll(faults.refuse) {
            tracing::debug!("hypervisor-sim: refuse fault, refusing for good");
            return Err(problem(StatusCode::CONFLICT, "refused", "simulated fault: refused, nothing was done"));
        }
        let fail_before = roll(faults.fail_before);
        let fail_after = roll(faults.fail_after);
        let latency = if roll(faults.slow) { faults.latency + faults.slow_latency } else { faults.latency };
        let sim = self.clone();
        let task = tokio::spawn(async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            if fail_before {
                return None;
            }
            Some(work(&mut sim.state()))
        });
        match task.await {
            Ok(None) => {
                tracing::debug!("hypervisor-sim: fail_before fault, refusing");
                Err(problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "simulated fault: refused before doing anything",
                ))
            }
            Ok(Some(_)) if fail_after => {
                tracing::debug!("hypervisor-sim: fail_after fault, dropping the answer");
                Err(dropped_connection())
            }
            Ok(Some(done)) => Ok(done),
            Err(join) => {
                tracing::error!(error = %join, "hypervisor-sim: work task failed");
                Err(problem(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the simulator's work task failed"))
            }
        }
    }
}

impl SimState {
    fn boot(&mut self, req: BootRequest) -> Vm {
        let vm_id = loop {
            let id = format!("vm-{:016x}", rand::random::<u64>());
            if !self.vms.contains_key(&id) {
                break id;
            }
        };
        self.stats.boots_total += 1;
        if !req.tag.is_empty() && !self.booted_tags.insert(req.tag.clone()) {
            self.stats.duplicate_boot_tags += 1;
        }
        let detail = VmDetail {
            vm_id: vm_id.clone(),
            tag: req.tag,
            state: VmState::Running,
            reboot_tags: Vec::new(),
            image: Some(req.image),
            cpu: Some(req.cpu),
            memory_gb: Some(req.memory_gb),
        };
        let vm = detail.summary();
        self.vms.insert(vm_id, SimVm { seq: self.next_seq, detail });
        self.next_seq += 1;
        vm
    }

    fn reboot(&mut self, vm_id: &str, tag: String) -> Option<VmDetail> {
        let vm = self.vms.get_mut(vm_id)?;
        self.stats.reboots_total += 1;
        if vm.detail.reboot_tags.contains(&tag) {
            self.stats.duplicate_reboot_tags += 1;
        }
        vm.detail.reboot_tags.push(tag);
        Some(vm.detail.clone())
    }

    fn list(&self, tag: Option<&str>) -> Vec<VmDetail> {
        let mut vms: Vec<&SimVm> = self.vms.values().filter(|vm| tag.is_none_or(|t| vm.detail.tag == t)).collect();
        vms.sort_by_key(|vm| vm.seq);
        vms.into_iter().map(|vm| vm.detail.clone()).collect()
    }
}

/// Binds nothing itself: serves `sim` on `listener` until `shutdown` resolves, then drains the open
/// requests and returns.
pub async fn serve(
    listener: TcpListener,
    sim: Simulator,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, sim.router()).with_graceful_shutdown(shutdown).await
}

/// Locks a mutex, recovering from poisoning: every critical section here leaves the state
/// consistent, and a panic elsewhere must not turn every later request into one.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// True with probability `p`.
fn roll(p: f64) -> bool {
    // random() is in [0, 1): p = 0.0 never fires, p = 1.0 always does.
    p > 0.0 && rand::random::<f64>() < p
}

async fn boot(State(sim): State<Simulator>, body: Result<Json<BootRequest>, JsonRejection>) -> Response {
    let Json(req) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    if let Err(detail) = validate_boot(&req) {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-request", &detail);
    }
    match sim.mutate(move |state| state.boot(req)).await {
        Ok(vm) => {
            let mut response = (StatusCode::CREATED, Json(&vm)).into_response();
            if let Ok(location) = HeaderValue::from_str(&format!("/v1/vms/{}", vm.vm_id)) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            response
        }
        Err(response) => response,
    }
}

fn validate_boot(req: &BootRequest) -> Result<(), String> {
    if req.image.trim().is_empty() {
        return Err("image must not be empty".to_owned());
    }
    if req.cpu < 1 {
        return Err("cpu must be at least 1".to_owned());
    }
    if req.memory_gb < 1 {
        return Err("memory_gb must be at least 1".to_owned());
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    tag: Option<String>,
}

async fn list(State(sim): State<Simulator>, query: Result<Query<ListQuery>, QueryRejection>) -> Response {
    let Query(query) = match query {
        Ok(query) => query,
        Err(rejection) => return problem(rejection.status(), "invalid-query", &rejection.body_text()),
    };
    let vms = sim.state().list(query.tag.as_deref());
    Json(VmList { vms }).into_response()
}

async fn get_vm(State(sim): State<Simulator>, vm_id: Result<Path<String>, PathRejection>) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    match sim.state().vms.get(&vm_id) {
        Some(vm) => Json(&vm.detail).into_response(),
        None => vm_not_found(&vm_id),
    }
}

async fn reboot(
    State(sim): State<Simulator>,
    vm_id: Result<Path<String>, PathRejection>,
    body: Result<Json<RebootRequest>, JsonRejection>,
) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    let Json(req) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    let target = vm_id.clone();
    match sim.mutate(move |state| state.reboot(&target, req.tag)).await {
        Ok(Some(detail)) => (StatusCode::ACCEPTED, Json(detail)).into_response(),
        Ok(None) => vm_not_found(&vm_id),
        Err(response) => response,
    }
}

async fn delete_vm(State(sim): State<Simulator>, vm_id: Result<Path<String>, PathRejection>) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    let target = vm_id.clone();
    match sim.mutate(move |state| state.vms.remove(&target).is_some()).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => vm_not_found(&vm_id),
        Err(response) => response,
    }
}

async fn stats(State(sim): State<Simulator>) -> Json<SimStats> {
    Json(sim.stats())
}

/// The wire form of [`SimConfig`], for `GET`/`PUT /v1/faults`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultsBody {
    #[serde(default)]
    fail_before: f64,
    #[serde(default)]
    fail_after: f64,
    #[serde(default)]
    latency_ms: u64,
    #[serde(default)]
    slow: f64,
    #[serde(default)]
    slow_ms: u64,
    #[serde(default)]
    refuse: f64,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn get_faults(State(sim): State<Simulator>) -> Json<FaultsBody> {
    let faults = sim.faults();
    Json(FaultsBody {
        fail_before: faults.fail_before,
        fail_after: faults.fail_after,
        latency_ms: millis(faults.latency),
        slow: faults.slow,
        slow_ms: millis(faults.slow_latency),
        refuse: faults.refuse,
    })
}

async fn put_faults(State(sim): State<Simulator>, body: Result<Json<FaultsBody>, JsonRejection>) -> Response {
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    let config = SimConfig {
        fail_before: body.fail_before,
        fail_after: body.fail_after,
        latency: Duration::from_millis(body.latency_ms),
        slow: body.slow,
        slow_latency: Duration::from_millis(body.slow_ms),
        refuse: body.refuse,
    };
    if let Err(detail) = config.validate() {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-request", &detail);
    }
    sim.set_faults(config);
    StatusCode::NO_CONTENT.into_response()
}

async fn not_found() -> Response {
    problem(StatusCode::NOT_FOUND, "not-found", "no such route")
}

async fn method_not_allowed() -> Response {
    problem(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", "method not allowed on this route")
}

/// A response that never reaches the client: its body fails on the first poll, before hyper has
/// flushed the buffered status line, so hyper closes the connection with nothing sent and the
/// client sees the connection end mid-request, not a status.
fn dropped_connection() -> Response {
    let stream = futures::stream::once(async {
        Err::<Bytes, io::Error>(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "simulated fault: connection dropped after the work was done",
        ))
    });
    Response::new(Body::from_stream(stream))
}

fn json_rejection(rejection: JsonRejection) -> Response {
    let name = match rejection.status() {
        StatusCode::UNPROCESSABLE_ENTITY => "invalid-request",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported-media-type",
        _ => "invalid-json",
    };
    problem(rejection.status(), name, &rejection.body_text())
}

fn vm_not_found(vm_id: &str) -> Response {
    problem(StatusCode::NOT_FOUND, "vm-not-found", &format!("no VM {vm_id:?}"))
}

#[derive(Debug, Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
}

/// An RFC 9457-style error body.
fn problem(status: StatusCode, name: &str, detail: &str) -> Response {
    let body = Problem {
        type_uri: format!("/problems/{name}"),
        title: status.canonical_reason().unwrap_or("error"),
        status: status.as_u16(),
        detail,
    };
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};
    use tokio::sync::oneshot;

    use super::*;

    /// Serves a fresh simulator on an ephemeral loopback port.
    async fn start(config: SimConfig) -> (Simulator, String) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let sim = Simulator::new(config);
        tokio::spawn(serve(listener, sim.clone(), std::future::pending()));
        (sim, url)
    }

    fn boot_body(tag: &str) -> Value {
        json!({"image": "ubuntu-24.04", "cpu": 2, "memory_gb": 4, "tag": tag})
    }

    async fn post(url: &str, body: &Value) -> reqwest::Response {
        reqwest::Client::new().post(url).json(body).send().await.expect("send")
    }

    #[tokio::test]
    async fn bad_json_is_400_and_missing_fields_are_422_and_nothing_boots() {
        let (sim, url) = start(SimConfig::default()).await;
        let http = reqwest::Client::new();
        let send_raw = |body: &'static str| {
            http.post(format!("{url}/v1/vms")).header("content-type", "application/json").body(body).send()
        };

        let response = send_raw("{\"image\": ").await.expect("send");
        assert_eq!(response.status(), 400);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let problem: Value = response.json().await.expect("json body");
        assert_eq!(problem["type"], "/problems/invalid-json");
        assert_eq!(problem["status"], 400);

        let response = send_raw(r#"{"image": "x", "cpu": 1, "memory_gb": 1}"#).await.expect("send");
        assert_eq!(response.status(), 422);
        let problem: Value = response.json().await.expect("json body");
        assert_eq!(problem["type"], "/problems/invalid-request");

        let response = send_raw(r#"{"image": "x", "cpu": "two", "memory_gb": 1, "tag": "t"}"#).await.expect("send");
        assert_eq!(response.status(), 422);

        let response =
            post(&format!("{url}/v1/vms"), &json!({"image": "x", "cpu": 0, "memory_gb": 1, "tag": "t"})).await;
        assert_eq!(response.status(), 422);

        let response = send_raw("[]").await.expect("send");
        assert_eq!(response.status(), 422);

        let response = http
            .post(format!("{url}/v1/vms/vm-1/reboot"))
            .header("content-type", "application/json")
            .body("not json")
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), 400);

        let response =
            http.put(format!("{url}/v1/faults")).json(&json!({"fail_before": 2.0})).send().await.expect("send");
        assert_eq!(response.status(), 422);

        assert_eq!(sim.stats(), SimStats::default());
    }

    #[tokio::test]
    async fn boot_answers_201_with_a_generated_id_and_the_tag() {
        let (sim, url) = start(SimConfig::default()).await;
        let response = post(&format!("{url}/v1/vms"), &boot_body("tag-a")).await;
        assert_eq!(response.status(), 201);
        let location = response.headers()["location"].to_str().expect("ascii").to_owned();
        let vm: Value = response.json().await.expect("json");
        let vm_id = vm["vm_id"].as_str().expect("vm_id");
        assert!(vm_id.starts_with("vm-") && vm_id[3..].chars().all(|c| c.is_ascii_hexdigit()), "{vm_id}");
        assert_eq!(vm["tag"], "tag-a");
        assert_eq!(vm["state"], "running");
        assert_eq!(location, format!("/v1/vms/{vm_id}"));

        let detail: Value =
            reqwest::get(format!("{url}/v1/vms/{vm_id}")).await.expect("get").json().await.expect("json");
        assert_eq!(detail["image"], "ubuntu-24.04");
        assert_eq!(detail["cpu"], 2);
        assert_eq!(detail["memory_gb"], 4);
        assert_eq!(detail["reboot_tags"], json!([]));
        assert_eq!(sim.stats().running, 1);
    }

    #[tokio::test]
    async fn stats_count_duplicate_boot_tags_even_after_delete_but_not_empty_tags() {
        let (sim, url) = start(SimConfig::default()).await;
        let http = reqwest::Client::new();
        let first: Vm = post(&format!("{url}/v1/vms"), &boot_body("t1")).await.json().await.expect("json");
        post(&format!("{url}/v1/vms"), &boot_body("t2")).await;
        post(&format!("{url}/v1/vms"), &boot_body("")).await;
        post(&format!("{url}/v1/vms"), &boot_body("")).await;
        assert_eq!(sim.stats().duplicate_boot_tags, 0);

        let response = http.delete(format!("{url}/v1/vms/{}", first.vm_id)).send().await.expect("delete");
        assert_eq!(response.status(), 204);
        let response = http.delete(format!("{url}/v1/vms/{}", first.vm_id)).send().await.expect("delete");
        assert_eq!(response.status(), 404);

        // t1's VM is gone, but booting t1 again is still a second boot for that tag.
        post(&format!("{url}/v1/vms"), &boot_body("t1")).await;
        let stats: SimStats = reqwest::get(format!("{url}/v1/stats")).await.expect("stats").json().await.expect("json");
        assert_eq!(
            stats,
            SimStats {
                boots_total: 5,
                running: 4,
                duplicate_boot_tags: 1,
                reboots_total: 0,
                duplicate_reboot_tags: 0,
                ..SimStats::default()
            }
        );
        assert_eq!(stats, sim.stats());
    }

    #[tokio::test]
    async fn reboots_append_tags_and_count_repeats_per_vm() {
        let (sim, url) = start(SimConfig::default()).await;
        let a: Vm = post(&format!("{url}/v1/vms"), &boot_body("a")).await.json().await.expect("json");
        let b: Vm = post(&format!("{url}/v1/vms"), &boot_body("b")).await.json().await.expect("json");
        for (vm, tag) in [(&a, "r1"), (&a, "r1"), (&a, "r2"), (&b, "r1")] {
            let response = post(&format!("{url}/v1/vms/{}/reboot", vm.vm_id), &json!({"tag": tag})).await;
            assert_eq!(response.status(), 202);
        }
        let response = post(&format!("{url}/v1/vms/vm-0000/reboot"), &json!({"tag": "r1"})).await;
        assert_eq!(response.status(), 404);

        let detail: VmDetail =
            reqwest::get(format!("{url}/v1/vms/{}", a.vm_id)).await.expect("get").json().await.expect("json");
        assert_eq!(detail.reboot_tags, ["r1", "r1", "r2"]);
        let stats = sim.stats();
        assert_eq!(stats.reboots_total, 4);
        // Only a's second r1 repeats; b's r1 is b's first.
        assert_eq!(stats.duplicate_reboot_tags, 1);
    }

    #[tokio::test]
    async fn list_filters_by_exact_tag_in_boot_order() {
        let (_sim, url) = start(SimConfig::default()).await;
        let mut booted = Vec::new();
        for tag in ["x", "y", "x", "x y"] {
            let vm: Vm = post(&format!("{url}/v1/vms"), &boot_body(tag)).await.json().await.expect("json");
            booted.push(vm.vm_id);
        }
        let list = |query: &'static str| {
            let url = url.clone();
            async move {
                let body: VmList<VmDetail> =
                    reqwest::get(format!("{url}/v1/vms{query}")).await.expect("list").json().await.expect("json");
                body.vms.into_iter().map(|vm| vm.vm_id).collect::<Vec<_>>()
            }
        };
        assert_eq!(list("").await, booted);
        assert_eq!(list("?tag=x").await, [booted[0].clone(), booted[2].clone()]);
        assert_eq!(list("?tag=x%20y").await, [booted[3].clone()]);
        assert!(list("?tag=z").await.is_empty());
        assert!(list("?tag=").await.is_empty());
    }

    #[tokio::test]
    async fn fail_before_answers_503_and_does_nothing_but_reads_are_never_faulted() {
        let (sim, url) = start(SimConfig { fail_before: 1.0, ..SimConfig::default() }).await;
        let response = post(&format!("{url}/v1/vms"), &boot_body("t")).await;
        assert_eq!(response.status(), 503);
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["type"], "/problems/unavailable");
        assert_eq!(sim.stats(), SimStats::default());

        assert_eq!(reqwest::get(format!("{url}/v1/vms")).await.expect("list").status(), 200);
        assert_eq!(reqwest::get(format!("{url}/v1/stats")).await.expect("stats").status(), 200);

        // Lift the fault over HTTP and the same request goes through.
        let http = reqwest::Client::new();
        let response =
            http.put(format!("{url}/v1/faults")).json(&json!({"fail_before": 0.0})).send().await.expect("put");
        assert_eq!(response.status(), 204);
        assert_eq!(sim.faults(), SimConfig::default());
        assert_eq!(post(&format!("{url}/v1/vms"), &boot_body("t")).await.status(), 201);
        assert_eq!(sim.stats().boots_total, 1);
    }

    #[tokio::test]
    async fn fail_after_does_the_work_then_drops_the_connection_without_a_status() {
        let (sim, url) = start(SimConfig { fail_after: 1.0, ..SimConfig::default() }).await;
        let err = reqwest::Client::new()
            .post(format!("{url}/v1/vms"))
            .json(&boot_body("lost"))
            .send()
            .await
            .expect_err("the answer must be lost, not delivered");
        assert!(err.status().is_none(), "{err:?}");
        assert!(!err.is_connect() && !err.is_timeout(), "{err:?}");
        assert_eq!(sim.stats().boots_total, 1);
        assert_eq!(sim.state().list(Some("lost")).len(), 1);
    }

    #[tokio::test]
    async fn a_caller_that_hangs_up_during_latency_does_not_cancel_the_boot() {
        let (sim, url) = start(SimConfig { latency: Duration::from_millis(1000), ..SimConfig::default() }).await;
        let err = reqwest::Client::new()
            .post(format!("{url}/v1/vms"))
            .json(&boot_body("slow"))
            .timeout(Duration::from_millis(50))
            .send()
            .await
            .expect_err("times out");
        assert!(err.is_timeout(), "{err:?}");
        assert_eq!(sim.stats().boots_total, 0, "still sleeping");
        // Poll rather than sleep a fixed time: the machine may be busy.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(sim.stats().boots_total, 1, "the boot landed after the caller gave up");
    }

    #[tokio::test]
    async fn faults_round_trip_over_http_and_are_clamped_in_process() {
        let (sim, url) = start(SimConfig::default()).await;
        let http = reqwest::Client::new();
        let response = http
            .put(format!("{url}/v1/faults"))
            .json(&json!({"fail_before": 0.25, "fail_after": 0.5, "latency_ms": 7}))
            .send()
            .await
            .expect("put");
        assert_eq!(response.status(), 204);
        let set =
            SimConfig { fail_before: 0.25, fail_after: 0.5, latency: Duration::from_millis(7), ..SimConfig::default() };
        assert_eq!(sim.faults(), set);
        let faults: Value = reqwest::get(format!("{url}/v1/faults")).await.expect("get").json().await.expect("json");
        assert_eq!(
            faults,
            json!({"fail_before": 0.25, "fail_after": 0.5, "latency_ms": 7, "slow": 0.0, "slow_ms": 0, "refuse": 0.0})
        );

        let all = json!({"fail_before": 0.0, "fail_after": 0.0, "latency_ms": 0, "slow": 0.5, "slow_ms": 1500, "refuse": 0.125});
        let response = http.put(format!("{url}/v1/faults")).json(&all).send().await.expect("put");
        assert_eq!(response.status(), 204);
        let faults: Value = reqwest::get(format!("{url}/v1/faults")).await.expect("get").json().await.expect("json");
        assert_eq!(faults, all);
        let response = http.put(format!("{url}/v1/faults")).json(&json!({"refuse": 1.5})).send().await.expect("put");
        assert_eq!(response.status(), 422);

        sim.set_faults(SimConfig {
            fail_before: f64::NAN,
            fail_after: 3.0,
            slow: -1.0,
            refuse: 2.0,
            ..SimConfig::default()
        });
        assert_eq!(
            sim.faults(),
            SimConfig { fail_before: 0.0, fail_after: 1.0, slow: 0.0, refuse: 1.0, ..SimConfig::default() }
        );
    }

    #[tokio::test]
    async fn refuse_answers_409_at_once_and_does_nothing() {
        let (sim, url) =
            start(SimConfig { refuse: 1.0, latency: Duration::from_secs(60), ..SimConfig::default() }).await;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
        let response = http.post(format!("{url}/v1/vms")).json(&boot_body("r")).send().await.expect("not delayed");
        assert_eq!(response.status(), 409);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["type"], "/problems/refused");
        let response = http.delete(format!("{url}/v1/vms/vm-0")).send().await.expect("delete");
        assert_eq!(response.status(), 409, "refused before looking the VM up");
        assert_eq!(sim.stats(), SimStats::default());
        assert!(sim.state().list(Some("r")).is_empty());
    }

    #[tokio::test]
    async fn a_slow_call_lands_after_its_caller_gave_up() {
        let (sim, url) =
            start(SimConfig { slow: 1.0, slow_latency: Duration::from_millis(800), ..SimConfig::default() }).await;
        let err = reqwest::Client::new()
            .post(format!("{url}/v1/vms"))
            .json(&boot_body("late"))
            .timeout(Duration::from_millis(100))
            .send()
            .await
            .expect_err("times out");
        assert!(err.is_timeout(), "{err:?}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(sim.state().list(Some("late")).len(), 1, "the slow boot landed late");

        // With no slow share, the same latency is never added.
        sim.set_faults(SimConfig { slow: 0.0, slow_latency: Duration::from_secs(60), ..SimConfig::default() });
        let response = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client")
            .post(format!("{url}/v1/vms"))
            .json(&boot_body("fast"))
            .send()
            .await
            .expect("answered without the slow latency");
        assert_eq!(response.status(), 201);
    }

    #[tokio::test]
    async fn unknown_routes_and_methods_answer_json() {
        let (_sim, url) = start(SimConfig::default()).await;
        let response = reqwest::get(format!("{url}/v2/nothing")).await.expect("get");
        assert_eq!(response.status(), 404);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        let response = reqwest::Client::new().patch(format!("{url}/v1/vms")).send().await.expect("patch");
        assert_eq!(response.status(), 405);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
    }

    #[tokio::test]
    async fn serve_returns_once_shutdown_resolves() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Simulator::new(SimConfig::default()), async {
            let _ = stopped.await;
        }));
        stop.send(()).expect("server alive");
        let result = tokio::time::timeout(Duration::from_secs(5), server).await.expect("stops in time");
        result.expect("task").expect("serve");
    }
}
