//! The simulator's own routes: `/v1/stats`, and `/v1/faults` to read and replace the faults.

use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Json, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::problem::{json_rejection, problem};
use super::{SimConfig, Simulator};
use crate::hypervisor::api::SimStats;

pub(super) async fn stats(State(sim): State<Simulator>) -> Json<SimStats> {
    Json(sim.stats())
}

/// The wire form of [`SimConfig`], for `GET`/`PUT /v1/faults`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FaultsBody {
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

pub(super) async fn get_faults(State(sim): State<Simulator>) -> Json<FaultsBody> {
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

pub(super) async fn put_faults(
    State(sim): State<Simulator>,
    body: Result<Json<FaultsBody>, JsonRejection>,
) -> Response {
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
