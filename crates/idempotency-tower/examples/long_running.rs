//! A long-running operation behind the layer: the record completes at acceptance (`202` +
//! `Location`), the work goes on, and every retry of the key attaches to the same operation.
//!
//! ```text
//! cargo run -p idempotency-tower --example long_running
//! curl -i -X POST localhost:3001/v1/flashes -H 'X-User: ops' -H 'Idempotency-Key: f-1' -H 'content-type: application/json' -d '{"version":"2.1"}'
//! curl -i -X POST localhost:3001/v1/flashes -H 'X-User: ops' -H 'Idempotency-Key: f-1' -H 'content-type: application/json' -d '{"version":"2.1"}'  # the same 202, replayed
//! curl -i localhost:3001/v1/operations/op-...   # running, then succeeded
//! ```
//!
//! The pattern, in four rules:
//! 1. The operation's id is derived from the record ([`IdempotencyContext::derive`]), so every
//!    attempt of the key computes the same one, on any replica.
//! 2. The operation is created with that id *if absent* before any work starts, and the work is
//!    started only by the attempt that created it.
//! 3. The handler answers `202` with `Location` as soon as the work is accepted: the layer stores
//!    that answer and completes the record, so retries replay it at once, while the work runs
//!    and after. The operation's own state lives at the `Location`, not in the record.
//! 4. A retry that arrives before the `202` is stored gets `409 request-in-progress`;
//!    [`IdempotencyLayerBuilder::operation_link`](idempotency_tower::IdempotencyLayerBuilder::operation_link)
//!    adds a `Link: <...>; rel="monitor"` to it, so the client can follow the operation already.
//!
//! Here the operations live in memory and a spawned task does the work. A real service keeps
//! them as rows and follows them with a watcher that resumes after a restart (leasebroker's
//! firmware flashes do: see its `firmware` module).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency::{MemoryStore, Principal};
use idempotency_tower::{IdempotencyContext, IdempotencyLayer};
use serde_json::{Value, json};

/// The operations, by id: their state as the API shows it.
type Operations = Arc<Mutex<HashMap<String, Value>>>;

async fn start_flash(State(ops): State<Operations>, ctx: IdempotencyContext, Json(body): Json<Value>) -> Response {
    let id = format!("op-{}", ctx.derive("op"));
    let created = {
        let mut ops = ops.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let created = !ops.contains_key(&id);
        ops.entry(id.clone()).or_insert_with(|| json!({"id": id, "state": "running", "version": body["version"]}));
        created
    };
    if created {
        let (ops, id) = (ops.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await; // the long part
            if let Some(op) = ops.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_mut(&id) {
                op["state"] = json!("succeeded");
            }
        });
    }
    let op = ops.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id).cloned().unwrap_or_default();
    (StatusCode::ACCEPTED, [(header::LOCATION, format!("/v1/operations/{id}"))], Json(op)).into_response()
}

async fn get_operation(State(ops): State<Operations>, Path(id): Path<String>) -> Response {
    match ops.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&id) {
        Some(op) => Json(op.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let store = Arc::new(MemoryStore::new());
    let layer = IdempotencyLayer::builder(store)
        .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(Principal::new))
        .operation_link(|record| Some(format!("/v1/operations/op-{}", record.derive("op"))))
        .build();
    let ops = Operations::default();
    let app = Router::new()
        .route("/v1/flashes", post(start_flash))
        .route("/v1/operations/{id}", get(get_operation))
        .with_state(ops)
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}
