//! What every test module shares: a response read whole ([`Answer`]), requests, layers over a
//! memory store, and the counting routes whose handlers count their own side effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{Endpoint, IdempotencyKey, MemoryStore, Principal, Scope, Store};
use idempotency_tower::{IdempotencyLayer, IdempotencyLayerBuilder};
use tower::ServiceExt;

/// A response, read whole.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Answer {
    pub(crate) fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }

    pub(crate) fn problem_type(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json", "{self:?}");
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem body is JSON");
        assert_eq!(v["status"], self.status.as_u16(), "{v}");
        assert!(v["title"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
        assert!(v["detail"].as_str().is_some(), "{v}");
        v["type"].as_str().expect("type").to_owned()
    }

    pub(crate) fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("utf-8 body")
    }
}

pub(crate) async fn send(app: &Router, req: Request<Body>) -> Answer {
    let res = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = res.into_parts();
    Answer { status: parts.status, headers: parts.headers, body: body.collect().await.expect("body").to_bytes() }
}

pub(crate) fn post_req(path: &str, key: Option<&str>, body: &'static str) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body)).expect("request")
}

pub(crate) fn store() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new())
}

/// A layer over `store` where requests without a principal share the scope `anonymous`
/// (the explicit opt-in; without it they are refused).
pub(crate) fn builder(store: &Arc<MemoryStore>) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store.clone() as Arc<dyn Store>).allow_anonymous(idempotency::Principal::new("anonymous"))
}

/// `store`, but every claim renewal fails: a claim goes stale after its TTL even while its
/// handler still runs, as a hung or partitioned attempt's would.
pub(crate) fn unrenewed<S: Store>(store: S) -> Arc<dyn Store> {
    let faulty = idempotency::faulty::FaultyStore::new(store);
    faulty.fail_always(idempotency::faulty::Op::Heartbeat);
    Arc::new(faulty)
}

/// A router whose POST /v1/things and /v1/other count calls and answer 201 with the count.
pub(crate) fn counting_app(layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |body: Bytes| async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                [("content-type", "application/json"), ("location", "/v1/things/1")],
                format!("{{\"call\":{n},\"echo\":{}}}", String::from_utf8_lossy(&body)),
            )
        }
    };
    let app = Router::new()
        .route("/v1/things", post(handler.clone()).get(handler.clone()).put(handler.clone()))
        .route("/v1/other", post(handler))
        .layer(layer);
    (app, calls)
}

pub(crate) fn post_key(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .expect("request")
}

/// Every request runs as principal `p`.
pub(crate) fn builder_for_p(store: Arc<dyn Store>) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store).principal(|_| Some(Principal::new("p")))
}

pub(crate) fn scope(path: &str, key: &str) -> Scope {
    Scope::new(Principal::new("p"), Endpoint::new("POST", path), IdempotencyKey::try_from(key).expect("key"))
}

/// A handler that counts its calls and answers `201 call <n>` after `delay`.
pub(crate) fn counting_route(path: &str, delay: Duration, layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            path,
            post(move || async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                (StatusCode::CREATED, [("content-type", "text/plain")], format!("call {n}"))
            }),
        )
        .layer(layer);
    (app, calls)
}

/// Polls `cond` every 20 ms until it holds; panics after a generous `timeout`.
pub(crate) async fn wait_until(what: &str, timeout: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
