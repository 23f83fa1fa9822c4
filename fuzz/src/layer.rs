//! The request path through `IdempotencyLayer`: an in-process axum app with the layer over a
//! `MemoryStore`, driven by `tower::ServiceExt::oneshot` with a sequence of arbitrary requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arbitrary::Arbitrary;
use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{IdempotencyKey, MemoryStore, Principal, Store};
use idempotency_tower::{FingerprintMode, IdempotencyLayer, RoutePolicy};
use tower::ServiceExt;

/// A small limit, so that inputs can cross it.
const BODY_LIMIT: usize = 512;
/// Set on every response the handler makes (and never replayed): whatever lacks it came from
/// the layer or a replay.
const FROM_HANDLER: &str = "x-from-handler";
const USER: &str = "x-user";
/// At most this many requests per input, all against one fresh app and store.
const MAX_STEPS: usize = 8;

/// One input: the layer's fingerprint mode and a sequence of requests.
#[derive(Debug, Arbitrary)]
pub struct Input {
    canonical: bool,
    steps: Vec<Step>,
}

/// One request, or a resend of the previous one.
#[derive(Debug, Clone, Arbitrary)]
pub struct Step {
    resend_previous: bool,
    method: MethodChoice,
    path: PathChoice,
    path_suffix: Option<String>,
    query: Option<String>,
    user: Option<u8>,
    key: KeyChoice,
    content_type: Option<Vec<u8>>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    /// A body this many bytes around the limit instead (`limit - 16 + n % 32`).
    near_limit: Option<u8>,
}

#[derive(Debug, Clone, Arbitrary)]
enum MethodChoice {
    Get,
    Head,
    Options,
    Post,
    Put,
    Patch,
    Delete,
    Other(Vec<u8>),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum PathChoice {
    /// Required, the handler answers 201.
    Things,
    /// Optional.
    Optional,
    /// Off.
    Off,
    /// Required, the handler answers 500.
    Fail,
    /// Anything else (the router's fallback, which is the handler too).
    Other,
}

#[derive(Debug, Clone, Arbitrary)]
enum KeyChoice {
    Absent,
    /// One of a few keys, so that requests collide.
    Pool(u8),
    /// The same pool, in the structured (quoted) form.
    Quoted(u8),
    Raw(Vec<u8>),
    /// The header twice.
    Twice(u8, u8),
}

fn pool_key(n: u8) -> String {
    format!("k-{}", n % 4)
}

fn method(m: &MethodChoice) -> Option<Method> {
    Some(match m {
        MethodChoice::Get => Method::GET,
        MethodChoice::Head => Method::HEAD,
        MethodChoice::Options => Method::OPTIONS,
        MethodChoice::Post => Method::POST,
        MethodChoice::Put => Method::PUT,
        MethodChoice::Patch => Method::PATCH,
        MethodChoice::Delete => Method::DELETE,
        MethodChoice::Other(b) => Method::from_bytes(b).ok()?,
    })
}

fn base_path(p: PathChoice) -> &'static str {
    match p {
        PathChoice::Things => "/v1/things",
        PathChoice::Optional => "/v1/opt",
        PathChoice::Off => "/v1/off",
        PathChoice::Fail => "/v1/fail",
        PathChoice::Other => "/elsewhere",
    }
}

fn policy(path: &str) -> RoutePolicy {
    match path {
        "/v1/opt" => RoutePolicy::Optional,
        "/v1/off" => RoutePolicy::Off,
        _ => RoutePolicy::Required,
    }
}

/// The request a step describes, or `None` when its method, URI or a header is not valid HTTP
/// (the `http` crate refuses to build it, so no server would ever see it).
fn build(step: &Step) -> Option<Request<Body>> {
    let mut uri = base_path(step.path).to_owned();
    uri.push_str(step.path_suffix.as_deref().unwrap_or(""));
    if let Some(q) = &step.query {
        uri.push('?');
        uri.push_str(q);
    }
    let mut b = Request::builder().method(method(&step.method)?).uri(uri);
    if let Some(u) = step.user {
        b = b.header(USER, format!("user-{}", u % 3));
    }
    match &step.key {
        KeyChoice::Absent => {}
        KeyChoice::Pool(n) => b = b.header("idempotency-key", pool_key(*n)),
        KeyChoice::Quoted(n) => b = b.header("idempotency-key", format!("\"{}\"", pool_key(*n))),
        KeyChoice::Raw(raw) => b = b.header("idempotency-key", HeaderValue::from_bytes(raw).ok()?),
        KeyChoice::Twice(x, y) => {
            b = b.header("idempotency-key", pool_key(*x)).header("idempotency-key", pool_key(*y));
        }
    }
    if let Some(ct) = &step.content_type {
        b = b.header(http::header::CONTENT_TYPE, HeaderValue::from_bytes(ct).ok()?);
    }
    for (name, value) in &step.headers {
        let name = HeaderName::from_bytes(name).ok()?;
        // Those two drive the bookkeeping below; the arbitrary ones stay out of its way.
        if name == USER || name == "idempotency-key" {
            continue;
        }
        b = b.header(name, HeaderValue::from_bytes(value).ok()?);
    }
    let body = match step.near_limit {
        Some(n) => vec![b'x'; BODY_LIMIT - 16 + usize::from(n % 32)],
        None => step.body.clone(),
    };
    b.body(Body::from(body)).ok()
}

/// The record a request is filed under, when the layer protects it: (principal, method, path,
/// key). `None` for requests the layer lets through or refuses before it claims anything.
fn scope_of(req: &Request<Body>) -> Option<(String, String, String, String)> {
    if !matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH | Method::DELETE) {
        return None;
    }
    let path = req.uri().path();
    if policy(path) == RoutePolicy::Off {
        return None;
    }
    let mut keys = req.headers().get_all("idempotency-key").iter();
    let key = IdempotencyKey::parse_header(keys.next()?.as_bytes()).ok()?;
    if keys.next().is_some() {
        return None;
    }
    let user = req.headers().get(USER)?.to_str().ok()?.to_owned();
    // Every spelling of one path is one record: the layer files it under the normalized path.
    let path = idempotency::normalize_path(path).into_owned();
    Some((user, req.method().to_string(), path, key.as_str().to_owned()))
}

fn app(canonical: bool) -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mode = if canonical { FingerprintMode::CanonicalJson } else { FingerprintMode::Raw };
    let layer = IdempotencyLayer::builder(store)
        .principal(|parts| parts.headers.get(USER)?.to_str().ok().map(Principal::new))
        .policy(|_, path| policy(path))
        .fingerprint_mode(mode)
        .body_limit(BODY_LIMIT)
        .build();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = move |req: Request<Body>| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let user = req.headers().get(USER).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let status =
                if req.uri().path() == "/v1/fail" { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::CREATED };
            let len = req.into_body().collect().await.map(|b| b.to_bytes().len()).unwrap_or(0);
            let body = serde_json::json!({"call": n, "user": user, "len": len}).to_string();
            (status, [("content-type", "application/json"), (FROM_HANDLER, "1")], body).into_response()
        }
    };
    Router::new().route("/v1/{*rest}", any(handler.clone())).fallback(handler).layer(layer)
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
}

/// Never panics; no 5xx except the handler's own; every other error is problem+json; a replay
/// is byte for byte the response its record stored, for the same principal, and a completed
/// record never runs the handler again.
pub fn check(input: &Input) {
    RUNTIME.with(|rt| rt.block_on(run(input)));
}

async fn run(input: &Input) {
    let app = app(input.canonical);
    // Scope -> the body the handler answered with when it ran for that record.
    let mut stored: HashMap<(String, String, String, String), bytes::Bytes> = HashMap::new();
    let mut previous: Option<&Step> = None;
    for step in input.steps.iter().take(MAX_STEPS) {
        let step = match previous {
            Some(p) if step.resend_previous => p,
            _ => step,
        };
        previous = Some(step);
        let Some(req) = build(step) else { continue };
        let scope = scope_of(&req);
        let user = req.headers().get(USER).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let res: Response = app.clone().oneshot(req).await.expect("the router is infallible");
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("the body is readable").to_bytes();
        let status = parts.status;
        let from_handler = parts.headers.contains_key(FROM_HANDLER);
        let replayed = parts.headers.get("idempotent-replayed").is_some_and(|v| v == "true");
        let shown = || format!("{status} {parts:?} {}", String::from_utf8_lossy(&body));

        if status.is_server_error() {
            assert!(from_handler, "a 5xx that the handler did not send: {}", shown());
        }
        if status.is_client_error() && !from_handler {
            assert_problem(status, &parts.headers, &body);
        }
        if replayed {
            let scope = scope.as_ref().unwrap_or_else(|| panic!("a replay of an unprotected request: {}", shown()));
            let original = stored.get(scope).unwrap_or_else(|| panic!("a replay of nothing stored: {}", shown()));
            assert_eq!(&body, original, "the replay differs from what was stored");
            let v: serde_json::Value = serde_json::from_slice(&body).expect("the handler's JSON");
            assert_eq!(v["user"].as_str(), user.as_deref(), "a replay of another principal's response");
        } else if from_handler && status.is_success() {
            if let Some(scope) = scope {
                assert!(!stored.contains_key(&scope), "the handler ran twice for one completed record: {}", shown());
                stored.insert(scope, body);
            }
        }
    }
}

fn assert_problem(status: StatusCode, headers: &http::HeaderMap, body: &[u8]) {
    assert_eq!(
        headers.get(http::header::CONTENT_TYPE).map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..]),
        "{status} without problem+json: {}",
        String::from_utf8_lossy(body)
    );
    let v: serde_json::Value = serde_json::from_slice(body).expect("a problem is JSON");
    assert_eq!(v["status"].as_u64(), Some(u64::from(status.as_u16())), "{v}");
    for field in ["type", "title", "detail"] {
        assert!(v[field].is_string(), "problem without {field}: {v}");
    }
    assert!(v["type"].as_str().is_some_and(|t| t.rsplit('/').next().is_some_and(|n| !n.is_empty())), "{v}");
}
