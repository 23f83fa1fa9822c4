//! Adopting the layer: an axum app whose POST handler has a side effect, made safe to retry.
//!
//! ```text
//! cargo run -p idempotency-tower --example adopt
//! curl -i -X POST localhost:3000/v1/boots -H 'X-User: alice' -H 'Idempotency-Key: "op-1"' -d '{"image":"base"}'
//! curl -i -X POST localhost:3000/v1/boots -H 'X-User: alice' -H 'Idempotency-Key: "op-1"' -d '{"image":"base"}'  # replayed
//! curl -i -X POST localhost:3000/v1/boots -H 'X-User: alice' -H 'Idempotency-Key: "op-1"' -d '{"image":"other"}' # 409 reused
//! curl -i -X POST localhost:3000/v1/boots -H 'Idempotency-Key: "op-1"' -d '{"image":"base"}'  # 401 principal-missing
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use idempotency::{MemoryStore, Principal};
use idempotency_tower::{IdempotencyContext, IdempotencyLayer, spawn_sweeper};

/// The side effect: how many VMs this process booted.
static BOOTS: AtomicU64 = AtomicU64::new(0);

async fn boot(State(name): State<&'static str>, ctx: IdempotencyContext) -> (StatusCode, String) {
    // A real handler passes this sub-key to the downstream so a retry finds the same boot.
    let boot_id = ctx.derive("boot");
    let n = BOOTS.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("{{\"service\":\"{name}\",\"boot_id\":\"{boot_id}\",\"boots_total\":{n}}}\n"))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let store = Arc::new(MemoryStore::new());
    spawn_sweeper(store.clone(), Duration::from_secs(60));
    let layer = IdempotencyLayer::builder(store)
        // Stands in for real authentication: records are scoped to whoever the request runs as.
        .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(Principal::new))
        .retention(Duration::from_secs(24 * 60 * 60))
        .build();
    let app = Router::new().route("/v1/boots", post(boot)).with_state("adopt").layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}
