//! The admin listener (`--admin-listen`, never proxied): `/healthz`, `/readyz`, `/metrics`, and
//! the records API of docs/protocol.md#operating-it with the operator's resolutions of docs/protocol.md#gateway, behind `--admin-token`.
//!
//! The records API is leasebroker's (`leasebroker::api::records`: one implementation over any
//! idempotency store), so `lbctl records list|get|forget` works against this listener. Every
//! resolution writes an audit event to the log: target `idempotency_gateway::audit`, one line
//! with the actor, the action, the admin request's key and the record's scope.

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Extension, Router};
use idempotency::{Forget, Principal, Resolve, Store, StoredBody, StoredResponse};
use idempotency_tower::{IdempotencyContext, IdempotencyLayer, Problem};
use leasebroker::api::records::{self, RecordQueryParams, RecordsQuery};
use leasebroker::audit::AuditEntry;
use metrics_exporter_prometheus::PrometheusHandle;
use subtle::ConstantTimeEq;

/// The principal of every admin request (one token, one operator role).
pub const ADMIN_PRINCIPAL: &str = "admin";

/// What the admin routes share.
#[derive(Clone)]
pub struct AdminState {
    /// The record store.
    pub store: Arc<dyn Store>,
    /// The Prometheus registry's renderer.
    pub metrics: PrometheusHandle,
    /// `--admin-token`; `None`: the records API answers `401`.
    pub token: Option<Arc<str>>,
    /// How long a response an operator stores is replayed (`--retention`).
    pub retention: std::time::Duration,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState").field("token", &self.token.as_ref().map(|_| "***")).finish_non_exhaustive()
    }
}

/// The admin router. Its mutating routes are behind `layer` (an `Idempotency-Key` is required,
/// as on every mutating admin route, docs/protocol.md#operating-it).
pub fn router(state: AdminState, layer: IdempotencyLayer) -> Router {
    let records = Router::new()
        .route("/admin/v1/records", get(list))
        .route("/admin/v1/records/{id}", get(read).delete(forget).layer(layer.clone()))
        .route("/admin/v1/records/{id}/response", put(resolve).layer(layer))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(records)
        .fallback(|| async {
            Problem::new(StatusCode::NOT_FOUND, "not-found", "Not found", "no such admin route").into_response()
        })
        .with_state(state)
}

/// Admits a request with the admin token (compared in constant time) as [`ADMIN_PRINCIPAL`].
async fn authorize(State(state): State<AdminState>, mut req: Request, next: Next) -> Response {
    let given = req.headers().get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let given = given.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
    let admitted = match (&state.token, given) {
        (Some(token), Some(given)) => bool::from(token.as_bytes().ct_eq(given.as_bytes())),
        _ => false,
    };
    if !admitted {
        let detail = if state.token.is_some() {
            "send the admin token as Authorization: Bearer TOKEN"
        } else {
            "the records API is off: the gateway was started without --admin-token"
        };
        return Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized", detail).into_response();
    }
    req.extensions_mut().insert(Principal::new(ADMIN_PRINCIPAL));
    next.run(req).await
}

async fn readyz(State(state): State<AdminState>) -> Response {
    match state.store.ping().await {
        Ok(()) => "ready\n".into_response(),
        Err(e) => {
            tracing::warn!(error = %idempotency::ErrorChain(&e), "readiness: the record store does not answer");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                idempotency::problems::STORE_UNAVAILABLE,
                "Idempotency store unavailable",
                "the record store did not answer",
            )
            .with_retry_after(1)
            .into_response()
        }
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    ([(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

async fn list(
    State(state): State<AdminState>,
    query: Result<Query<RecordsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    records::list_page(state.store.as_ref(), query).await
}

async fn read(
    State(state): State<AdminState>,
    Path(id): Path<String>,
    query: Result<Query<RecordQueryParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    records::read_record(state.store.as_ref(), &id, query).await
}

/// `DELETE /admin/v1/records/{id}`: forgets a completed, failed or uncertain record (for an
/// uncertain one: "it did not happen", so the next retry forwards the request again).
async fn forget(
    State(state): State<AdminState>,
    Extension(actor): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(id): Path<String>,
) -> Response {
    let Some(id) = records::record_id(&id) else { return records::no_such_record() };
    match state.store.forget(&id).await {
        Ok(Forget::Forgotten(record)) => {
            audit(&AuditEntry::forget(actor.as_str(), Some(ctx.key().as_str()), &record));
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Forget::InFlight(_)) => Problem::new(
            StatusCode::CONFLICT,
            leasebroker_api::problems::RECORD_IN_FLIGHT,
            "Record in flight",
            "the record's request is still being forwarded; wait for it to complete or fail (or for --in-flight-ttl)",
        )
        .into_response(),
        Ok(Forget::Absent) => records::no_such_record(),
        Err(e) => records::store_error(e),
    }
}

/// The body of `PUT /admin/v1/records/{id}/response`: what the upstream did answer.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolvedResponse {
    /// The status code.
    pub status: u16,
    /// The headers a replay carries.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body, as text.
    #[serde(default)]
    pub body: String,
}

/// `PUT /admin/v1/records/{id}/response`: an uncertain record's request did happen, and this is
/// what it answered; every retry replays it. `409` for a record that is not uncertain.
async fn resolve(
    State(state): State<AdminState>,
    Extension(actor): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(id): Path<String>,
    body: Result<axum::Json<ResolvedResponse>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Some(id) = records::record_id(&id) else { return records::no_such_record() };
    let Ok(axum::Json(given)) = body else {
        return records::invalid_query(r#"the body must be {"status": int, "headers": {str: str}, "body": str}"#);
    };
    let stored = match stored_response(given) {
        Ok(stored) => stored,
        Err(detail) => return records::invalid_query(&detail),
    };
    let expires_at = idempotency::later(idempotency::now(), state.retention);
    match state.store.resolve(&id, &stored, expires_at).await {
        Ok(Resolve::Resolved(record)) => {
            let mut entry = AuditEntry::forget(actor.as_str(), Some(ctx.key().as_str()), &record);
            entry.action = "resolve".to_owned();
            audit(&entry);
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(Resolve::NotUncertain(record)) => Problem::new(
            StatusCode::CONFLICT,
            "record-not-uncertain",
            "Record not uncertain",
            format!("the record is {}; only an uncertain record takes a response", record.state.as_str()),
        )
        .into_response(),
        Ok(Resolve::Absent) => records::no_such_record(),
        Err(e) => records::store_error(e),
    }
}

/// `given` as a stored response, or why it cannot be one.
fn stored_response(given: ResolvedResponse) -> Result<StoredResponse, String> {
    if !(200..=599).contains(&given.status) {
        return Err("status must be 200 to 599".to_owned());
    }
    let mut headers = Vec::with_capacity(given.headers.len());
    for (name, value) in given.headers {
        let valid =
            http::HeaderName::from_bytes(name.as_bytes()).is_ok() && http::HeaderValue::from_str(&value).is_ok();
        if !valid {
            return Err(format!("header {name:?} is not a valid header"));
        }
        headers.push((name.to_ascii_lowercase(), value));
    }
    Ok(StoredResponse {
        status: given.status,
        headers,
        body: StoredBody::encode(bytes::Bytes::from(given.body), usize::MAX),
    })
}

/// Writes `entry` as the audit event of a resolution.
fn audit(entry: &AuditEntry) {
    tracing::info!(
        target: "idempotency_gateway::audit",
        at = entry.at,
        actor = %entry.actor,
        action = %entry.action,
        request_key = entry.request_key.as_deref(),
        record_id = %entry.record_id,
        principal = %entry.principal,
        endpoint = %entry.endpoint,
        key = %entry.key,
        state = %entry.state,
        "audit"
    );
}
