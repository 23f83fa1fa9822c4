//! The hypervisor simulator: an axum app serving the hypervisor API of docs/protocol.md#hypervisor-api, with injectable
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
//! - the BMCs of docs/protocol.md#firmware-operations: `POST /v1/bmc/{node_id}/flash`, `GET /v1/bmc/{node_id}`,
//!   `GET /v1/bmc?tag=T` (see [`bmc`]; a second flash while one writes bricks the node); or,
//!   with [`Simulator::with_redfish`] (`--bmc redfish`), the same BMCs as a Redfish service
//!   under `/redfish/v1` instead (see [`redfish`])
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
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use tokio::net::TcpListener;

use self::problem::{dropped_connection, problem};
pub use self::redfish::RedfishOptions;
use super::api::{SimStats, VmDetail};

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
    redfish: Option<RedfishOptions>,
    missing_images: Arc<[String]>,
}

pub mod bmc;
mod control;
mod problem;
pub mod redfish;
#[cfg(test)]
mod tests;
mod vms;

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
    tasks: redfish::Tasks,
    /// The Redfish `Systems` reads still to be slowed (`PUT /v1/faults/systems`).
    systems_stall: redfish::Stall,
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
            redfish: None,
            missing_images: Arc::new([]),
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

    /// Images the hypervisor does not have (`--missing-image`): a boot of one is refused with
    /// `422`, nothing done, as a real hypervisor refuses an image it cannot find.
    #[must_use]
    pub fn with_missing_images(mut self, images: Vec<String>) -> Self {
        self.missing_images = images.into();
        self
    }

    /// Whether the hypervisor lacks `image`.
    pub(crate) fn lacks_image(&self, image: &str) -> bool {
        self.missing_images.iter().any(|m| m == image)
    }

    /// The probability that a BMC flash fails its verification.
    pub fn flash_failure(&self) -> f64 {
        self.flash_failure
    }

    /// Serves the BMCs as a Redfish service under `/redfish/v1` instead of the BMC API of docs/protocol.md#firmware-operations
    /// (`--bmc redfish`): the same machines, faults, bricking rule and counters.
    #[must_use]
    pub fn with_redfish(mut self, options: RedfishOptions) -> Self {
        self.redfish = Some(options);
        self
    }

    /// How the Redfish BMCs answer (the defaults when they are not served).
    fn redfish_options(&self) -> RedfishOptions {
        self.redfish.unwrap_or_default()
    }

    /// The HTTP API, ready to serve (see the module docs for the routes).
    pub fn router(&self) -> Router {
        let router = Router::new()
            .route("/v1/vms", post(vms::boot).get(vms::list))
            .route("/v1/vms/{vm_id}", get(vms::get_vm).delete(vms::delete_vm))
            .route("/v1/vms/{vm_id}/reboot", post(vms::reboot))
            .route("/v1/stats", get(control::stats))
            .route("/v1/faults", get(control::get_faults).put(control::put_faults));
        let router = match self.redfish {
            Some(_) => router.merge(redfish::routes()),
            None => router
                .route("/v1/bmc", get(bmc::list))
                .route("/v1/bmc/{node_id}", get(bmc::get))
                .route("/v1/bmc/{node_id}/flash", post(bmc::flash)),
        };
        router
            .fallback(problem::not_found)
            .method_not_allowed_fallback(problem::method_not_allowed)
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

    /// Whether a call's headers carry `tag` as `Idempotency-Key: "<tag>"` (an RFC 9651 String).
    fn keyed_by(headers: &axum::http::HeaderMap, tag: &str) -> bool {
        let mut keys = headers.get_all("idempotency-key").iter();
        match (keys.next(), keys.next()) {
            (Some(key), None) => {
                key.as_bytes().first() == Some(&b'"')
                    && idempotency::IdempotencyKey::parse_header(key.as_bytes()).is_ok_and(|k| k.as_str() == tag)
            }
            _ => false,
        }
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
