//! The router: the API's handlers and middleware ([`crate::api`]) and the OpenAPI document that
//! describes them ([`crate::openapi`]), put together.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use idempotency_tower::{IdempotencyLayer, Problem};
use leasebroker_validation::problems;

use crate::api::{
    AppState, authenticate, authenticate_admin, create_worker, delete_worker, flash_firmware, fleet, get_operation,
    get_worker, healthz, list_workers, metrics, rate_limit, readyz, reboot_worker,
};
use crate::api::{forget_record, get_record, list_records};

/// The OpenAPI document.
pub async fn openapi() -> Response {
    Json(crate::openapi::document()).into_response()
}

async fn not_found() -> Response {
    Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "Not found", "no such route").into_response()
}

/// Counter of responses by status code, labelled `code` (`429` alerts read it; see `deploy/`).
pub const HTTP_RESPONSES_TOTAL: &str = "leasebroker_http_responses_total";

/// Counts every response under its status code (a bounded label: HTTP has few codes).
async fn count_responses(req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    metrics::counter!(HTTP_RESPONSES_TOTAL, "code" => r.status().as_str().to_owned()).increment(1);
    r
}

async fn method_not_allowed(req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    if r.status() == StatusCode::METHOD_NOT_ALLOWED {
        return Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            problems::METHOD_NOT_ALLOWED,
            "Method not allowed",
            "see /openapi.json",
        )
        .into_response();
    }
    r
}

/// The whole application: `/v1` (bearer auth, then the idempotency layer), `/admin`, the
/// operator console (`/console`), and the operational routes.
pub fn router(state: AppState, idempotency: IdempotencyLayer, console: crate::console::Console) -> Router {
    let v1 = Router::new()
        .route("/v1/workers", post(create_worker).get(list_workers))
        .route("/v1/workers/{id}", get(get_worker).delete(delete_worker))
        .route("/v1/workers/{id}/reboot", post(reboot_worker))
        .layer(idempotency.clone())
        .layer(middleware::from_fn_with_state(state.clone(), rate_limit))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    let admin = Router::new()
        .route("/admin/v1/fleet", get(fleet))
        .route("/admin/v1/nodes/{node_id}/firmware", post(flash_firmware))
        .route("/admin/v1/operations/{op_id}", get(get_operation))
        .route("/admin/v1/records", get(list_records))
        .route("/admin/v1/records/{id}", get(get_record).merge(delete(forget_record)))
        .layer(idempotency)
        .layer(middleware::from_fn_with_state(state.clone(), authenticate_admin));
    Router::new()
        .merge(v1)
        .merge(admin)
        .merge(crate::console::routes(console))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .layer(middleware::from_fn(method_not_allowed))
        .layer(middleware::from_fn_with_state(state.probe.clone(), crate::outage::store_deadline))
        .layer(middleware::from_fn(count_responses))
        .with_state(state)
}
