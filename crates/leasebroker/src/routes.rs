//! The router: the API's handlers and middleware ([`crate::api`]) and the OpenAPI document that
//! describes them ([`crate::openapi`]), put together. Each documented handler is registered once,
//! with [`utoipa_axum::routes!`], which gives both its route and its part of the document.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use idempotency_tower::{IdempotencyLayer, Problem};
use leasebroker_api::problems;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{
    self, AppState, admin_share, authenticate, authenticate_admin, console_share, own_deletes_pass, rate_limit,
    tenant_share,
};
use crate::openapi::ApiDoc;

/// The OpenAPI document, built once when the router is.
async fn openapi(document: Arc<utoipa::openapi::OpenApi>) -> Response {
    Json(&*document).into_response()
}

async fn not_found() -> Response {
    Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "Not found", "no such route").into_response()
}

/// Counts every response under its status code (a bounded label: HTTP has few codes).
async fn count_responses(req: Request, next: Next) -> Response {
    let r = next.run(req).await;
    metrics::counter!(crate::metric::HTTP_RESPONSES_TOTAL, "code" => r.status().as_str().to_owned()).increment(1);
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

/// The whole application: `/v1` (bearer auth, the rate limit, the principal's share, then the
/// idempotency layer), `/admin`, the operator console (`/console`), and the operational routes,
/// which take no share (`crate::api::shares`): they never wait behind tenant work.
pub fn router(state: AppState, idempotency: IdempotencyLayer, console: crate::console::Console) -> Router {
    // Handlers that share a path share a `routes!`. Layers run from the last added to the first.
    let v1 = OpenApiRouter::default()
        .routes(routes!(api::create_worker, api::list_workers))
        .routes(routes!(api::get_worker, api::delete_worker))
        .routes(routes!(api::reboot_worker))
        .layer(idempotency.clone())
        .layer(middleware::from_fn_with_state(state.clone(), own_deletes_pass))
        .layer(middleware::from_fn_with_state(state.clone(), tenant_share))
        .layer(middleware::from_fn_with_state(state.clone(), rate_limit))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    let admin = OpenApiRouter::default()
        .routes(routes!(api::fleet))
        .routes(routes!(api::flash_firmware))
        .routes(routes!(api::get_operation))
        .routes(routes!(api::resolve_operation))
        .routes(routes!(api::list_records))
        .routes(routes!(api::get_record, api::forget_record))
        .layer(idempotency)
        .layer(middleware::from_fn_with_state(state.clone(), admin_share))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate_admin));
    let console = crate::console::routes(console).layer(middleware::from_fn_with_state(state.clone(), console_share));
    let (routes, collected) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(v1)
        .merge(admin)
        .merge(console.into())
        .routes(routes!(api::healthz))
        .routes(routes!(api::readyz))
        .routes(routes!(api::metrics))
        .split_for_parts();
    let document = Arc::new(crate::openapi::finish(collected));
    routes
        .route("/openapi.json", get(move || openapi(document.clone())))
        .fallback(not_found)
        .layer(middleware::from_fn(method_not_allowed))
        .layer(middleware::from_fn_with_state(state.probe.clone(), crate::outage::store_deadline))
        .layer(middleware::from_fn(count_responses))
        .with_state(state)
}
