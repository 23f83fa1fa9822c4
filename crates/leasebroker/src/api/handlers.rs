//! One handler per route.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idempotency::ErrorChain;
use idempotency::Principal;
use idempotency_tower::{IdempotencyContext, Problem};
use leasebroker_api::problems;

use crate::service::{CreateWorker, FlashFirmware, RequestRecord, ServiceError, is_worker_id};
use leasebroker_api::ResolveOperation;

use super::problems::parse_json;
use super::*;

/// Creates a worker.
#[utoipa::path(post, path = "/v1/workers", tag = "workers",
    request_body = CreateWorker,
    params(("Idempotency-Key" = String, Header, description = "One key per logical operation, 1-128 visible ASCII")),
    responses(
        (status = 201, description = "Created (or replayed, with Idempotent-Replayed: true)", body = Worker,
         headers(("Location" = String, description = "/v1/workers/{id}"))),
        (status = 400, description = "Malformed JSON, or a missing or invalid key", content_type = "application/problem+json"),
        (status = 401, description = "Unauthorized", content_type = "application/problem+json"),
        (status = 403, description = "The principal holds its worker quota (not stored)", content_type = "application/problem+json"),
        (status = 409, description = "Key reused with another request, or in progress", content_type = "application/problem+json"),
        (status = 413, description = "Body over 1 MiB", content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", content_type = "application/problem+json"),
        (status = 410, description = "The worker this key created was deleted since", content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields", content_type = "application/problem+json"),
        (status = 429, description = "too-many-requests: over the principal's --rate-limit or --max-records-per-principal; nothing stored", content_type = "application/problem+json"),
        (status = 502, description = "Hypervisor refused (nothing held; not stored)", content_type = "application/problem+json"),
        (status = 503, description = "No free node, or hypervisor unavailable", content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn create_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: IdempotencyContext,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CreateWorker = parse_json(&headers, &body, state.body_key_field)?;
    let op = RequestRecord::new(ctx.claim().record().clone());
    let worker = Worker::try_from(state.workers.create(&principal, &req, &op).await?)?;
    let location = format!("/v1/workers/{}", worker.id);
    Ok(located(StatusCode::CREATED, Json(worker), &location))
}

/// `status` with `body` and `Location: location`.
fn located(status: StatusCode, body: impl IntoResponse, location: &str) -> Response {
    let mut r = (status, body).into_response();
    if let Ok(v) = HeaderValue::from_str(location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// Reads one of the caller's workers.
#[utoipa::path(get, path = "/v1/workers/{id}", tag = "workers",
    params(("id" = String, Path, description = "Worker id")),
    responses((status = 200, body = Worker), (status = 401, description = "Unauthorized"), (status = 404, description = "No such worker")),
    security(("bearer" = [])))]
pub async fn get_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let Ok(worker) = id.parse::<WorkerId>() else { return Err(ServiceError::NotFound(id).into()) };
    match state.workers.domain.worker(&principal, &worker).await? {
        Some(w) => Ok(Json(Worker::try_from(w)?).into_response()),
        None => Err(ServiceError::NotFound(id).into()),
    }
}

/// Lists the caller's workers, a page at a time.
#[utoipa::path(get, path = "/v1/workers", tag = "workers", params(ListQuery),
    responses((status = 200, body = WorkerPage), (status = 400, description = "A bad limit or cursor"), (status = 401, description = "Unauthorized")),
    security(("bearer" = [])))]
pub async fn list_workers(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let invalid =
        |detail: String| Problem::new(StatusCode::BAD_REQUEST, problems::INVALID_QUERY, "Invalid query", detail);
    let Ok(Query(q)) = query else { return Err(invalid("limit must be a number".into()).into()) };
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(invalid(format!("limit must be 1 to {MAX_PAGE}")).into());
    }
    // A cursor is the last worker id of a page; anything else would read as an empty last page.
    let cursor = match q.cursor.map(WorkerId::try_from).transpose() {
        Ok(cursor) if cursor.as_ref().is_none_or(|c| is_worker_id(c.as_str())) => cursor,
        _ => return Err(invalid("cursor is not a cursor this listing gave out".into()).into()),
    };
    let rows = state.workers.domain.list_workers(&principal, limit, cursor.as_ref()).await?;
    let next_cursor = (rows.len() == limit as usize).then(|| rows.last().map(|w| w.worker_id.to_string())).flatten();
    let workers = rows.into_iter().map(Worker::try_from).collect::<Result<_, _>>()?;
    Ok(Json(WorkerPage { workers, next_cursor }).into_response())
}

/// Deletes a worker, its lease, node allocation and VM.
#[utoipa::path(delete, path = "/v1/workers/{id}", tag = "workers",
    params(("id" = String, Path, description = "Worker id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation")),
    responses((status = 204, description = "Deleted (replayed on every retry)"), (status = 401, description = "Unauthorized"),
              (status = 429, description = "too-many-requests: over the principal's --rate-limit or --max-records-per-principal; nothing stored"),
              (status = 404, description = "No such worker"), (status = 503, description = "Hypervisor unavailable")),
    security(("bearer" = [])))]
pub async fn delete_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let Ok(worker) = id.parse::<WorkerId>() else { return Err(ServiceError::NotFound(id).into()) };
    let op = RequestRecord::new(ctx.claim().record().clone());
    state.workers.delete(&principal, &worker, &op).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Reboots a worker: once per key, ever.
#[utoipa::path(post, path = "/v1/workers/{id}/reboot", tag = "workers",
    params(("id" = String, Path, description = "Worker id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation")),
    responses((status = 202, body = RebootResult), (status = 401, description = "Unauthorized"),
              (status = 429, description = "too-many-requests: over the principal's --rate-limit or --max-records-per-principal; nothing stored"),
              (status = 404, description = "No such worker"), (status = 502, description = "Hypervisor refused"),
              (status = 503, description = "Hypervisor unavailable")),
    security(("bearer" = [])))]
pub async fn reboot_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let Ok(id) = id.parse::<WorkerId>() else { return Err(ServiceError::NotFound(id).into()) };
    let op = RequestRecord::new(ctx.claim().record().clone());
    let reboot_count = state.workers.reboot(&principal, &id, &op).await?;
    let reboot_count = u64::try_from(reboot_count).unwrap_or(0);
    Ok((StatusCode::ACCEPTED, Json(RebootResult { id, reboot_count })).into_response())
}

/// Starts a firmware flash: an operation, answered `202` as soon as the BMC accepted it.
#[utoipa::path(post, path = "/admin/v1/nodes/{node_id}/firmware", tag = "admin",
    request_body = FlashFirmware,
    params(("node_id" = String, Path, description = "Node id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation, 1-128 visible ASCII")),
    responses(
        (status = 202, description = "Accepted (or replayed, with Idempotent-Replayed: true, while the flash runs or after)",
         body = dto::Operation, headers(("Location" = String, description = "/admin/v1/operations/{op_id}"))),
        (status = 400, description = "Malformed JSON, or a missing or invalid key", content_type = "application/problem+json"),
        (status = 401, description = "Unauthorized", content_type = "application/problem+json"),
        (status = 404, description = "No such node", content_type = "application/problem+json"),
        (status = 409, description = "Another operation runs on the node (operation-conflict, naming it in operation_id), \
         a worker holds the node and the body does not say \"force\": true (node-in-use), \
         or the key was reused with another request, or is in progress", content_type = "application/problem+json"),
        (status = 413, description = "Body over 1 MiB", content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", content_type = "application/problem+json"),
        (status = 422, description = "Invalid version", content_type = "application/problem+json"),
        (status = 503, description = "The BMC is unavailable or an earlier call may still land; retry with the same key",
         content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn flash_firmware(
    State(state): State<AppState>,
    ctx: IdempotencyContext,
    Path(node_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: FlashFirmware = parse_json(&headers, &body, state.body_key_field)?;
    let op = RequestRecord::new(ctx.claim().record().clone());
    if state.firmware.refuses_in_use(&node_id, &req, &op).await? {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            problems::NODE_IN_USE,
            "Node in use",
            "a worker holds this node and a flash would disrupt it; delete the worker first, or send \
             \"force\": true to flash anyway",
        )
        .into());
    }
    let operation = dto::Operation::try_from(state.firmware.flash(&node_id, &req, &op).await?)?;
    let location = crate::firmware::operation_location(&operation.id);
    Ok(located(StatusCode::ACCEPTED, Json(operation), &location))
}

/// Reads an operation.
#[utoipa::path(get, path = "/admin/v1/operations/{op_id}", tag = "admin",
    params(("op_id" = String, Path, description = "Operation id")),
    responses((status = 200, body = dto::Operation), (status = 401, description = "Unauthorized"),
              (status = 404, description = "No such operation")),
    security(("bearer" = [])))]
pub async fn get_operation(State(state): State<AppState>, Path(op_id): Path<String>) -> Result<Response, ApiError> {
    let Ok(op) = op_id.parse::<OperationId>() else { return Err(ServiceError::NoSuchOperation(op_id).into()) };
    match state.workers.domain.flash_operation(&op).await? {
        Some(row) => Ok(Json(dto::Operation::try_from(row)?).into_response()),
        None => Err(ServiceError::NoSuchOperation(op_id).into()),
    }
}

/// Ends an `uncertain` operation as an operator found the machine.
#[utoipa::path(post, path = "/admin/v1/operations/{op_id}/resolve", tag = "admin",
    request_body = ResolveOperation,
    params(("op_id" = String, Path, description = "Operation id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation, 1-128 visible ASCII")),
    responses(
        (status = 200, description = "Resolved: the operation, now succeeded or failed (replayed, with \
         Idempotent-Replayed: true, to a retry with the same key); an audit line was written", body = dto::Operation),
        (status = 400, description = "Malformed JSON, or a missing or invalid key", content_type = "application/problem+json"),
        (status = 401, description = "Unauthorized (tenants too)", content_type = "application/problem+json"),
        (status = 404, description = "No such operation", content_type = "application/problem+json"),
        (status = 409, description = "The operation is not uncertain (operation-not-uncertain, naming it in \
         operation_id), or the key was reused with another request, or is in progress", content_type = "application/problem+json"),
        (status = 415, description = "Not JSON", content_type = "application/problem+json"),
        (status = 422, description = "A state other than succeeded or failed, or an invalid reason",
         content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn resolve_operation(
    State(state): State<AppState>,
    Extension(actor): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(op_id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ResolveOperation = parse_json(&headers, &body, state.body_key_field)?;
    let row = state.firmware.resolve(&op_id, &req, actor.as_str(), ctx.key().as_str()).await?;
    Ok(Json(dto::Operation::try_from(row)?).into_response())
}

/// Fleet counts, for operators and the fault harness.
#[utoipa::path(get, path = "/admin/v1/fleet", tag = "admin",
    responses((status = 200, body = Fleet), (status = 401, description = "Unauthorized")),
    security(("bearer" = [])))]
pub async fn fleet(State(state): State<AppState>) -> Result<Json<Fleet>, ApiError> {
    Ok(Json(fleet_snapshot(&state).await?))
}

/// The fleet's counts from the domain tables and the VMs running on the hypervisor: what
/// `GET /admin/v1/fleet` answers and the console shows.
pub async fn fleet_snapshot(state: &AppState) -> Result<Fleet, ServiceError> {
    let counts = state.workers.domain.counts().await?;
    let vms_running = match state.hypervisor.list_all().await {
        Ok(vms) => vms.iter().filter(|v| v.state == "running").count(),
        Err(e) => {
            return Err(ServiceError::upstream(format!("cannot list VMs: {}", ErrorChain(&e))));
        }
    };
    Ok(dto::fleet_from_counts(counts, vms_running))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "Up")))]
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// How long `/readyz` waits for the store's answer.
const READYZ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The store did not answer `/readyz`'s ping in time.
#[derive(Debug, thiserror::Error)]
#[error("the store did not answer within {READYZ_TIMEOUT:?}")]
struct PingTimedOut;

/// The store answers: for a Redis Cluster record store, at least one primary answers and takes
/// writes (the others' keys get `503` per request; see the idempotency-redis crate docs).
#[utoipa::path(get, path = "/readyz", tag = "ops", responses((status = 200, description = "Ready"), (status = 503, description = "Store unreachable")))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    // Bounded: a store that does not answer at all is not ready either (docs/protocol.md#running-leasebroker, within 5 s).
    let ping = tokio::time::timeout(READYZ_TIMEOUT, state.store.ping())
        .await
        .unwrap_or_else(|_| Err(idempotency::StoreError::unavailable(PingTimedOut)));
    match ping {
        Ok(()) => "ready\n".into_response(),
        // Unauthenticated: the error (a driver message, maybe a host name) goes to the log only.
        Err(e) => {
            tracing::warn!(error = %ErrorChain(&e), "not ready: the store does not answer");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                idempotency::problems::STORE_UNAVAILABLE,
                "Not ready",
                "the store does not answer",
            )
            .with_retry_after(1)
            .into_response()
        }
    }
}

/// Prometheus text.
#[utoipa::path(get, path = "/metrics", tag = "ops", responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}
