//! The layer's overhead on a trivial handler, through `oneshot`, with the memory store:
//! no layer, the first execution of a fresh key (claim + complete) and a replay (claim).
//!
//! `cargo bench -p idempotency-tower --bench layer`

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use criterion::{Criterion, criterion_main};
use http_body_util::BodyExt;
use idempotency::{MemoryStore, Principal};
use idempotency_tower::IdempotencyLayer;
use tower::ServiceExt;

async fn handler() -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    (StatusCode::CREATED, [("content-type", "application/json")], r#"{"id":"wkr-1","state":"booting"}"#)
}

fn bare() -> Router {
    Router::new().route("/v1/workers", post(handler))
}

fn layered() -> Router {
    // No authentication here: every request shares one (explicitly allowed) anonymous scope.
    bare()
        .layer(IdempotencyLayer::builder(Arc::new(MemoryStore::new())).allow_anonymous(Principal::new("bench")).build())
}

fn request(key: &str) -> Request<Body> {
    Request::post("/v1/workers")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(r#"{"image":"worker-base","cpu":16,"memory_gb":64}"#))
        .expect("request")
}

async fn call(app: &Router, key: &str) {
    let res = app.clone().oneshot(request(key)).await.expect("infallible");
    assert!(res.status().is_success());
    let _ = res.into_body().collect().await.expect("body");
}

/// Runs `iters` requests inside a task on a runtime worker, as a server would, and times them.
/// Each measurement gets a fresh router and store, so the store holds at most `iters` records.
async fn measure(iters: u64, app: Router, fresh_keys: bool) -> Duration {
    tokio::spawn(async move {
        call(&app, "warm").await;
        let mut key = String::with_capacity(32);
        let start = Instant::now();
        for i in 0..iters {
            key.clear();
            if fresh_keys {
                use std::fmt::Write;
                let _ = write!(key, "op-{i}");
            } else {
                key.push_str("warm");
            }
            call(&app, &key).await;
        }
        start.elapsed()
    })
    .await
    .expect("bench task")
}

fn bench(c: &mut Criterion) {
    // A protected request spawns a task; on a multi-threaded runtime with an idle worker that
    // also costs a cross-thread wake-up, which a single-threaded runtime does not pay.
    let runtimes = [
        ("multi_thread", tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()),
        ("current_thread", tokio::runtime::Builder::new_current_thread().enable_all().build()),
    ];
    for (name, rt) in runtimes {
        let rt = rt.expect("runtime");
        let mut g = c.benchmark_group(format!("layer/{name}"));
        g.bench_function("bare_handler", |b| b.to_async(&rt).iter_custom(|iters| measure(iters, bare(), true)));
        g.bench_function("first_execution", |b| b.to_async(&rt).iter_custom(|iters| measure(iters, layered(), true)));
        g.bench_function("replay", |b| b.to_async(&rt).iter_custom(|iters| measure(iters, layered(), false)));
        g.finish();
    }
}

/// Every benchmark of this file, for `criterion_main!`. Written out rather than made by
/// `criterion_group!`, whose undocumented `pub fn` the workspace's `missing_docs` lint refuses.
fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
}

criterion_main!(benches);
