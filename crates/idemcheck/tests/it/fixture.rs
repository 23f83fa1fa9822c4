//! A deliberately breakable target: a small idempotency implementation written here (not the
//! workspace's layer) serving the leasebroker profile's routes, with switchable defects. With no
//! defect it passes every vector; each defect must make at least one vector fail.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::kit;

/// What the fixture gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Defect {
    /// No idempotency at all: every request runs.
    IgnoreKey,
    /// Any header value is a key (empty, long, control characters, two headers...).
    LaxKeys,
    /// Keys over 64 characters are refused.
    ShortKeys,
    /// A comma is refused even inside quotes.
    CommaRefused,
    /// `"k"` and `k` are different keys.
    NoUnquote,
    /// A request without a key runs unprotected.
    OptionalKey,
    /// Records are shared between principals.
    SharedScope,
    /// Records are shared between endpoints.
    KeyOnlyScope,
    /// No fingerprint: any request with a key replays its record.
    NoFingerprint,
    /// The fingerprint is the body alone.
    BodyOnlyFingerprint,
    /// A reused key is answered 422.
    Mismatch422,
    /// A reused key's record takes the new fingerprint.
    MismatchPoisons,
    /// A record in flight is not looked at: duplicates run at once.
    NoInFlight,
    /// The 409 in flight has no Retry-After.
    NoRetryAfter,
    /// `Prefer: wait` is ignored.
    NoPreferWait,
    /// No `Idempotency-Key-Expires`.
    NoExpiry,
    /// `Idempotency-Key-Expires` is restamped on every answer.
    MovingExpiry,
    /// Replays carry no `Idempotent-Replayed`.
    NoReplayHeader,
    /// Replays say `Idempotent-Replayed: yes`.
    WrongReplayHeader,
    /// Replays drop `Location`.
    DropLocation,
    /// 5xx answers are stored and replayed.
    Store5xx,
    /// Only 2xx answers are stored.
    Store2xxOnly,
    /// The key is claimed before authentication, per (endpoint, key), and a 401 stored.
    Store401,
    /// GET requests are protected too.
    ProtectGet,
    /// Deleting a worker forgets the records that created it.
    ForgetOnDelete,
    /// `Repeatability-Request-ID` is not read: the feature is off (its vectors are `n/a`).
    NoRepeatability,
    /// `Repeatability-Request-ID` keys records of its own, not the ones `Idempotency-Key` names.
    RepeatabilityOwnScope,
    /// `Repeatability-First-Sent` is not checked against the retention.
    RepeatabilityNoExpiry,
    /// No `Repeatability-Result` on the answers.
    NoRepeatabilityResult,
    /// The body's `request_id` is not read: the feature is off (its vectors are `n/a`).
    BodyKeyIgnored,
    /// The body's `request_id` keys records of its own, not the ones `Idempotency-Key` names.
    BodyKeyOwnScope,
    /// Two different keys on one request: the header's wins.
    TwoKeysHeaderWins,
}

pub(crate) const ALL: [Defect; 30] = [
    Defect::IgnoreKey,
    Defect::LaxKeys,
    Defect::ShortKeys,
    Defect::CommaRefused,
    Defect::NoUnquote,
    Defect::OptionalKey,
    Defect::SharedScope,
    Defect::KeyOnlyScope,
    Defect::NoFingerprint,
    Defect::BodyOnlyFingerprint,
    Defect::Mismatch422,
    Defect::MismatchPoisons,
    Defect::NoInFlight,
    Defect::NoRetryAfter,
    Defect::NoPreferWait,
    Defect::NoExpiry,
    Defect::MovingExpiry,
    Defect::NoReplayHeader,
    Defect::WrongReplayHeader,
    Defect::DropLocation,
    Defect::Store5xx,
    Defect::Store2xxOnly,
    Defect::Store401,
    Defect::ProtectGet,
    Defect::ForgetOnDelete,
    Defect::RepeatabilityOwnScope,
    Defect::RepeatabilityNoExpiry,
    Defect::NoRepeatabilityResult,
    Defect::BodyKeyOwnScope,
    Defect::TwoKeysHeaderWins,
];

pub(crate) const TOKENS: [&str; 3] = ["fx-alice", "fx-bob", "fx-admin"];
const RETENTION: Duration = Duration::from_secs(3600);
/// How long a create or a flash takes: long enough for a duplicate to arrive meanwhile.
const WORK: Duration = Duration::from_millis(400);

#[derive(Clone)]
enum RecState {
    InFlight,
    Done { status: StatusCode, headers: Vec<(String, String)>, body: Bytes },
}

#[derive(Clone)]
struct Rec {
    fingerprint: String,
    state: RecState,
    expires: SystemTime,
    /// The worker the record created, for ForgetOnDelete.
    created: Option<String>,
}

#[derive(Default)]
struct Fx {
    defects: BTreeSet<Defect>,
    records: Mutex<HashMap<String, Rec>>,
    done: Notify,
    workers: Mutex<BTreeMap<String, (String, Value)>>,
    next: AtomicU64,
    stamps: AtomicU64,
}

type Shared = Arc<Fx>;

impl Fx {
    fn has(&self, d: Defect) -> bool {
        self.defects.contains(&d)
    }
}

fn problem(status: StatusCode, name: &str) -> Response {
    let body = json!({"type": format!("/problems/{name}"), "title": name, "status": status.as_u16(), "detail": name});
    (status, [("content-type", "application/problem+json")], body.to_string()).into_response()
}

fn principal(headers: &HeaderMap) -> Option<&'static str> {
    let auth = headers.get("authorization")?.to_str().ok()?;
    let token = auth.strip_prefix("Bearer ")?;
    ["alice", "bob", "admin"].into_iter().zip(TOKENS).find(|(_, t)| *t == token).map(|(p, _)| p)
}

/// A key header the fixture refuses (`400 idempotency-key-invalid`).
struct InvalidKey;

/// The key, if sent.
fn parse_key(fx: &Fx, headers: &HeaderMap) -> Result<Option<String>, InvalidKey> {
    let values: Vec<&HeaderValue> = headers.get_all("idempotency-key").iter().collect();
    let invalid = || InvalidKey;
    let Some(first) = values.first() else { return Ok(None) };
    if fx.has(Defect::LaxKeys) {
        return Ok(Some(String::from_utf8_lossy(first.as_bytes()).into_owned()));
    }
    if values.len() > 1 {
        return Err(invalid());
    }
    let raw = std::str::from_utf8(first.as_bytes()).map_err(|_| invalid())?;
    let inner = if let Some(inner) = raw.strip_prefix('"') {
        let inner = inner.strip_suffix('"').ok_or_else(invalid)?;
        if inner.contains(['"', '\\']) || (fx.has(Defect::CommaRefused) && inner.contains(',')) {
            return Err(invalid());
        }
        inner
    } else {
        if raw.contains(',') {
            return Err(invalid());
        }
        raw
    };
    let max = if fx.has(Defect::ShortKeys) { 64 } else { 128 };
    if !(1..=max).contains(&inner.len()) || !inner.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(invalid());
    }
    Ok(Some(if fx.has(Defect::NoUnquote) { raw.to_owned() } else { inner.to_owned() }))
}

fn prefer_wait(headers: &HeaderMap) -> Option<u64> {
    let v = headers.get("prefer")?.to_str().ok()?;
    v.split(',').find_map(|p| p.trim().strip_prefix("wait=")).and_then(|n| n.trim().parse().ok())
}

fn expires_value(at: SystemTime) -> HeaderValue {
    HeaderValue::from_str(&httpdate::fmt_http_date(at)).expect("date")
}

fn with_expiry(fx: &Fx, mut res: Response, at: SystemTime) -> Response {
    if !fx.has(Defect::NoExpiry) {
        let at = if fx.has(Defect::MovingExpiry) {
            at + Duration::from_secs(1 + fx.stamps.fetch_add(1, Ordering::SeqCst))
        } else {
            at
        };
        res.headers_mut().insert("idempotency-key-expires", expires_value(at));
    }
    res
}

fn replay(fx: &Fx, rec: &Rec) -> Response {
    let RecState::Done { status, headers, body } = &rec.state else { unreachable!("replay of a record in flight") };
    let mut res = Response::new(Body::from(body.clone()));
    *res.status_mut() = *status;
    for (n, v) in headers {
        if fx.has(Defect::DropLocation) && n == "location" {
            continue;
        }
        res.headers_mut()
            .append(axum::http::HeaderName::from_bytes(n.as_bytes()).expect("name"), v.parse().expect("value"));
    }
    if !fx.has(Defect::NoReplayHeader) {
        let v = if fx.has(Defect::WrongReplayHeader) { "yes" } else { "true" };
        res.headers_mut().insert("idempotent-replayed", HeaderValue::from_static(v));
    }
    with_expiry(fx, res, rec.expires)
}

fn stored(fx: &Fx, status: StatusCode) -> bool {
    let s = status.as_u16();
    if fx.has(Defect::Store2xxOnly) {
        return status.is_success();
    }
    status.is_success()
        || [400, 404, 405, 409, 410, 413, 415, 422].contains(&s)
        || (s >= 500 && fx.has(Defect::Store5xx))
        || (s == 401 && fx.has(Defect::Store401))
}

/// The idempotency middleware, with its defects.
/// Marks an answer the handler gave or a replay (`Repeatability-Result: accepted`).
#[derive(Clone, Copy)]
struct Accepted;

fn accepted(mut res: Response) -> Response {
    res.extensions_mut().insert(Accepted);
    res
}

/// The key of `Repeatability-Request-ID` (checked against `Repeatability-First-Sent`) and of the
/// body's `request_id`; a refusal as its status and problem name.
fn other_key(fx: &Fx, headers: &HeaderMap, body: &[u8]) -> Result<Option<String>, (StatusCode, &'static str)> {
    let invalid = || (StatusCode::BAD_REQUEST, "idempotency-key-invalid");
    let mut found = None;
    if let Some(v) = headers.get("repeatability-request-id").filter(|_| !fx.has(Defect::NoRepeatability)) {
        let id = v.to_str().ok().filter(|s| !s.is_empty()).ok_or_else(invalid)?.to_owned();
        let sent = headers
            .get("repeatability-first-sent")
            .and_then(|v| v.to_str().ok())
            .and_then(|s| httpdate::parse_http_date(s).ok())
            .ok_or_else(invalid)?;
        let age = SystemTime::now().duration_since(sent).unwrap_or_default();
        if age > RETENTION && !fx.has(Defect::RepeatabilityNoExpiry) {
            return Err((StatusCode::PRECONDITION_FAILED, "repeatability-expired"));
        }
        found = Some(if fx.has(Defect::RepeatabilityOwnScope) { format!("rr:{id}") } else { id });
    }
    if !fx.has(Defect::BodyKeyIgnored)
        && let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(body)
        && let Some(Value::String(k)) = map.get("request_id")
    {
        match &found {
            Some(f) if f != k && !fx.has(Defect::TwoKeysHeaderWins) => return Err(invalid()),
            Some(_) => {}
            None if fx.has(Defect::BodyKeyOwnScope) => found = Some(format!("body:{k}")),
            None => found = Some(k.clone()),
        }
    }
    Ok(found)
}

async fn idempotency(State(fx): State<Shared>, req: Request, next: Next) -> Response {
    let repeatable = req.headers().contains_key("repeatability-request-id") && !fx.has(Defect::NoRepeatability);
    let mut res = protect(fx.clone(), req, next).await;
    if repeatable && !fx.has(Defect::NoRepeatabilityResult) {
        let result = if res.extensions().get::<Accepted>().is_some() { "accepted" } else { "rejected" };
        res.headers_mut().insert("repeatability-result", HeaderValue::from_static(result));
    }
    res
}

async fn protect(fx: Shared, req: Request, next: Next) -> Response {
    let mutating = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH | Method::DELETE);
    if !mutating && !fx.has(Defect::ProtectGet) {
        return next.run(req).await;
    }
    let who = principal(req.headers());
    if who.is_none() && !fx.has(Defect::Store401) {
        return problem(StatusCode::UNAUTHORIZED, "unauthorized");
    }
    if fx.has(Defect::IgnoreKey) {
        return next.run(req).await;
    }
    let header_key = match parse_key(&fx, req.headers()) {
        Ok(k) => k,
        Err(InvalidKey) => return problem(StatusCode::BAD_REQUEST, "idempotency-key-invalid"),
    };
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.unwrap_or_default();
    let other = match other_key(&fx, &parts.headers, &body) {
        Ok(k) => k,
        Err((status, name)) => return problem(status, name),
    };
    let key = match (header_key, other) {
        (Some(a), Some(b)) if a != b && !fx.has(Defect::TwoKeysHeaderWins) => {
            return problem(StatusCode::BAD_REQUEST, "idempotency-key-invalid");
        }
        (a, b) => a.or(b),
    };
    let key = match key {
        Some(k) => k,
        None if fx.has(Defect::OptionalKey) || !mutating => {
            return next.run(Request::from_parts(parts, Body::from(body))).await;
        }
        None => return problem(StatusCode::BAD_REQUEST, "idempotency-key-missing"),
    };
    let content_type = parts.headers.get("content-type").map(|v| v.as_bytes().to_vec()).unwrap_or_default();
    let fingerprint = if fx.has(Defect::BodyOnlyFingerprint) {
        format!("{body:?}")
    } else {
        format!("{} {} {content_type:?} {body:?}", parts.method, parts.uri)
    };
    let principal_part = if fx.has(Defect::SharedScope) || fx.has(Defect::Store401) { "*" } else { who.unwrap_or("*") };
    let endpoint =
        if fx.has(Defect::KeyOnlyScope) { "*".to_owned() } else { format!("{} {}", parts.method, parts.uri.path()) };
    let scope = format!("{principal_part}|{endpoint}|{key}");
    let wait = prefer_wait(&parts.headers).filter(|_| !fx.has(Defect::NoPreferWait));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait.unwrap_or(0).min(30));
    let mut waited = false;
    loop {
        let woken = fx.done.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let found = fx.records.lock().expect("records").get(&scope).cloned();
        let Some(rec) = found else { break };
        if rec.fingerprint != fingerprint && !fx.has(Defect::NoFingerprint) {
            if fx.has(Defect::MismatchPoisons)
                && let Some(r) = fx.records.lock().expect("records").get_mut(&scope)
            {
                r.fingerprint = fingerprint.clone();
            }
            let status =
                if fx.has(Defect::Mismatch422) { StatusCode::UNPROCESSABLE_ENTITY } else { StatusCode::CONFLICT };
            return with_expiry(&fx, problem(status, "idempotency-key-reused"), rec.expires);
        }
        match rec.state {
            RecState::Done { .. } => {
                let mut res = accepted(replay(&fx, &rec));
                if waited {
                    res.headers_mut()
                        .insert("preference-applied", format!("wait={}", wait.unwrap_or(0)).parse().expect("v"));
                }
                return res;
            }
            RecState::InFlight if fx.has(Defect::NoInFlight) => break,
            RecState::InFlight => {
                if tokio::time::Instant::now() >= deadline {
                    let mut res = problem(StatusCode::CONFLICT, "request-in-progress");
                    if !fx.has(Defect::NoRetryAfter) {
                        res.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
                    }
                    return with_expiry(&fx, res, rec.expires);
                }
                waited = true;
                let _ = tokio::time::timeout_at(deadline, woken).await;
            }
        }
    }
    let expires = SystemTime::now() + RETENTION;
    fx.records.lock().expect("records").insert(
        scope.clone(),
        Rec { fingerprint: fingerprint.clone(), state: RecState::InFlight, expires, created: None },
    );
    let res = if who.is_none() {
        problem(StatusCode::UNAUTHORIZED, "unauthorized")
    } else {
        next.run(Request::from_parts(parts, Body::from(body))).await
    };
    let (rparts, rbody) = res.into_parts();
    let rbody = axum::body::to_bytes(rbody, 1 << 20).await.unwrap_or_default();
    let keep = stored(&fx, rparts.status);
    {
        let mut records = fx.records.lock().expect("records");
        if keep {
            let headers = rparts
                .headers
                .iter()
                .filter(|(n, _)| ["content-type", "location"].contains(&n.as_str()))
                .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
                .collect();
            let created = rparts.headers.get("location").and_then(|v| v.to_str().ok()).map(str::to_owned);
            records.insert(
                scope,
                Rec {
                    fingerprint,
                    state: RecState::Done { status: rparts.status, headers, body: rbody.clone() },
                    expires,
                    created,
                },
            );
        } else {
            records.remove(&scope);
        }
    }
    fx.done.notify_waiters();
    let res = accepted(Response::from_parts(rparts, Body::from(rbody)));
    if keep { with_expiry(&fx, res, expires) } else { res }
}

async fn create_worker(State(fx): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else { return problem(StatusCode::BAD_REQUEST, "bad-json") };
    if v["cpu"].as_i64().unwrap_or(0) < 1 {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "validation-failed");
    }
    if v["image"] == "idemcheck-missing:1" {
        return problem(StatusCode::BAD_GATEWAY, "upstream-refused");
    }
    tokio::time::sleep(WORK).await;
    let id = format!("wkr-{}", fx.next.fetch_add(1, Ordering::SeqCst));
    let owner = principal(&headers).unwrap_or_default().to_owned();
    let worker = json!({"id": id, "image": v["image"], "cpu": v["cpu"]});
    fx.workers.lock().expect("workers").insert(id.clone(), (owner, worker.clone()));
    (
        StatusCode::CREATED,
        [("content-type", "application/json"), ("location", &format!("/v1/workers/{id}"))],
        worker.to_string(),
    )
        .into_response()
}

async fn list_workers(State(fx): State<Shared>, headers: HeaderMap) -> Response {
    let Some(who) = principal(&headers) else { return problem(StatusCode::UNAUTHORIZED, "unauthorized") };
    let workers: Vec<Value> =
        fx.workers.lock().expect("workers").values().filter(|(o, _)| o == who).map(|(_, w)| w.clone()).collect();
    axum::Json(json!({"workers": workers, "next_cursor": null})).into_response()
}

async fn delete_worker(State(fx): State<Shared>, Path(id): Path<String>) -> Response {
    if fx.workers.lock().expect("workers").remove(&id).is_none() {
        return problem(StatusCode::NOT_FOUND, "not-found");
    }
    if fx.has(Defect::ForgetOnDelete) {
        let location = format!("/v1/workers/{id}");
        fx.records.lock().expect("records").retain(|_, r| r.created.as_deref() != Some(location.as_str()));
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn flash(State(fx): State<Shared>, Path(node): Path<String>) -> Response {
    let id = format!("op-{}", fx.next.fetch_add(1, Ordering::SeqCst));
    let op = json!({"id": id, "kind": "firmware-flash", "node_id": node, "state": "running"});
    (
        StatusCode::ACCEPTED,
        [("content-type", "application/json"), ("location", &format!("/admin/v1/operations/{id}"))],
        op.to_string(),
    )
        .into_response()
}

async fn operation(Path(id): Path<String>) -> Response {
    axum::Json(json!({"id": id, "state": "running"})).into_response()
}

/// Serves the fixture with `defects` on a free port; returns its URL.
pub(crate) async fn serve(defects: &[Defect]) -> String {
    let fx: Shared = Arc::new(Fx { defects: defects.iter().copied().collect(), ..Default::default() });
    let app = Router::new()
        .route("/v1/workers", post(create_worker).get(list_workers))
        .route("/v1/workers/{id}", axum::routing::delete(delete_worker))
        .route("/v1/workers/{id}/reboot", post(|| async { problem(StatusCode::NOT_FOUND, "not-found") }))
        .route("/admin/v1/nodes/{node}/firmware", post(flash))
        .route("/admin/v1/operations/{id}", get(operation))
        .layer(axum::middleware::from_fn_with_state(fx.clone(), idempotency))
        .with_state(fx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    url
}

/// The vectors each defect must fail (it may fail more).
fn must_fail(d: Defect) -> &'static [&'static str] {
    match d {
        Defect::IgnoreKey => {
            &["key-bare", "key-sf-string", "header-name-case", "long-running-attaches", "concurrent-duplicates-32"]
        }
        Defect::LaxKeys => &[
            "key-empty",
            "key-too-long",
            "key-non-ascii",
            "key-control-char",
            "key-inner-space",
            "key-bare-comma",
            "key-repeated-header",
        ],
        Defect::ShortKeys => &["key-max-length"],
        Defect::CommaRefused => &["key-sf-string-comma"],
        Defect::NoUnquote => &["key-sf-and-bare-same"],
        Defect::OptionalKey => &["key-missing"],
        Defect::SharedScope => &["scope-per-principal"],
        Defect::KeyOnlyScope => &["scope-per-endpoint"],
        Defect::NoFingerprint => &["mismatch-body", "mismatch-does-not-poison"],
        Defect::BodyOnlyFingerprint => &["mismatch-query", "mismatch-content-type"],
        Defect::Mismatch422 => &["mismatch-body", "mismatch-does-not-poison"],
        Defect::MismatchPoisons => &["mismatch-does-not-poison"],
        Defect::NoInFlight => &["in-flight-409", "concurrent-duplicates-32", "expires-in-flight"],
        Defect::NoRetryAfter => &["in-flight-409"],
        Defect::NoPreferWait => &["prefer-wait-attaches"],
        Defect::NoExpiry => &["expires-on-first", "expires-on-replay", "expires-on-mismatch", "expires-in-flight"],
        Defect::MovingExpiry => &["expires-on-replay", "expires-on-mismatch"],
        Defect::NoReplayHeader => &["replay-header", "key-bare"],
        Defect::WrongReplayHeader => &["replay-header"],
        Defect::DropLocation => &["replay-byte-for-byte"],
        Defect::Store5xx => &["not-stored-5xx"],
        Defect::Store2xxOnly => &["stored-4xx-replayed"],
        Defect::Store401 => &["not-stored-401"],
        Defect::ProtectGet => &["get-ignores-key"],
        Defect::ForgetOnDelete => &["replay-after-delete"],
        Defect::RepeatabilityOwnScope => &["repeatability-same-record"],
        Defect::RepeatabilityNoExpiry => &["repeatability-expired"],
        Defect::NoRepeatabilityResult => &["repeatability-same-record", "repeatability-expired"],
        Defect::BodyKeyOwnScope => &["body-key-same-record"],
        // Not defects: the features are off, and their vectors n/a (see below).
        Defect::NoRepeatability | Defect::BodyKeyIgnored => &[],
        Defect::TwoKeysHeaderWins => &["repeatability-two-keys", "body-key-two-keys"],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fixture_without_defects_passes_every_vector() {
    let url = serve(&[]).await;
    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    assert!(run.failed().is_empty(), "failed: {:?}\n{}", run.failed(), run.stdout);
    let na: Vec<_> = run.results().into_iter().filter(|(_, r)| r == "n/a").collect();
    assert!(na.is_empty(), "n/a: {na:?}\n{}", run.stdout);
    assert_eq!(run.code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_vector_fails_against_at_least_one_defect() {
    // One fixture and one idemcheck run per defect, all at once.
    let runs = futures::future::join_all(ALL.iter().map(|&d| async move {
        let url = serve(&[d]).await;
        (d, kit::run(&url, "leasebroker", &TOKENS).await)
    }))
    .await;
    let mut caught: BTreeMap<String, Vec<Defect>> = BTreeMap::new();
    for (defect, run) in &runs {
        let failed = run.failed();
        for expected in must_fail(*defect) {
            assert!(
                failed.iter().any(|f| f == expected),
                "{defect:?} should fail {expected}; failed {failed:?}\n{}",
                run.stdout
            );
        }
        assert_eq!(run.code, Some(1), "{defect:?}: a run with a failure exits 1");
        assert!(run.stdout.trim_end().lines().last().is_some_and(|l| l.contains(" failed, ")), "{}", run.stdout);
        for f in failed {
            caught.entry(f).or_default().push(*defect);
        }
    }
    let uncaught: Vec<String> = kit::vector_ids().into_iter().filter(|id| !caught.contains_key(id)).collect();
    assert!(uncaught.is_empty(), "vectors no defect makes fail: {uncaught:?}");
}

/// Issue 45: a target that has the other key sources off (it refuses a request keyed only by one
/// of them as keyless) gets `n/a` for their vectors, with the reason and the profile's switch,
/// and fails nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_key_sources_switched_off_are_na_not_failures() {
    let url = serve(&[Defect::NoRepeatability, Defect::BodyKeyIgnored]).await;
    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    assert!(run.failed().is_empty(), "failed: {:?}\n{}", run.failed(), run.stdout);
    let reasons = run.reasons();
    for (prefix, source, switch) in [
        ("repeatability-", "Repeatability-Request-ID", "--key-sources repeatability"),
        ("body-key-", "request_id", "--key-sources request-id"),
    ] {
        let off: Vec<_> = reasons.iter().filter(|(id, _)| id.starts_with(prefix)).collect();
        assert!(!off.is_empty(), "{prefix}");
        for (id, (result, reason)) in off {
            assert_eq!(result, "n/a", "{id}: {reason}");
            assert!(reason.contains(source) && reason.contains(switch), "{id}: {reason}");
        }
    }
    assert_eq!(run.code, Some(0));
}

/// A target that replays without the profile's replay header and shares records between
/// principals still fails scope-per-principal: the other principal got the first one's body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shared_scope_is_caught_without_the_replay_header() {
    let url = serve(&[Defect::SharedScope, Defect::NoReplayHeader]).await;
    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    assert_eq!(run.results()["scope-per-principal"], "fail", "{}", run.stdout);
}

/// `--counter PATH#POINTER` replaces the counter a `--route` drops: the 32 concurrent
/// duplicates are counted through it (a pointer to nothing fails the vector; without the
/// option the vector cannot tell, and passes on the answers alone). `--report` twice writes
/// both forms of one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_counter_option_counts_executions_on_a_given_route() {
    // A fixture per run: the counter counts every create of the caller's, and the runs overlap.
    let urls = futures::future::join_all((0..4).map(|_| serve(&[]))).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let md = dir.path().join("report.md").display().to_string();
    let route = ["--route", "POST /v1/workers", "--body", r#"{"image": "i:1", "cpu": 1, "memory_gb": 1}"#];
    let args = |extra: &[&'static str]| route.iter().chain(extra).copied().collect::<Vec<&str>>();
    let good = args(&["--counter", "/v1/workers#/workers"]);
    let good = [good, vec!["--report", md.as_str()]].concat();
    let wrong_pointer = args(&["--counter", "/v1/workers#/nope"]);
    let missing = args(&["--counter", "/v1/no-such-counter"]);
    let none = args(&[]);
    let (good, wrong_pointer, missing, none) = tokio::join!(
        kit::run_with(&urls[0], "ietf-draft", &TOKENS, &good),
        kit::run_with(&urls[1], "ietf-draft", &TOKENS, &wrong_pointer),
        kit::run_with(&urls[2], "ietf-draft", &TOKENS, &missing),
        kit::run_with(&urls[3], "ietf-draft", &TOKENS, &none),
    );
    let reason = |run: &kit::Run| {
        run.report["vectors"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["id"] == "concurrent-duplicates-32"))
            .map(|v| v["reason"].as_str().unwrap_or_default().to_owned())
            .unwrap_or_default()
    };
    assert_eq!(good.results()["concurrent-duplicates-32"], "pass", "{}", good.stdout);
    assert_eq!(none.results()["concurrent-duplicates-32"], "pass", "{}", none.stdout);
    for (run, says) in [(&wrong_pointer, "the counter has no /nope"), (&missing, "the counter GET /v1/no-such-counter")]
    {
        assert_eq!(run.results()["concurrent-duplicates-32"], "fail", "{}", run.stdout);
        assert!(reason(run).contains(says), "{says:?} not in {:?}", reason(run));
    }
    let summary = good.stdout.trim_end().lines().last().unwrap_or_default().to_owned();
    let text = std::fs::read_to_string(&md).expect("the .md report");
    assert!(summary.contains(" passed, ") && text.contains(&summary), "{summary:?} not in the .md report");
}
