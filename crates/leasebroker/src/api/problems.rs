//! Errors as problem+json: every detail bounded, no request body or foreign error text quoted.

use idempotency::ErrorChain;
use std::sync::OnceLock;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idempotency_tower::Problem;
use leasebroker_api::problems;
use regex::Regex;

use crate::db::redact;
use crate::domain::DomainError;
use crate::service::ServiceError;

/// The longest problem `detail` the service sends: details are short, fixed texts or a bounded
/// description; they never quote the request body or carry another system's error text.
pub const MAX_DETAIL: usize = 300;

/// Cuts `detail` to at most [`MAX_DETAIL`] bytes, at a character boundary.
pub(super) fn bounded(mut detail: String) -> String {
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

/// What a handler fails with: a problem it wrote itself (bad input, a conflict it found), or a
/// service error (each maps to its problem). Handlers return `Result<_, ApiError>` and use `?`.
#[derive(Debug)]
pub enum ApiError {
    /// A problem as it is.
    Problem(Problem),
    /// A service error, answered as its problem.
    Service(ServiceError),
}

impl From<Problem> for ApiError {
    fn from(p: Problem) -> Self {
        Self::Problem(p)
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        Self::Service(e)
    }
}

impl From<DomainError> for ApiError {
    fn from(e: DomainError) -> Self {
        Self::Service(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Problem(p) => p.into_response(),
            Self::Service(e) => e.into_response(),
        }
    }
}

impl IntoResponse for ServiceError {
    fn into_response(self) -> Response {
        match self {
            Self::Invalid(detail) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                problems::VALIDATION_FAILED,
                "Invalid request",
                bounded(detail),
            ),
            Self::NotFound(_) => {
                Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "No such worker", "no such worker")
            }
            Self::CapacityExhausted => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                problems::CAPACITY_EXHAUSTED,
                "No free node",
                self.to_string(),
            )
            .with_retry_after(5),
            Self::QuotaExceeded(_) => {
                Problem::new(StatusCode::FORBIDDEN, problems::QUOTA_EXCEEDED, "Worker quota exceeded", self.to_string())
            }
            // The reason names the hypervisor's address and quotes its answer: the log gets it,
            // the tenant a fixed text.
            Self::UpstreamUnavailable { ref reason, retry_after } => {
                tracing::warn!(reason = %redact(reason), "hypervisor unavailable");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    problems::UPSTREAM_UNAVAILABLE,
                    "Hypervisor unavailable",
                    "the hypervisor could not complete the call; retry with the same key",
                )
                .with_retry_after(retry_after)
            }
            Self::UpstreamRefused(ref reason) => {
                tracing::warn!(reason = %redact(reason), "hypervisor refused a call");
                Problem::new(
                    StatusCode::BAD_GATEWAY,
                    problems::UPSTREAM_UNAVAILABLE,
                    "Hypervisor refused the call",
                    "the hypervisor refused the call",
                )
            }
            Self::NoSuchNode(_) => {
                Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "No such node", "no such node")
            }
            Self::NoSuchOperation(_) => {
                Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "No such operation", "no such operation")
            }
            Self::OperationConflict { op_id, uncertain } => return operation_conflict(&op_id, uncertain),
            Self::OperationNotUncertain { op_id, state } => {
                let detail =
                    format!("operation {op_id} is {state}: only an uncertain operation is resolved by an operator");
                return Problem::new(
                    StatusCode::CONFLICT,
                    problems::OPERATION_NOT_UNCERTAIN,
                    "Operation not uncertain",
                    detail,
                )
                .with_extension("operation_id", op_id)
                .into_response();
            }
            Self::Gone(_) => {
                Problem::new(StatusCode::GONE, problems::WORKER_DELETED, "Worker deleted", self.to_string())
            }
            Self::Database(e) => database_problem(&e),
        }
        .into_response()
    }
}

/// The problem for a database error. When the database cannot be reached or cannot take the
/// statement now (connection refused or cut, pool timeout, shutdown, a read-only standby after a
/// failover, lack of space), the answer is the one the layer gives for a store outage, on every
/// route (docs/protocol.md#running-leasebroker): `503 store-unavailable` with `Retry-After`. Anything else is a defect of
/// the service: `500 internal`, not stored, so the retry runs again.
fn database_problem(e: &DomainError) -> Problem {
    // An attempt overtaken while it ran (its claim went stale and the reaper took the operation
    // to roll it back, or an overlapping attempt finished it): not a defect. The key is held by
    // whoever overtook it; its completion is fenced out, so nothing is stored, and the retry
    // finds the operation rolled back (and runs afresh) or finished (and gets its answer).
    if matches!(e, DomainError::RolledBack | DomainError::Finished) {
        tracing::warn!(error = %ErrorChain(e), "this attempt was overtaken; the client retries");
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            idempotency::problems::IN_PROGRESS,
            "Request in progress",
            "another attempt or the reaper took this operation over while this attempt ran; retry with the same key",
        )
        .with_retry_after(1);
    }
    tracing::error!(error = %ErrorChain(e), "database error");
    match e {
        DomainError::Db(e) if store_outage(e) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            idempotency::problems::STORE_UNAVAILABLE,
            "Store unavailable",
            "the database does not answer; retry with the same key",
        )
        .with_retry_after(STORE_RETRY_AFTER_SECS),
        _ => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            idempotency::problems::INTERNAL,
            "Internal error",
            "the request failed; nothing was stored, a retry with the same key runs it again",
        ),
    }
}

/// `Retry-After` of `store-unavailable`, as the layer sends it.
const STORE_RETRY_AFTER_SECS: u64 = 1;

/// Whether `e` means the database is unreachable or cannot take writes now, rather than a
/// defect: classified by the error's kind and SQLSTATE (PostgreSQL) or result code (SQLite),
/// never by its text.
pub(crate) fn store_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => true,
        // SQLite's codes are numbers, and so are many SQLSTATEs (25006, 55000, 57014): which
        // driver answered decides how the code reads.
        sqlx::Error::Database(db) => match db.code() {
            Some(code) if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() => sqlite_outage(&code),
            Some(code) => postgres_outage(&code),
            None => false,
        },
        _ => false,
    }
}

/// PostgreSQL: class 08 (connection exception), 53 (insufficient resources: disk full, too many
/// connections), 57P01-57P03 (shutdown, crash, cannot connect now), 57014 (statement timeout),
/// 25006 (a read-only transaction: the host is a standby, as after a failover), 55000 (what a
/// new connection gets from a database that does not accept connections now), 40001 and 40P01
/// (serialization failure, deadlock: retryable), 55P03 (a lock not granted within
/// `lock_timeout`: another session holds it, perhaps a stopped replica's) and 25P03 (this
/// session sat idle in its transaction past `idle_in_transaction_session_timeout`, as a stopped
/// replica's does: the server ended it, and nothing of it was committed).
fn postgres_outage(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "57014" | "25006" | "55000" | "40001" | "40P01" | "55P03" | "25P03"
        )
}

/// SQLite: BUSY (5), LOCKED (6), IOERR (10), FULL (13), CANTOPEN (14), and their extended codes.
fn sqlite_outage(code: &str) -> bool {
    code.parse::<u32>().is_ok_and(|sqlite| matches!(sqlite & 0xff, 5 | 6 | 10 | 13 | 14))
}

/// `409 operation-conflict`: another operation runs on the node, or ended `uncertain` there. The
/// problem names it in the extension member `operation_id` (RFC 9457 section 3.2), and `Link`
/// points at it.
fn operation_conflict(op_id: &str, uncertain: bool) -> Response {
    let (title, detail) = if uncertain {
        (
            "An uncertain operation holds this node",
            format!(
                "operation {op_id} on this node ended uncertain: whether its flash took cannot be read; check the \
                 machine and resolve it (POST /admin/v1/operations/{op_id}/resolve) before flashing again"
            ),
        )
    } else {
        (
            "Another operation runs on this node",
            format!(
                "operation {op_id} is running on this node; follow it, or try again with a new key when it has ended"
            ),
        )
    };
    let problem = Problem::new(StatusCode::CONFLICT, problems::OPERATION_CONFLICT, title, detail);
    let mut r = problem.with_extension("operation_id", op_id).into_response();
    if let Ok(link) = axum::http::HeaderValue::from_str(&format!("</admin/v1/operations/{op_id}>; rel=\"related\"")) {
        r.headers_mut().insert(header::LINK, link);
    }
    r
}

pub(super) fn parse_json<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: &Bytes,
    key_field: Option<&str>,
) -> Result<T, Problem> {
    let json_ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json_ct {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            problems::UNSUPPORTED_MEDIA_TYPE,
            "Unsupported media type",
            "send Content-Type: application/json",
        ));
    }
    let parsed = match key_field {
        // The key's field was read by the idempotency layer; the request type does not have it.
        Some(field) => serde_json::from_slice::<serde_json::Value>(body).and_then(|mut v| {
            if let Some(map) = v.as_object_mut() {
                map.remove(field);
            }
            T::deserialize(v)
        }),
        None => serde_json::from_slice(body),
    };
    parsed.map_err(|e| {
        use serde_json::error::Category;
        if key_field.is_none() && e.to_string().starts_with("unknown field `request_id`") {
            return Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                problems::VALIDATION_FAILED,
                "Invalid request",
                "request_id: this service reads a key from the body only when started with \
                 --key-sources request-id; send the key in Idempotency-Key",
            );
        }
        let detail = json_error_detail(&e);
        match e.classify() {
            Category::Data => {
                Problem::new(StatusCode::UNPROCESSABLE_ENTITY, problems::VALIDATION_FAILED, "Invalid request", detail)
            }
            _ => Problem::new(StatusCode::BAD_REQUEST, problems::MALFORMED_JSON, "Malformed JSON", detail),
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
        let at = if e.line() == 0 { String::new() } else { format!(" at line {} column {}", e.line(), e.column()) };
        return format!("unknown field, expected one of `image`, `cpu`, `memory_gb`, `labels`{at}");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overtaken_attempt_is_a_retryable_503_not_an_internal_error() {
        for e in [DomainError::RolledBack, DomainError::Finished] {
            let p = database_problem(&e);
            assert_eq!((p.status(), p.name()), (StatusCode::SERVICE_UNAVAILABLE, "request-in-progress"), "{e}");
        }
        let p = database_problem(&DomainError::Db(sqlx::Error::RowNotFound));
        assert_eq!((p.status(), p.name()), (StatusCode::INTERNAL_SERVER_ERROR, "internal"));
    }
}
