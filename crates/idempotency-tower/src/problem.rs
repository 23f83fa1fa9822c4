//! RFC 9457 problem details, and the layer's typed rejections that become them.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, StatusCode};
use idempotency::{ErrorChain, KeyError, RecordId, StoreError, problems};

use crate::config::Config;
use crate::metrics::count;

/// The default prefix of a problem's `type`: `/problems/<name>`.
pub const DEFAULT_PROBLEM_BASE: &str = "/problems/";

/// The media type of every problem response.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem: the body of every error response the layer sends, and a ready-made error
/// type for the service's own handlers.
///
/// The body is `{"type", "title", "status", "detail"}` with `Content-Type: application/problem+json`;
/// `type` is the base (default [`DEFAULT_PROBLEM_BASE`]) followed by the problem's name.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idempotency_tower::Problem;
///
/// let p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "capacity-exhausted", "No free node", "all 64 nodes are leased")
///     .with_retry_after(5);
/// assert_eq!(p.type_uri(), "/problems/capacity-exhausted");
/// let res = p.into_response();
/// assert_eq!(res.status(), 503);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// assert_eq!(res.headers()["retry-after"], "5");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    status: StatusCode,
    base: Cow<'static, str>,
    name: String,
    title: String,
    detail: String,
    /// Seconds (bounded to `u32`, 136 years), kept small so that a `Result<_, Problem>` is too.
    retry_after: Option<u32>,
    /// Extension members (RFC 9457 section 3.2); boxed, since most problems have none.
    extensions: Option<Box<serde_json::Map<String, serde_json::Value>>>,
}

#[derive(serde::Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    extensions: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// The members RFC 9457 defines, which an extension may not replace.
const STANDARD_MEMBERS: [&str; 5] = ["type", "title", "status", "detail", "instance"];

impl Problem {
    /// A problem with `status`, the short `name` its `type` ends in (`idempotency-key-reused`), a
    /// human `title` that is the same for every occurrence, and a `detail` about this one.
    pub fn new(status: StatusCode, name: &str, title: &str, detail: impl Into<String>) -> Self {
        Self {
            status,
            base: Cow::Borrowed(DEFAULT_PROBLEM_BASE),
            name: name.to_owned(),
            title: title.to_owned(),
            detail: detail.into(),
            retry_after: None,
            extensions: None,
        }
    }

    /// Adds the extension member `name` (RFC 9457 section 3.2) with `value`, e.g. the id of the
    /// operation a conflict names. Adding a name again replaces its value; the standard members
    /// (`type`, `title`, `status`, `detail`, `instance`) cannot be replaced and are left as they
    /// are.
    ///
    /// ```
    /// use http::StatusCode;
    /// use idempotency_tower::Problem;
    ///
    /// let p = Problem::new(StatusCode::CONFLICT, "operation-conflict", "Busy", "op-1 runs")
    ///     .with_extension("operation_id", "op-1")
    ///     .with_extension("status", 200);
    /// let body: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap();
    /// assert_eq!((body["operation_id"].as_str(), body["status"].as_u64()), (Some("op-1"), Some(409)));
    /// ```
    pub fn with_extension(mut self, name: impl Into<String>, value: impl Into<serde_json::Value>) -> Self {
        let name = name.into();
        if !STANDARD_MEMBERS.contains(&name.as_str()) {
            self.extensions.get_or_insert_default().insert(name, value.into());
        }
        self
    }

    /// The value of the extension member `name`, if it was added.
    pub fn extension(&self, name: &str) -> Option<&serde_json::Value> {
        self.extensions.as_ref()?.get(name)
    }

    /// Adds `Retry-After: <secs>` to the response.
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(u32::try_from(secs).unwrap_or(u32::MAX));
        self
    }

    /// Replaces the `type` prefix (default `/problems/`), e.g. `https://errors.example.com/`.
    pub fn with_base(mut self, base: impl Into<Cow<'static, str>>) -> Self {
        self.base = base.into();
        self
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The short name that `type` ends in.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The `type` URI: base and name.
    pub fn type_uri(&self) -> String {
        format!("{}{}", self.base, self.name)
    }

    /// The title.
    pub fn title(&self) -> &str {
        &self.title
    }

    /// The detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The `Retry-After` seconds, if any.
    pub fn retry_after(&self) -> Option<u64> {
        self.retry_after.map(u64::from)
    }

    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        let type_uri = self.type_uri();
        let body = Body {
            type_uri: &type_uri,
            title: &self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
            extensions: self.extensions.as_deref(),
        };
        // Serialising plain fields and JSON values cannot fail; the fallback keeps that a
        // non-panic anyway.
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec())
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.title, self.detail)
    }
}

impl std::error::Error for Problem {}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut res = (self.status, self.to_json()).into_response();
        res.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after {
            res.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// Why the layer answered a request itself instead of (or after) running the handler. Every such
/// answer is built here, in [`Rejection::into_problem`].
#[derive(Debug)]
pub(crate) enum Rejection {
    MissingKey,
    InvalidKey(KeyError),
    /// A key from another source (docs/protocol.md#records) that is invalid, or two different keys; the detail
    /// says which.
    InvalidKeySource(String),
    /// `Repeatability-First-Sent` is older than the retention.
    RepeatabilityExpired {
        age: Duration,
        retention: Duration,
    },
    BodyTooLarge {
        limit: usize,
    },
    BodyUnreadable,
    BodyTimeout,
    TooManyRecords {
        retry_after: Duration,
    },
    PrincipalMissing,
    Mismatch,
    InProgress {
        retry_after: Duration,
    },
    StoreUnavailable(StoreError),
    HandlerPanicked,
    ResponseBodyFailed,
    StoredResponseCorrupt,
    ResponseTooLarge {
        limit: usize,
    },
    /// A retry of an uncertain record, held until an operator resolves it (`409`).
    UncertainHeld {
        record_id: RecordId,
    },
    /// The handler did not know whether its request acted; the record is uncertain (`504`).
    OutcomeUnknown {
        record_id: RecordId,
    },
    /// A probe could not tell what became of an uncertain record's request (`503`).
    ProbeUnanswered {
        record_id: RecordId,
        retry_after: Duration,
    },
}

/// How long a client is told to wait after the store failed: long enough not to hammer a
/// recovering database, short enough that a blip costs little.
const STORE_RETRY_AFTER_SECS: u64 = 1;

impl Rejection {
    /// The `outcome` label of `idempotency_requests_total` for this rejection.
    pub(crate) fn outcome(&self) -> &'static str {
        match self {
            Self::MissingKey => "missing_key",
            Self::InvalidKey(_) | Self::InvalidKeySource(_) => "invalid_key",
            Self::RepeatabilityExpired { .. } => "repeatability_expired",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::BodyUnreadable => "body_unreadable",
            Self::BodyTimeout => "body_timeout",
            Self::TooManyRecords { .. } => "too_many_records",
            Self::PrincipalMissing => "principal_missing",
            Self::Mismatch => "mismatch",
            Self::InProgress { .. } => "in_progress",
            Self::StoreUnavailable(_) => "store_unavailable",
            Self::HandlerPanicked => "panicked",
            Self::ResponseBodyFailed => "handler_failed",
            Self::StoredResponseCorrupt => "replay_failed",
            Self::ResponseTooLarge { .. } => "response_too_large",
            Self::UncertainHeld { .. } | Self::OutcomeUnknown { .. } | Self::ProbeUnanswered { .. } => "uncertain",
        }
    }

    pub(crate) fn into_problem(self, cfg: &Config) -> Problem {
        // The store's error is a driver message (host names, SQL): logged, never sent.
        if let Self::StoreUnavailable(e) = &self {
            tracing::warn!(error = %ErrorChain(e), "idempotency store unavailable");
        }
        let status = self.status(cfg);
        let (name, title) = self.kind();
        let (retry_after, record_id) = (self.retry_after(), self.record_id());
        let mut p = Problem::new(status, name, title, self.detail()).with_base(cfg.problem_base.clone());
        if let Some(secs) = retry_after {
            p = p.with_retry_after(secs);
        }
        if let Some(record_id) = record_id {
            p = p.with_extension("record_id", record_id.to_hex());
        }
        p
    }

    /// The status the rejection is answered with.
    fn status(&self, cfg: &Config) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey(_) | Self::InvalidKeySource(_) | Self::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Self::RepeatabilityExpired { .. } => StatusCode::PRECONDITION_FAILED,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::TooManyRecords { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::PrincipalMissing => StatusCode::UNAUTHORIZED,
            Self::Mismatch => cfg.mismatch_status.status(),
            Self::InProgress { .. } | Self::UncertainHeld { .. } => StatusCode::CONFLICT,
            Self::StoreUnavailable(_) | Self::ProbeUnanswered { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::HandlerPanicked | Self::ResponseBodyFailed | Self::StoredResponseCorrupt => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::ResponseTooLarge { .. } => StatusCode::GONE,
            Self::OutcomeUnknown { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The problem type's name and its title.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Self::MissingKey => (problems::KEY_MISSING, "Idempotency-Key required"),
            Self::InvalidKey(_) | Self::InvalidKeySource(_) => (problems::KEY_INVALID, "Invalid Idempotency-Key"),
            Self::RepeatabilityExpired { .. } => (problems::REPEATABILITY_EXPIRED, "Repeatability window passed"),
            Self::BodyTooLarge { .. } => (problems::BODY_TOO_LARGE, "Request body too large"),
            Self::BodyUnreadable => (problems::BODY_UNREADABLE, "Request body could not be read"),
            Self::BodyTimeout => (problems::BODY_TIMEOUT, "Request body too slow"),
            Self::TooManyRecords { .. } => (problems::TOO_MANY_REQUESTS, "Too many requests"),
            Self::PrincipalMissing => (problems::PRINCIPAL_MISSING, "Principal missing"),
            Self::Mismatch => (problems::KEY_REUSED, "Idempotency-Key reused"),
            Self::InProgress { .. } => (problems::IN_PROGRESS, "Request in progress"),
            Self::StoreUnavailable(_) => (problems::STORE_UNAVAILABLE, "Idempotency store unavailable"),
            Self::HandlerPanicked => (problems::HANDLER_PANICKED, "Internal error"),
            Self::ResponseBodyFailed => (problems::RESPONSE_BODY_FAILED, "Internal error"),
            Self::StoredResponseCorrupt => (problems::STORED_RESPONSE_CORRUPT, "Stored response unreadable"),
            Self::ResponseTooLarge { .. } => (problems::RESPONSE_TOO_LARGE, "Response not stored"),
            Self::UncertainHeld { .. } | Self::OutcomeUnknown { .. } | Self::ProbeUnanswered { .. } => {
                (problems::OUTCOME_UNCERTAIN, "Outcome uncertain")
            }
        }
    }

    /// `Retry-After`, in whole seconds, where the client is told when to come back.
    fn retry_after(&self) -> Option<u64> {
        match self {
            Self::TooManyRecords { retry_after }
            | Self::InProgress { retry_after }
            | Self::ProbeUnanswered { retry_after, .. } => Some(ceil_secs(*retry_after)),
            Self::StoreUnavailable(_) => Some(STORE_RETRY_AFTER_SECS),
            _ => None,
        }
    }

    /// The uncertain record the rejection is about (the `record_id` member).
    fn record_id(&self) -> Option<RecordId> {
        match self {
            Self::UncertainHeld { record_id }
            | Self::OutcomeUnknown { record_id }
            | Self::ProbeUnanswered { record_id, .. } => Some(*record_id),
            _ => None,
        }
    }

    /// What the client reads: what happened, and what to do next. Never a driver's or a reader's
    /// own message (those go to the log).
    fn detail(self) -> Cow<'static, str> {
        match self {
            Self::MissingKey => "this endpoint requires an Idempotency-Key header; send one key per logical operation \
                                 and reuse it on every retry"
                .into(),
            Self::InvalidKey(e) => format!("{e}; a key is 1 to 128 visible ASCII characters, sent once").into(),
            Self::InvalidKeySource(detail) => detail.into(),
            Self::RepeatabilityExpired { age, retention } => format!(
                "Repeatability-First-Sent is {} s ago, longer than the {} s a request is remembered; it may \
                 have run already and its record be gone, so it is not run; send it as a new request (a new \
                 Repeatability-Request-ID)",
                age.as_secs(),
                retention.as_secs()
            )
            .into(),
            Self::BodyTooLarge { limit } => format!("the request body exceeds {limit} bytes").into(),
            Self::BodyUnreadable => {
                "the request body broke off before its end; nothing was stored, retry with the same key".into()
            }
            Self::BodyTimeout => {
                "the request body did not arrive in time; nothing was stored, retry with the same key".into()
            }
            Self::TooManyRecords { .. } => "this principal holds as many idempotency records as it may; nothing was \
                                            stored, retry after Retry-After seconds, when older records have expired"
                .into(),
            Self::PrincipalMissing => {
                "the request carries no identity to scope its idempotency key to; authenticate and retry".into()
            }
            Self::Mismatch => "this key was already used for a different request (method, path, query, content type \
                               or body differ); use a new key for a new operation"
                .into(),
            Self::InProgress { .. } => {
                "a request with this key is still being processed; retry later with the same key".into()
            }
            Self::StoreUnavailable(_) => "the request was not processed; retry with the same key".into(),
            Self::HandlerPanicked => {
                "the handler failed unexpectedly; nothing was stored, a retry with the same key runs it again".into()
            }
            Self::ResponseBodyFailed => {
                "the handler's response body failed; a retry with the same key runs it again".into()
            }
            Self::StoredResponseCorrupt => "the response stored under this key cannot be replayed".into(),
            Self::ResponseTooLarge { limit } => format!(
                "the request with this key was executed, but its response was larger than the {limit} bytes \
                 kept for replay, so it cannot be replayed; it will not run again; read the resulting state \
                 instead"
            )
            .into(),
            Self::UncertainHeld { record_id } => format!(
                "record {}: the request with this key was sent on and whether it acted is unknown; it \
                 is not run again until an operator resolves the record",
                record_id.to_hex()
            )
            .into(),
            Self::OutcomeUnknown { record_id } => format!(
                "record {}: the request was sent on and its answer was lost, so whether it acted is \
                 unknown; a retry with the same key does not run it again on a guess",
                record_id.to_hex()
            )
            .into(),
            Self::ProbeUnanswered { record_id, .. } => format!(
                "record {}: whether the request with this key acted could not be found out now; \
                 retry with the same key later",
                record_id.to_hex()
            )
            .into(),
        }
    }
}

/// Whole seconds, rounded up, at least one: `Retry-After: 0` would invite a busy loop.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    s.max(1)
}

/// Turns a rejection into its response, counting and tracing it. The current span (the
/// request's, inside the protected path) gets the outcome.
pub(crate) fn rejection_response(cfg: &Config, rejection: Rejection) -> Response {
    let outcome = rejection.outcome();
    count(outcome);
    let problem = rejection.into_problem(cfg);
    crate::metrics::record_outcome(outcome, problem.status().as_u16());
    tracing::debug!(outcome, status = problem.status().as_u16(), "idempotency rejection");
    let mut response = problem.into_response();
    response.extensions_mut().insert(crate::metrics::Outcome(outcome));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_shape() {
        let p = Problem::new(StatusCode::CONFLICT, "idempotency-key-reused", "Reused", "detail here")
            .with_base("https://errors.example.com/");
        let v: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "type": "https://errors.example.com/idempotency-key-reused",
                "title": "Reused",
                "status": 409,
                "detail": "detail here",
            })
        );
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1500)), 2);
        assert_eq!(ceil_secs(Duration::from_secs(3)), 3);
    }
}
