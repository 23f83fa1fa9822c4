//! The client's error type and RFC 9457 problem details.

use std::fmt;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde::{Deserialize, Deserializer, Serialize};

use crate::types::OperationId;

/// An RFC 9457 problem details object, as sent by the server with `application/problem+json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// A URI naming the problem; the last path segment is its short name (`idempotency-key-reused`).
    #[serde(rename = "type", default = "about_blank")]
    pub type_uri: String,
    /// A short human-readable summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The HTTP status the server put in the body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// A human-readable explanation of this occurrence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The extension member `operation_id`: the operation a refusal is about, such as the flash
    /// already running on a node ([`OPERATION_CONFLICT`]). A value that is not a valid
    /// [`OperationId`] is dropped rather than failing the whole problem.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "lenient_operation_id")]
    pub operation_id: Option<OperationId>,
}

fn lenient_operation_id<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<OperationId>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(deserializer)?;
    Ok(value.and_then(|v| v.as_str().and_then(|s| s.parse().ok())))
}

fn about_blank() -> String {
    "about:blank".to_owned()
}

impl Problem {
    /// The problem's short name: the last `/`-separated segment of its `type` URI.
    pub fn name(&self) -> &str {
        self.type_uri.rsplit('/').next().unwrap_or(&self.type_uri)
    }

    /// Whether this problem's short name is `name`.
    pub fn is(&self, name: &str) -> bool {
        self.name() == name
    }

    /// Parses a problem from a response body; `None` when the body is not a problem object.
    pub fn from_body(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        let text = self.detail.as_ref().or(self.title.as_ref());
        if let Some(text) = text {
            write!(f, ": {text}")?;
        }
        // Name the operation once: the detail may already do so.
        match &self.operation_id {
            Some(id) if !text.is_some_and(|t| t.contains(id.as_str())) => write!(f, " (operation {id})"),
            _ => Ok(()),
        }
    }
}

/// The problem name a server uses while the first request with a key is still running
/// ([`Error::InProgress`]).
pub use idempotency::problems::IN_PROGRESS;
/// The problem name a server uses when a key comes back with a different request
/// ([`Error::KeyReused`]).
pub use idempotency::problems::KEY_REUSED;
/// The problem name a server uses when another operation already runs on the resource (a node
/// that is being flashed under a different key); [`Problem::operation_id`] names it. The caller
/// decides whether to follow that operation or try again later.
pub use leasebroker_api::problems::OPERATION_CONFLICT;

/// Why a request did not succeed.
///
/// The variants follow what a caller must do next: retry later ([`Error::is_retryable`]),
/// fix the request, fix the credentials, or look at why the retry budget ran out.
///
/// Each message carries its cause (`to_string()` is the whole line a user needs, as lbctl
/// prints it), so no variant also returns the cause from `source()`: `{:#}` of an `anyhow`
/// chain prints every cause once. The causes stay reachable as fields
/// (`Error::GaveUp { last, .. }`, `Error::Transport(e)`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key was first used with a different request (problem `idempotency-key-reused`, status 409,
    /// 422 or 400). A bug in the caller: never retried.
    #[error("idempotency key reused with a different request ({status}): {problem}")]
    KeyReused {
        /// The status the server answered with.
        status: StatusCode,
        /// The server's problem details.
        problem: Problem,
    },
    /// The first request with this key is still running on the server (409 `request-in-progress`).
    /// Retried by the retry core.
    #[error("in progress (409): {problem}")]
    InProgress {
        /// How long the server asked us to wait (`Retry-After`).
        retry_after: Option<Duration>,
        /// The server's problem details.
        problem: Problem,
    },
    /// The server made a permanent decision against the request (a 4xx such as 400, 404, 409 or 422).
    /// Never retried.
    #[error("refused ({status}){}", fmt_problem(problem))]
    Refused {
        /// The status the server answered with.
        status: StatusCode,
        /// The server's problem details, when it sent any.
        problem: Option<Problem>,
    },
    /// The credentials were missing, wrong or not allowed (401 or 403). Never retried.
    #[error("unauthorized ({status}){}", fmt_problem(problem))]
    Unauthorized {
        /// 401 or 403.
        status: StatusCode,
        /// The server's problem details, when it sent any.
        problem: Option<Problem>,
    },
    /// The server failed or shed load (5xx or 429). Retried by the retry core.
    #[error("server error ({status}){}", fmt_problem(problem))]
    Server {
        /// The status the server answered with.
        status: StatusCode,
        /// How long the server asked us to wait (`Retry-After`).
        retry_after: Option<Duration>,
        /// The server's problem details, when it sent any.
        problem: Option<Problem>,
    },
    /// No complete response arrived: connection refused or reset, timeout, a body cut short.
    /// The request may or may not have been processed. Retried by the retry core.
    #[error("transport error: {}", chain(.0))]
    Transport(reqwest::Error),
    /// The TLS handshake failed (most often: the server's certificate is not trusted; a private CA
    /// needs [`crate::ClientBuilder::ca_certificates_pem`]). Nothing was sent. Never retried: asking
    /// again meets the same certificate.
    #[error("TLS handshake failed: {}", chain(.0))]
    Tls(reqwest::Error),
    /// The retry core stopped: the attempt or time budget ran out while the errors were retryable.
    #[error("gave up after {attempts} attempts in {:.1}s; last error: {last}", elapsed.as_secs_f64())]
    GaveUp {
        /// How many requests were sent.
        attempts: u32,
        /// Time from the first attempt until giving up.
        elapsed: Duration,
        /// The last attempt's error.
        last: Box<Error>,
    },
    /// A success response whose body is not what the API promises.
    #[error("unexpected response body ({status}): {error}")]
    Decode {
        /// The (successful) status of the response.
        status: StatusCode,
        /// Why the body did not parse.
        error: serde_json::Error,
    },
    /// The request could not be built (a bad base URL, an unusable header value). Never retried.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

fn fmt_problem(problem: &Option<Problem>) -> String {
    problem.as_ref().map(|p| format!(": {p}")).unwrap_or_default()
}

/// reqwest's own message hides the cause ("error sending request"); the chain names it.
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// The rustls error somewhere in `err`'s chain. rustls reaches reqwest wrapped in `io::Error`s
/// (two of them), and an `io::Error`'s `source()` skips the error it wraps, so each one is opened
/// with `get_ref()` instead.
fn tls_cause<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(err);
    while let Some(current) = next {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        next = match current.downcast_ref::<std::io::Error>() {
            Some(io) => io.get_ref().map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => current.source(),
        };
    }
    None
}

impl Error {
    /// Whether sending the same request again (with the same key) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::InProgress { .. } | Error::Server { .. } | Error::Transport(_))
    }

    /// The wait the server asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::InProgress { retry_after, .. } | Error::Server { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The HTTP status of the response that caused this error, if there was one.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Error::KeyReused { status, .. }
            | Error::Refused { status, .. }
            | Error::Unauthorized { status, .. }
            | Error::Server { status, .. }
            | Error::Decode { status, .. } => Some(*status),
            Error::InProgress { .. } => Some(StatusCode::CONFLICT),
            Error::GaveUp { last, .. } => last.status(),
            Error::Transport(_) | Error::Tls(_) | Error::InvalidRequest(_) => None,
        }
    }

    /// The server's problem details, if the response carried any.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            Error::KeyReused { problem, .. } | Error::InProgress { problem, .. } => Some(problem),
            Error::Refused { problem, .. } | Error::Unauthorized { problem, .. } | Error::Server { problem, .. } => {
                problem.as_ref()
            }
            Error::GaveUp { last, .. } => last.problem(),
            _ => None,
        }
    }

    pub(crate) fn from_reqwest(err: reqwest::Error) -> Self {
        if err.is_builder() {
            Error::InvalidRequest(chain(&err))
        } else if err.is_connect() && tls_cause(&err).is_some() {
            // The handshake is part of connecting, so the request never went out.
            Error::Tls(err)
        } else {
            Error::Transport(err)
        }
    }

    /// Classifies a complete response. `None` for success (2xx); every other status is an error.
    pub fn from_response(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Option<Self> {
        if status.is_success() {
            return None;
        }
        let problem = Problem::from_body(body);
        // The problem type decides before the status does: the reused-key status is configurable
        // on the server (409, 422 or 400), and 409 also means "in progress" or a handler conflict.
        if let Some(p) = problem.as_ref().filter(|p| p.is(KEY_REUSED)) {
            return Some(Error::KeyReused { status, problem: p.clone() });
        }
        if status == StatusCode::CONFLICT
            && let Some(p) = problem.as_ref().filter(|p| p.is(IN_PROGRESS))
        {
            return Some(Error::InProgress { retry_after: retry_after(headers), problem: p.clone() });
        }
        Some(match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Error::Unauthorized { status, problem },
            StatusCode::TOO_MANY_REQUESTS => Error::Server { status, retry_after: retry_after(headers), problem },
            s if s.is_server_error() => Error::Server { status, retry_after: retry_after(headers), problem },
            // Other 4xx, and the 1xx/3xx a JSON API never sends to this client (redirects are not followed).
            _ => Error::Refused { status, problem },
        })
    }
}

/// Reads `Retry-After` as delay-seconds (RFC 9110 10.2.3); an HTTP-date is not honoured.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}
