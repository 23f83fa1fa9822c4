//! An axum app behind `axum-idempotent` 0.6, wired as its README shows (`CookieManagerLayer`,
//! then `SessionLayer` with an in-memory `MokaStore`, then `IdempotentLayer` innermost;
//! `use_idempotency_key_header(Some("Idempotency-Key"), true)`, `expire_after(300)`), for
//! idemcheck to test.
//!
//! `axum-idempotent` keeps its records in the caller's cookie session and caches nothing for a
//! request without one. This app's callers are bearer tokens (`FIXTURE_TOKENS=tok=name,...`), so
//! its outermost layer stands in for each principal's browser: at start it opens one session
//! per principal (`POST /session`), and it sends that session's cookie with each of the
//! principal's requests. Records are therefore scoped per principal, as the layer means them to
//! be per session.
//!
//! Routes: `POST /v1/widgets` and `POST /v1/gadgets` create (201, `Location`, JSON with an
//! `id`) after `delay_ms` of the body (default 300); `{"fail": "server"}` answers 500 and
//! `{"invalid": true}` 422. `GET /counter` answers `{"executions": N}`, the creates run so far.
//! `PORT` (default 0: any free port); the first line printed is `listening on http://...`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::Ttl;
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, Session, SessionLayer};
use serde_json::{Value, json};
use tower::ServiceExt;
use tower_cookies::CookieManagerLayer;

struct App {
    /// Bearer token -> principal.
    tokens: HashMap<String, String>,
    /// Principal -> the id of its session (the cookie's value).
    sessions: Mutex<HashMap<String, String>>,
    executions: AtomicU64,
}

#[derive(Clone)]
struct Principal(String);

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ")
}

/// Authentication, and the principal's session cookie (what its browser would send).
async fn auth(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let Some(who) = bearer(req.headers()).and_then(|t| app.tokens.get(t)).cloned() else {
        return (StatusCode::UNAUTHORIZED, Json(json!({"error": "unauthorized"}))).into_response();
    };
    req.headers_mut().remove(header::COOKIE);
    let session = app.sessions.lock().expect("sessions").get(&who).cloned();
    if let Some(id) = session
        && let Ok(v) = HeaderValue::from_str(&format!("session={id}"))
    {
        req.headers_mut().insert(header::COOKIE, v);
    }
    req.extensions_mut().insert(Principal(who.clone()));
    let mut res = next.run(req).await;
    for v in res.headers().get_all(header::SET_COOKIE) {
        if let Some(id) = v.to_str().ok().and_then(|c| c.strip_prefix("session=")).and_then(|c| c.split(';').next()) {
            app.sessions.lock().expect("sessions").insert(who.clone(), id.to_owned());
        }
    }
    res.headers_mut().remove(header::SET_COOKIE);
    res
}

/// Opens the caller's session.
async fn open_session(session: Session<MokaStore>, Extension(Principal(who)): Extension<Principal>) -> Response {
    let ttl = Ttl::new(86_400).expect("ttl");
    match session.set("principal", &who, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": e.to_string()}))).into_response(),
    }
}

async fn create(app: &App, kind: &str, who: &str, body: &[u8]) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "the body is not JSON"}))).into_response();
    };
    if v["fail"] == "server" {
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": "the backend failed"}))).into_response();
    }
    if v["invalid"] == true {
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": "invalid fields"}))).into_response();
    }
    tokio::time::sleep(Duration::from_millis(v["delay_ms"].as_u64().unwrap_or(300).min(10_000))).await;
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let id = format!("{kind}-{n}");
    let location = format!("/v1/{kind}s/{id}");
    let made = json!({"id": id, "kind": kind, "owner": who, "name": v["name"]});
    (StatusCode::CREATED, [(header::LOCATION, location)], Json(made)).into_response()
}

async fn widgets(
    State(app): State<Arc<App>>,
    Extension(Principal(who)): Extension<Principal>,
    body: Bytes,
) -> Response {
    create(&app, "widget", &who, &body).await
}

async fn gadgets(
    State(app): State<Arc<App>>,
    Extension(Principal(who)): Extension<Principal>,
    body: Bytes,
) -> Response {
    create(&app, "gadget", &who, &body).await
}

async fn counter(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"executions": app.executions.load(Ordering::SeqCst)}))
}

#[tokio::main]
async fn main() {
    let tokens: HashMap<String, String> = std::env::var("FIXTURE_TOKENS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| p.split_once('='))
        .map(|(t, n)| (t.to_owned(), n.to_owned()))
        .collect();
    if tokens.is_empty() {
        eprintln!("axum-idempotent fixture: set FIXTURE_TOKENS=token=principal,...");
        std::process::exit(2);
    }
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(0);
    let app = Arc::new(App { tokens: tokens.clone(), sessions: Mutex::default(), executions: AtomicU64::new(0) });

    let store = Arc::new(MokaStore::builder().build());
    let options =
        IdempotentOptions::default().use_idempotency_key_header(Some("Idempotency-Key"), true).expire_after(300);
    let api = Router::new()
        .route("/v1/widgets", post(widgets))
        .route("/v1/gadgets", post(gadgets))
        .layer(IdempotentLayer::<MokaStore>::new(options));
    let router = Router::new()
        .merge(api)
        .route("/session", post(open_session))
        .route("/counter", get(counter))
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name("session").path("/")))
        .layer(CookieManagerLayer::new())
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .with_state(app.clone());

    for (token, who) in &tokens {
        let req = Request::post("/session")
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .body(Body::empty())
            .expect("request");
        let res = router.clone().oneshot(req).await.expect("infallible");
        let opened = app.sessions.lock().expect("sessions").contains_key(who);
        if res.status() != StatusCode::NO_CONTENT || !opened {
            eprintln!("axum-idempotent fixture: could not open {who}'s session ({})", res.status());
            std::process::exit(1);
        }
    }

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
    println!("listening on http://{}", listener.local_addr().expect("addr"));
    axum::serve(listener, router).await.expect("serve");
}
