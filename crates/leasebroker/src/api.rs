//! The HTTP API (SPEC 3.2): handlers, authentication, and errors as problem+json. The router
//! that puts them together is in [`crate::routes`].

use std::sync::{Arc, OnceLock};

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idempotency::Principal;
use idempotency_tower::{IdempotencyContext, Problem};
use metrics_exporter_prometheus::PrometheusHandle;
use regex::Regex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::db::redact;
use crate::domain::WorkerRow;
use crate::hypervisor::client::HypervisorClient;
use crate::service::{CreateWorker, Operation, ServiceError, Workers};

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The workers service.
    pub workers: Workers,
    /// Bearer tokens (as SHA-256 digests, so comparisons take the same time whatever the length)
    /// and the principals they authenticate.
    pub tokens: Arc<Vec<([u8; 32], Principal)>>,
    /// The admin token's digest.
    pub admin_token: Option<[u8; 32]>,
    /// The idempotency store, for readiness.
    pub store: Arc<dyn idempotency::Store>,
    /// Renders /metrics.
    pub metrics: PrometheusHandle,
    /// The hypervisor, for fleet counts.
    pub hypervisor: HypervisorClient,
    /// The per-principal limit on mutating requests (`--rate-limit`), if any.
    pub rate_limiter: Option<Arc<PrincipalRateLimiter>>,
}

/// A rate limiter with one budget per principal. Its memory is bounded by the configured
/// principals: only authenticated requests reach it.
pub type PrincipalRateLimiter = governor::DefaultKeyedRateLimiter<String>;

/// A limiter allowing `per_second` mutating requests per principal, `burst` at once.
pub fn rate_limiter(per_second: u32, burst: u32) -> Option<Arc<PrincipalRateLimiter>> {
    let rate = std::num::NonZeroU32::new(per_second)?;
    let burst = std::num::NonZeroU32::new(burst).unwrap_or(rate);
    Some(Arc::new(governor::RateLimiter::keyed(governor::Quota::per_second(rate).allow_burst(burst))))
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").field("principals", &self.tokens.len()).finish_non_exhaustive()
    }
}

/// Hashes a token for constant-time comparison.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The largest request body accepted (413 beyond).
pub const BODY_LIMIT: usize = 1024 * 1024;

/// The worker as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Worker {
    /// `wkr-...`.
    pub id: String,
    /// `booting` or `running`.
    pub state: String,
    /// The image.
    pub image: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory in GB.
    pub memory_gb: i64,
    /// Labels.
    pub labels: std::collections::BTreeMap<String, String>,
    /// The node it runs on.
    pub node_id: String,
    /// Its lease.
    pub lease_id: String,
    /// Its VM.
    pub vm_id: String,
    /// Reboots done.
    pub reboot_count: i64,
    /// RFC 3339 creation time.
    pub created_at: String,
}

impl From<WorkerRow> for Worker {
    fn from(w: WorkerRow) -> Self {
        Self {
            id: w.worker_id,
            state: w.state,
            image: w.image,
            cpu: w.cpu,
            memory_gb: w.memory_gb,
            labels: serde_json::from_str(&w.labels).unwrap_or_default(),
            node_id: w.node_id,
            lease_id: w.lease_id,
            vm_id: w.vm_id,
            reboot_count: w.reboot_count,
            created_at: chrono::DateTime::from_timestamp_micros(w.created_at)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        }
    }
}

/// `GET /v1/workers` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkerPage {
    /// This page.
    pub workers: Vec<Worker>,
    /// Pass as `cursor` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

/// `POST /v1/workers/{id}/reboot` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebootResult {
    /// The worker.
    pub id: String,
    /// Reboots done, counting this one.
    pub reboot_count: i64,
}

/// `GET /admin/v1/fleet` response.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Fleet {
    /// Nodes in the pool.
    pub nodes_total: i64,
    /// Nodes allocated.
    pub nodes_allocated: i64,
    /// Leases held.
    pub leases_active: i64,
    /// Workers that exist.
    pub workers_active: i64,
    /// VMs running on the hypervisor.
    pub vms_running: i64,
    /// VM boots leasebroker recorded.
    pub vm_boots_total: i64,
    /// Reboots leasebroker recorded.
    pub reboots_total: i64,
}

/// `GET /v1/workers` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct ListQuery {
    /// Page size, 1-500 (default 100).
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// The largest page.
pub const MAX_PAGE: u32 = 500;

/// The longest problem `detail` the service sends: details are short, fixed texts or a bounded
/// description; they never quote the request body or carry another system's error text.
pub const MAX_DETAIL: usize = 300;

/// Cuts `detail` to at most [`MAX_DETAIL`] bytes, at a character boundary.
fn bounded(mut detail: String) -> String {
    if detail.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL - 3;
        while !detail.is_char_boundary(end) {
            end -= 1;
        }
        detail.truncate(end);
        detail.push_str("...");
    }
    detail
}

impl IntoResponse for ServiceError {
    fn into_response(self) -> Response {
        match self {
            Self::Invalid(detail) => {
                Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "validation-failed", "Invalid request", bounded(detail))
            }
            Self::NotFound(_) => Problem::new(StatusCode::NOT_FOUND, "not-found", "No such worker", "no such worker"),
            Self::CapacityExhausted => {
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, "capacity-exhausted", "No free node", self.to_string())
                    .with_retry_after(5)
            }
            Self::QuotaExceeded(_) => {
                Problem::new(StatusCode::FORBIDDEN, "quota-exceeded", "Worker quota exceeded", self.to_string())
            }
            // The reason names the hypervisor's address and quotes its answer: the log gets it,
            // the tenant a fixed text.
            Self::UpstreamUnavailable { ref reason, retry_after } => {
                tracing::warn!(reason = %redact(reason), "hypervisor unavailable");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "upstream-unavailable",
                    "Hypervisor unavailable",
                    "the hypervisor could not complete the call; retry with the same key",
                )
                .with_retry_after(retry_after)
            }
            Self::UpstreamRefused(ref reason) => {
                tracing::warn!(reason = %redact(reason), "hypervisor refused a call");
                Problem::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unavailable",
                    "Hypervisor refused the call",
                    "the hypervisor refused the call",
                )
            }
            Self::Gone(_) => Problem::new(StatusCode::GONE, "worker-deleted", "Worker deleted", self.to_string()),
            Self::Database(e) => {
                tracing::error!(error = %e, "database error");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "Database unavailable",
                    "try again",
                )
                .with_retry_after(1)
            }
        }
        .into_response()
    }
}

fn unauthorized() -> Response {
    let mut r =
        Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized", "a valid bearer token is required")
            .into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

fn bearer(headers: &HeaderMap) -> Option<[u8; 32]> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    // The scheme name is case-insensitive (RFC 9110 section 11.1).
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| token_digest(token))
}

/// The principal whose token has `digest`. Every configured token is compared, in constant
/// time, whether one matched early or none does, so the time taken says nothing about which
/// token (or how much of one) matched.
fn principal_for<'a>(
    tokens: impl IntoIterator<Item = &'a ([u8; 32], Principal)>,
    digest: &[u8; 32],
) -> Option<Principal> {
    let mut found: Option<Principal> = None;
    for (known, principal) in tokens {
        if bool::from(known.ct_eq(digest)) {
            found = Some(principal.clone());
        }
    }
    found
}

/// The bearer check of `/v1`: the token's principal goes into the request's extensions, else
/// `401`.
pub(crate) async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(digest) = bearer(req.headers()) else { return unauthorized() };
    match principal_for(state.tokens.iter(), &digest) {
        Some(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        None => unauthorized(),
    }
}

/// `429` + `Retry-After` for a principal over its budget of mutating requests. Runs after
/// authentication and before the idempotency layer, so a refused request claims no key.
pub(crate) async fn rate_limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    use governor::clock::Clock;
    let (Some(limiter), false) = (&state.rate_limiter, req.method().is_safe()) else { return next.run(req).await };
    let Some(principal) = req.extensions().get::<Principal>() else { return next.run(req).await };
    match limiter.check_key(&principal.as_str().to_owned()) {
        Ok(()) => next.run(req).await,
        Err(not_until) => {
            let wait = not_until.wait_time_from(limiter.clock().now());
            let secs = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
            Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                "Too many requests",
                "this principal is over its rate of mutating requests; retry after Retry-After seconds",
            )
            .with_retry_after(secs)
            .into_response()
        }
    }
}

/// The bearer check of `/admin`: the admin token, else `401`.
pub(crate) async fn authenticate_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match (state.admin_token, bearer(req.headers())) {
        (Some(known), Some(digest)) if bool::from(known.ct_eq(&digest)) => next.run(req).await,
        _ => unauthorized(),
    }
}

fn context(ctx: Option<Extension<IdempotencyContext>>) -> Result<IdempotencyContext, Problem> {
    ctx.map(|Extension(c)| c).ok_or_else(|| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            "the idempotency layer is missing",
        )
    })
}

fn parse_json<T: serde::de::DeserializeOwned>(headers: &HeaderMap, body: &Bytes) -> Result<T, Problem> {
    let json_ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json_ct {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            "send Content-Type: application/json",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        use serde_json::error::Category;
        let detail = json_error_detail(&e);
        match e.classify() {
            Category::Data => {
                Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "validation-failed", "Invalid request", detail)
            }
            _ => Problem::new(StatusCode::BAD_REQUEST, "malformed-json", "Malformed JSON", detail),
        }
    })
}

/// The request's own field names, which a detail may name (they come from the schema, not the
/// body).
const FIELD_NAMES: [&str; 4] = ["image", "cpu", "memory_gb", "labels"];

/// A problem detail for a JSON error that says what was wrong and where, without quoting the
/// body: serde's text quotes the offending value or unknown field name whole (a 1 MiB string in
/// a numeric field would come back as a 1 MiB detail, stored for the retention window).
/// String values ("...") are dropped, and backquoted ones unless they are field names or
/// punctuation; the result is at most [`MAX_DETAIL`] bytes.
pub fn json_error_detail(e: &serde_json::Error) -> String {
    static QUOTED: OnceLock<Regex> = OnceLock::new();
    let quoted = QUOTED.get_or_init(|| Regex::new(r#""(?:[^"\\]|\\.)*"?|`[^`]*`?"#).expect("a valid pattern"));
    let text = e.to_string();
    // serde puts the unknown name between backquotes unescaped, so it is not cut out reliably.
    if text.starts_with("unknown field") {
        return format!(
            "unknown field, expected one of `image`, `cpu`, `memory_gb`, `labels` at line {} column {}",
            e.line(),
            e.column()
        );
    }
    let cleaned = quoted.replace_all(&text, |c: &regex::Captures<'_>| {
        let q = &c[0];
        let inner = q.trim_matches('`');
        let keep = q.starts_with('`')
            && (FIELD_NAMES.contains(&inner)
                || (!inner.is_empty() && inner.len() <= 2 && inner.chars().all(|ch| ch.is_ascii_punctuation())));
        if keep { q.to_owned() } else { String::new() }
    });
    // "invalid type: string , expected" -> "invalid type: string, expected".
    let cleaned = cleaned.replace(" ,", ",").replace("  ", " ");
    bounded(cleaned.trim().to_owned())
}

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
        (status = 429, description = "Over the principal's rate limit (with --rate-limit)", content_type = "application/problem+json"),
        (status = 502, description = "Hypervisor refused (nothing held; not stored)", content_type = "application/problem+json"),
        (status = 503, description = "No free node, or hypervisor unavailable", content_type = "application/problem+json"),
    ),
    security(("bearer" = [])))]
pub async fn create_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: Option<Extension<IdempotencyContext>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ctx = match context(ctx) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let req: CreateWorker = match parse_json(&headers, &body) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let op = Operation::new(ctx.claim().record().clone());
    match state.workers.create(principal.as_str(), &req, &op).await {
        Ok(row) => {
            let worker = Worker::from(row);
            let location = format!("/v1/workers/{}", worker.id);
            let mut r = (StatusCode::CREATED, Json(worker)).into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(e) => e.into_response(),
    }
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
) -> Response {
    match state.workers.domain.worker(principal.as_str(), &id).await {
        Ok(Some(w)) => Json(Worker::from(w)).into_response(),
        Ok(None) => ServiceError::NotFound(id).into_response(),
        Err(e) => ServiceError::from(e).into_response(),
    }
}

/// Lists the caller's workers, a page at a time.
#[utoipa::path(get, path = "/v1/workers", tag = "workers", params(ListQuery),
    responses((status = 200, body = WorkerPage), (status = 400, description = "Bad limit"), (status = 401, description = "Unauthorized")),
    security(("bearer" = [])))]
pub async fn list_workers(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return Problem::new(StatusCode::BAD_REQUEST, "invalid-query", "Invalid query", "limit must be a number")
            .into_response();
    };
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-query",
            "Invalid query",
            format!("limit must be 1 to {MAX_PAGE}"),
        )
        .into_response();
    }
    match state.workers.domain.list_workers(principal.as_str(), limit, q.cursor.as_deref()).await {
        Ok(rows) => {
            let next_cursor =
                (rows.len() == limit as usize).then(|| rows.last().map(|w| w.worker_id.clone())).flatten();
            Json(WorkerPage { workers: rows.into_iter().map(Worker::from).collect(), next_cursor }).into_response()
        }
        Err(e) => ServiceError::from(e).into_response(),
    }
}

/// Deletes a worker, its lease, node allocation and VM.
#[utoipa::path(delete, path = "/v1/workers/{id}", tag = "workers",
    params(("id" = String, Path, description = "Worker id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation")),
    responses((status = 204, description = "Deleted (replayed on every retry)"), (status = 401, description = "Unauthorized"),
              (status = 429, description = "Over the principal's rate limit (with --rate-limit)"),
              (status = 404, description = "No such worker"), (status = 503, description = "Hypervisor unavailable")),
    security(("bearer" = [])))]
pub async fn delete_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: Option<Extension<IdempotencyContext>>,
    Path(id): Path<String>,
) -> Response {
    let ctx = match context(ctx) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let op = Operation::new(ctx.claim().record().clone());
    match state.workers.delete(principal.as_str(), &id, &op).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reboots a worker: once per key, ever.
#[utoipa::path(post, path = "/v1/workers/{id}/reboot", tag = "workers",
    params(("id" = String, Path, description = "Worker id"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation")),
    responses((status = 202, body = RebootResult), (status = 401, description = "Unauthorized"),
              (status = 429, description = "Over the principal's rate limit (with --rate-limit)"),
              (status = 404, description = "No such worker"), (status = 502, description = "Hypervisor refused"),
              (status = 503, description = "Hypervisor unavailable")),
    security(("bearer" = [])))]
pub async fn reboot_worker(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    ctx: Option<Extension<IdempotencyContext>>,
    Path(id): Path<String>,
) -> Response {
    let ctx = match context(ctx) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let op = Operation::new(ctx.claim().record().clone());
    match state.workers.reboot(principal.as_str(), &id, &op).await {
        Ok(reboot_count) => (StatusCode::ACCEPTED, Json(RebootResult { id, reboot_count })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Fleet counts, for operators and the fault harness.
#[utoipa::path(get, path = "/admin/v1/fleet", tag = "admin",
    responses((status = 200, body = Fleet), (status = 401, description = "Unauthorized")),
    security(("bearer" = [])))]
pub async fn fleet(State(state): State<AppState>) -> Response {
    let counts = match state.workers.domain.counts().await {
        Ok(c) => c,
        Err(e) => return ServiceError::from(e).into_response(),
    };
    let vms_running = match state.hypervisor.list_all().await {
        Ok(vms) => vms.iter().filter(|v| v.state == "running").count() as i64,
        Err(e) => {
            return ServiceError::UpstreamUnavailable { reason: format!("cannot list VMs: {e}"), retry_after: 1 }
                .into_response();
        }
    };
    Json(Fleet {
        nodes_total: counts.nodes_total,
        nodes_allocated: counts.nodes_allocated,
        leases_active: counts.leases_active,
        workers_active: counts.workers_active,
        vms_running,
        vm_boots_total: counts.boots_done,
        reboots_total: counts.reboots_done,
    })
    .into_response()
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "Up")))]
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// The store answers.
#[utoipa::path(get, path = "/readyz", tag = "ops", responses((status = 200, description = "Ready"), (status = 503, description = "Store unreachable")))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.ping().await {
        Ok(()) => "ready\n".into_response(),
        // Unauthenticated: the error (a driver message, maybe a host name) goes to the log only.
        Err(e) => {
            tracing::warn!(error = %e, "not ready: the store does not answer");
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable", "Not ready", "the store does not answer")
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use rand::Rng;

    use super::*;

    /// Many bodies with a random string put where serde quotes it (a value of the wrong type, an
    /// unknown field name, a label, a broken document): every detail is bounded and none quotes
    /// the string.
    #[test]
    fn json_error_details_are_bounded_and_never_quote_the_body() {
        let templates = [
            r#"{"image": "i", "cpu": "S", "memory_gb": 1}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "S": 1}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {"S": 1}}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {"k": "v" "S"}}"#,
            r#"{"image": ["S"], "cpu": 1, "memory_gb": 1}"#,
            r#"{"image": "i", "cpu": S, "memory_gb": 1}"#,
            r#"["S"]"#,
            r#""S""#,
        ];
        let mut rng = rand::rng();
        let alphabet: Vec<char> = "abcXYZ019 `\"'\\,:{}[]éß€😀".chars().collect();
        for round in 0..1000 {
            let len = if round % 50 == 0 { rng.random_range(1000..20_000) } else { rng.random_range(24..200) };
            let mut secret: String = (0..len).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect();
            secret.insert_str(0, "canary");
            let escaped = serde_json::to_string(&secret).expect("json");
            let escaped = &escaped[1..escaped.len() - 1];
            for t in templates {
                let body = t.replace('S', escaped);
                let Err(e) = serde_json::from_slice::<crate::service::CreateWorker>(body.as_bytes()) else { continue };
                let detail = json_error_detail(&e);
                assert!(!detail.is_empty() && detail.len() <= MAX_DETAIL, "{} bytes for {t}", detail.len());
                assert!(!detail.contains("canary"), "{t}: {detail}");
                let chars: Vec<char> = secret.chars().take(400).collect();
                for w in chars.windows(12) {
                    let w: String = w.iter().collect();
                    assert!(!detail.contains(&w), "{t}: {detail} quotes {w:?}");
                }
            }
        }
    }

    #[test]
    fn every_configured_token_is_compared_whichever_matches() {
        let tokens: Vec<([u8; 32], Principal)> =
            (0..5).map(|i| (token_digest(&format!("token-{i}")), Principal::new(format!("p{i}")))).collect();
        for (probe, expected) in [
            ("token-0", Some("p0")),
            ("token-3", Some("p3")),
            ("token-4", Some("p4")),
            ("token-", None),
            ("token-00", None),
            ("", None),
        ] {
            let compared = Cell::new(0);
            let found =
                principal_for(tokens.iter().inspect(|_| compared.set(compared.get() + 1)), &token_digest(probe));
            assert_eq!(found.as_ref().map(Principal::as_str), expected, "{probe:?}");
            assert_eq!(compared.get(), tokens.len(), "{probe:?}: every token is compared");
        }
    }

    #[test]
    fn bearer_takes_one_well_formed_header() {
        let headers = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::AUTHORIZATION, HeaderValue::from_str(v).expect("value"));
            }
            h
        };
        assert_eq!(bearer(&headers(&["Bearer abc"])), Some(token_digest("abc")));
        assert_eq!(bearer(&headers(&["bearer abc"])), Some(token_digest("abc")), "the scheme is case-insensitive");
        assert_eq!(bearer(&headers(&[])), None);
        assert_eq!(bearer(&headers(&["Bearer "])), None);
        assert_eq!(bearer(&headers(&["Basic YWJj"])), None);
        assert_eq!(bearer(&headers(&["Bearer abc", "Bearer abc"])), None, "sent twice");
    }
}
