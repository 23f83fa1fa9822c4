//! The operator console (docs/protocol.md#operating-it, issue 30): server-rendered HTML pages at `/console`.
//!
//! - Login with the admin token through a form (`/console/login`); a tenant's token is refused.
//!   A login starts a server-side session ([`session`]): the browser holds only a random session
//!   id, in an `HttpOnly; SameSite=Strict; Path=/console` cookie (`Secure` behind a TLS proxy
//!   that sends `X-Forwarded-Proto: https`), never the token. Sign-ins are throttled per source
//!   address ([`throttle`]: ten at once, one more every six seconds, `429` beyond), and each one
//!   refused for a wrong token is logged with its source.
//! - Every form posts the session's CSRF token in a hidden field, compared in constant time; a
//!   POST whose `Origin` is another origin, or whose `Sec-Fetch-Site` says another site sent it,
//!   is refused too (403).
//! - Pages: the overview (`/console`: fleet, the latest workers, live operations and their age,
//!   records in flight and failed and their age, what the reaper and the inventory sweep did,
//!   the operators' forgets, a chart of request outcomes over the last hour) and the records
//!   listing (`/console/records`, the admin API's filters and cursor pages).
//! - One action: forget a completed or failed record, the same code as
//!   `DELETE /admin/v1/records/{id}` ([`crate::api::forget`]: refuses a record in flight, writes
//!   the audit line and row).
//!
//! No external asset: the stylesheet is compiled into the binary and served at
//! `/console/console.css`, the chart is an inline SVG, and no script runs; a strict
//! `Content-Security-Policy` says so to the browser.

use axum::extract::rejection::{FormRejection, QueryRejection};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::extract::{ConnectInfo, Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idempotency::{Principal, RecordQuery, RecordState};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::api::{ADMIN_PRINCIPAL, AppState, ForgetError, RecordsQuery, fleet_snapshot, record_query, token_digest};

pub mod chart;
mod pages;
pub mod session;
pub mod throttle;

pub use chart::OutcomeHistory;
pub use session::Sessions;
pub use throttle::LoginThrottle;

/// How many rows each overview table shows.
const ROWS: u32 = 50;

/// The console's own state: its sessions, the sign-in budget of each source, and the outcome
/// history its chart draws.
#[derive(Debug, Clone, Default)]
pub struct Console {
    /// Logged-in sessions.
    pub sessions: Sessions,
    /// Sign-in attempts per source address.
    pub logins: LoginThrottle,
    /// Samples of the outcome counters.
    pub history: OutcomeHistory,
}

/// The console's routes, with `console` for their sessions and chart.
pub fn routes(console: Console) -> Router<AppState> {
    Router::new()
        .route("/console", get(overview))
        .route("/console/", get(|| async { Redirect::to("/console") }))
        .route("/console/console.css", get(stylesheet))
        .route("/console/login", get(login_form).post(login))
        .route("/console/logout", post(logout))
        .route("/console/records", get(records))
        .route("/console/records/{id}/forget", post(forget))
        .layer(Extension(console))
}

/// Headers every console response carries: no caching, no framing, and a policy that lets the
/// page load nothing but its own stylesheet and post forms nowhere but to itself.
fn page(status: StatusCode, html: String) -> Response {
    let mut r = (status, axum::response::Html(html)).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
             base-uri 'none'",
        ),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    r
}

async fn stylesheet() -> Response {
    let mut r = ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], pages::CSS).into_response();
    r.headers_mut().insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    r
}

/// Whether the console is served over TLS (by a proxy in front that says so).
fn over_tls(headers: &HeaderMap) -> bool {
    headers.get("x-forwarded-proto").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// The login page, for a request without a live session.
fn to_login() -> Response {
    Redirect::to("/console/login").into_response()
}

/// A POST from another site: its `Sec-Fetch-Site` says so, or its `Origin` is not this host.
fn cross_site(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site")
        && site.as_bytes() != b"same-origin"
        && site.as_bytes() != b"none"
    {
        return true;
    }
    match headers.get(header::ORIGIN) {
        None => false,
        Some(origin) => {
            let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or_default();
            let origin = origin.to_str().unwrap_or_default();
            let same = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
            host.is_empty() || same != Some(host)
        }
    }
}

fn forbidden(why: &str) -> Response {
    page(StatusCode::FORBIDDEN, pages::message("Refused", why, None))
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    csrf: Option<String>,
}

/// Why a POST was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// No live session: sign in again (401).
    NoSession,
    /// Posted from another site (403).
    CrossSite,
    /// The CSRF token is missing or wrong (403).
    Csrf,
}

impl Refusal {
    fn response(self, state: &AppState) -> Response {
        match self {
            Self::NoSession => page(
                StatusCode::UNAUTHORIZED,
                pages::login(Some("your session ended: sign in again"), state.admin_token.is_some()),
            ),
            Self::CrossSite => forbidden("this form was posted from another site"),
            Self::Csrf => forbidden("the form's CSRF token is missing or wrong: reload the page and try again"),
        }
    }
}

/// The session of a POST whose CSRF token and origin check out.
fn checked_post(
    console: &Console,
    headers: &HeaderMap,
    form: Result<Form<CsrfForm>, FormRejection>,
) -> Result<session::Session, Refusal> {
    let session = console.sessions.find(headers).ok_or(Refusal::NoSession)?;
    if cross_site(headers) {
        return Err(Refusal::CrossSite);
    }
    let presented = form.ok().and_then(|Form(f)| f.csrf);
    if !session::csrf_matches(&session, presented.as_deref()) {
        return Err(Refusal::Csrf);
    }
    Ok(session)
}

async fn login_form(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    headers: HeaderMap,
) -> Response {
    if console.sessions.find(&headers).is_some() {
        return Redirect::to("/console").into_response();
    }
    page(StatusCode::OK, pages::login(None, state.admin_token.is_some()))
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    if cross_site(&headers) {
        return forbidden("this form was posted from another site");
    }
    // Throttled before the token is looked at: a right guess past the budget is refused too.
    let source = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |Extension(ConnectInfo(addr))| addr.ip());
    if let Err(throttled) = console.logins.attempt(source) {
        if throttled.first {
            tracing::warn!(%source, "console: sign-ins throttled: too many attempts from this source");
        }
        let wait = throttled.retry_after;
        let why = format!("too many sign-in attempts from your address: try again in {wait} s");
        let mut r = page(StatusCode::TOO_MANY_REQUESTS, pages::login(Some(&why), state.admin_token.is_some()));
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(wait));
        return r;
    }
    let token = form.map(|Form(f)| f.token).unwrap_or_default();
    // Only the admin token, compared in constant time; a tenant's token is no admin's.
    let admitted = match state.admin_token {
        Some(known) if !token.is_empty() => bool::from(known.ct_eq(&token_digest(token.trim()))),
        _ => false,
    };
    if !admitted {
        tracing::warn!(%source, "console: a login with a wrong token was refused");
        return page(StatusCode::UNAUTHORIZED, pages::login(Some("wrong token"), state.admin_token.is_some()));
    }
    let (id, _) = console.sessions.start();
    tracing::info!(target: "leasebroker::audit", actor = ADMIN_PRINCIPAL, action = "console-login", %source, "audit: an operator signed in to the console");
    let mut r = Redirect::to("/console").into_response();
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(&id, over_tls(&headers))) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

async fn logout(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    headers: HeaderMap,
    form: Result<Form<CsrfForm>, FormRejection>,
) -> Response {
    if let Err(refused) = checked_post(&console, &headers, form) {
        return refused.response(&state);
    }
    console.sessions.end(&headers);
    let mut r = Redirect::to("/console/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&session::clear_cookie(over_tls(&headers))) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

/// `?forgotten=ID` after a forget: the notice shown above the page.
#[derive(Debug, Deserialize)]
struct Notice {
    forgotten: Option<String>,
}

/// A listing of records in `state`, the first page of [`ROWS`].
async fn listing(state: &AppState, record_state: RecordState) -> Result<Vec<idempotency::Record>, String> {
    let q = RecordQuery {
        state: Some(record_state),
        principal: None,
        started_before: None,
        now: idempotency::now(),
        limit: ROWS,
        cursor: None,
    };
    state.store.list_records(&q).await.map(|p| p.records).map_err(unanswered)
}

async fn overview(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    headers: HeaderMap,
    notice: Result<Query<Notice>, QueryRejection>,
) -> Response {
    let Some(session) = console.sessions.find(&headers) else { return to_login() };
    let domain = &state.workers.domain;
    let unavailable = |_| "the database did not answer".to_owned();
    let (fleet, workers, operations, in_flight, failed, audit) = tokio::join!(
        fleet_snapshot(&state),
        domain.latest_workers(ROWS),
        domain.live_operations(ROWS),
        listing(&state, RecordState::InFlight),
        listing(&state, RecordState::Failed),
        state.audit.recent(20),
    );
    let now = idempotency::now().timestamp_micros();
    let chart = chart::svg(&chart::per_minute(
        &[
            console.history.samples(),
            vec![chart::Sample { at: now / 1_000_000, totals: chart::totals(&state.metrics.render()) }],
        ]
        .concat(),
        now / 1_000_000,
    ));
    let overview = pages::Overview {
        now,
        fleet: fleet.map_err(|e| {
            tracing::warn!(error = %e, "console: the fleet counts are unavailable");
            "the database or the hypervisor did not answer".to_owned()
        }),
        workers: workers.map_err(unavailable),
        operations: operations.map_err(unavailable),
        in_flight,
        failed,
        audit: audit.map_err(|_| "the database did not answer".to_owned()),
        actions: crate::activity::recent(30),
        chart,
        forgotten: notice.ok().and_then(|Query(n)| n.forgotten).filter(|id| id.len() <= 64),
    };
    page(StatusCode::OK, pages::overview(&overview, &session.csrf))
}

/// What a page shows when the record store fails it; the cause goes to the log.
fn unanswered(e: idempotency::StoreError) -> String {
    tracing::warn!(error = %idempotency::ErrorChain(&e), "the console could not list records");
    "the record store did not answer".to_owned()
}

async fn records(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    headers: HeaderMap,
    query: Result<Query<RecordsQuery>, QueryRejection>,
) -> Response {
    let Some(session) = console.sessions.find(&headers) else { return to_login() };
    let Ok(Query(q)) = query else {
        return page(
            StatusCode::BAD_REQUEST,
            pages::message("Bad query", "limit must be a number", Some(&session.csrf)),
        );
    };
    let shown = pages::Filters {
        state: q.state.clone().unwrap_or_default(),
        principal: q.principal.clone().unwrap_or_default(),
        older_than: q.older_than.clone().unwrap_or_default(),
        limit: q.limit,
    };
    // The form sends empty fields for the filters left blank: they mean no filter.
    let q = RecordsQuery {
        state: q.state.filter(|s| !s.is_empty()),
        principal: q.principal.filter(|s| !s.is_empty()),
        older_than: q.older_than.filter(|s| !s.is_empty()),
        limit: q.limit.or(Some(ROWS)),
        cursor: q.cursor.filter(|s| !s.is_empty()),
    };
    let query = match record_query(q, idempotency::now()) {
        Ok(q) => q,
        Err(detail) => {
            return page(StatusCode::BAD_REQUEST, pages::message("Bad query", &detail, Some(&session.csrf)));
        }
    };
    let listed = match state.store.list_records(&query).await {
        Ok(page) => Ok(page),
        Err(idempotency::StoreError::InvalidCursor) => {
            return page(
                StatusCode::BAD_REQUEST,
                pages::message("Bad query", "cursor is not a cursor this service gave out", Some(&session.csrf)),
            );
        }
        Err(e) => Err(unanswered(e)),
    };
    page(StatusCode::OK, pages::records(&shown, listed, idempotency::now().timestamp_micros(), &session.csrf))
}

async fn forget(
    State(state): State<AppState>,
    Extension(console): Extension<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
    form: Result<Form<CsrfForm>, FormRejection>,
) -> Response {
    let session = match checked_post(&console, &headers, form) {
        Ok(s) => s,
        Err(refused) => return refused.response(&state),
    };
    let csrf = Some(session.csrf.as_str());
    match crate::api::forget(&state, &Principal::new(ADMIN_PRINCIPAL), None, &id).await {
        Ok(entry) => Redirect::to(&format!("/console?forgotten={}", entry.record_id)).into_response(),
        Err(ForgetError::InFlight) => page(
            StatusCode::CONFLICT,
            pages::message(
                "Record in flight",
                "the record's request is still running, so it was not forgotten: wait for it to complete or fail \
                 (or for --in-flight-ttl)",
                csrf,
            ),
        ),
        Err(ForgetError::NotFound) => {
            page(StatusCode::NOT_FOUND, pages::message("No such record", "no such record", csrf))
        }
        Err(ForgetError::Store(_)) => page(
            StatusCode::SERVICE_UNAVAILABLE,
            pages::message("Store unavailable", "the record store did not answer; try again", csrf),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.insert(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn posts_from_another_origin_are_cross_site() {
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8080")])), "no Origin: a CLI, the CSRF token decides");
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")])));
        assert!(!cross_site(&headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "same-origin")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("origin", "http://evil.example")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("origin", "null")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "cross-site")])));
        assert!(cross_site(&headers(&[("host", "127.0.0.1:8080"), ("sec-fetch-site", "same-site")])));
    }
}
