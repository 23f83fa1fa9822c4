//! Long-running operations behind the layer (issue 15): the record completes at acceptance, the
//! work goes on, retries replay the `202` at once, and a retry that comes before the `202` is
//! stored gets `409 request-in-progress` with a `Link` to the operation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use idempotency::{MemoryStore, Principal};
use idempotency_tower::{IdempotencyContext, IdempotencyLayer};
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct App {
    /// Operation id -> finished.
    ops: Arc<Mutex<HashMap<String, bool>>>,
    /// Works started (the side effect counted).
    started: Arc<AtomicUsize>,
    /// Holds the accept phase until the test lets it go.
    accept: Arc<Semaphore>,
    /// Holds the long part until the test lets it go.
    finish: Arc<Semaphore>,
}

impl Default for App {
    fn default() -> Self {
        Self {
            ops: Arc::default(),
            started: Arc::default(),
            accept: Arc::new(Semaphore::new(0)),
            finish: Arc::new(Semaphore::new(0)),
        }
    }
}

async fn start(State(app): State<App>, ctx: IdempotencyContext) -> Response {
    let id = format!("op-{}", ctx.derive("op"));
    let created = app.ops.lock().expect("ops").insert(id.clone(), false).is_none();
    if created {
        app.started.fetch_add(1, Ordering::SeqCst);
        let (ops, finish, id) = (app.ops.clone(), app.finish.clone(), id.clone());
        tokio::spawn(async move {
            let _permit = finish.acquire().await.expect("semaphore");
            ops.lock().expect("ops").insert(id, true);
        });
    }
    let _accepted = app.accept.acquire().await.expect("semaphore");
    (StatusCode::ACCEPTED, [(header::LOCATION, format!("/v1/operations/{id}"))], id).into_response()
}

async fn operation(State(app): State<App>, Path(id): Path<String>) -> Response {
    match app.ops.lock().expect("ops").get(&id) {
        Some(true) => "succeeded".into_response(),
        Some(false) => "running".into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

fn router(app: App) -> Router {
    let layer = IdempotencyLayer::builder(Arc::new(MemoryStore::new()))
        .principal(|_| Some(Principal::new("ops")))
        .operation_link(|record| Some(format!("/v1/operations/op-{}", record.derive("op"))))
        .build();
    Router::new()
        .route("/v1/flashes", post(start))
        .route("/v1/operations/{id}", get(operation))
        .with_state(app)
        .layer(layer)
}

async fn call(router: &Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let res = router.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

fn flash(key: &str) -> Request<Body> {
    Request::post("/v1/flashes").header("idempotency-key", key).body(Body::from("{}")).expect("request")
}

fn get_op(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).expect("request")
}

#[tokio::test]
async fn retries_attach_to_the_running_operation() {
    let app = App::default();
    let router = router(app.clone());

    // The first attempt is accepting (its 202 is not stored yet): a retry is told to wait, and
    // where to follow the operation.
    let first = tokio::spawn({
        let router = router.clone();
        async move { call(&router, flash("f-1")).await }
    });
    while app.started.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, headers, body) = call(&router, flash("f-1")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains("request-in-progress"), "{body}");
    let link = headers[header::LINK].to_str().expect("ascii").to_owned();
    assert!(link.ends_with(r#">; rel="monitor""#), "{link}");
    let monitor = link.trim_start_matches('<').split('>').next().expect("url").to_owned();
    assert_eq!(call(&router, get_op(&monitor)).await.2, "running", "the link leads to the operation");

    // Accepted: the 202 is stored; the work goes on.
    app.accept.add_permits(100);
    let (status, headers, op_id) = first.await.expect("task");
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(headers[header::LOCATION], monitor.as_str(), "Location and Link agree");
    for _ in 0..5 {
        let (status, headers, body) = call(&router, flash("f-1")).await;
        assert_eq!((status, body.as_str()), (StatusCode::ACCEPTED, op_id.as_str()));
        assert_eq!(headers["idempotent-replayed"], "true");
    }
    assert_eq!(call(&router, get_op(&monitor)).await.2, "running", "replays came while the work ran");
    app.finish.add_permits(1);
    tokio::time::timeout(Duration::from_secs(10), async {
        while call(&router, get_op(&monitor)).await.2 != "succeeded" {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the operation ends");
    let (status, _, body) = call(&router, flash("f-1")).await;
    assert_eq!((status, body.as_str()), (StatusCode::ACCEPTED, op_id.as_str()), "and after it ended");
    assert_eq!(app.started.load(Ordering::SeqCst), 1, "one operation, one work, for every retry");

    // Another key is another operation.
    let (status, _, other) = call(&router, flash("f-2")).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_ne!(other, op_id);
    assert_eq!(app.started.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn without_an_operation_link_the_in_progress_answer_has_none() {
    let app = App::default();
    let layer =
        IdempotencyLayer::builder(Arc::new(MemoryStore::new())).principal(|_| Some(Principal::new("ops"))).build();
    let router = Router::new().route("/v1/flashes", post(start)).with_state(app.clone()).layer(layer);
    let first = tokio::spawn({
        let router = router.clone();
        async move { call(&router, flash("f-1")).await }
    });
    while app.started.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, headers, _) = call(&router, flash("f-1")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.get(header::LINK).is_none());
    app.accept.add_permits(1);
    assert_eq!(first.await.expect("task").0, StatusCode::ACCEPTED);
}
