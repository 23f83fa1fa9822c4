//! What the layer is configured with, shared by every service it makes.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use idempotency::{Fingerprinter, Principal, Record, ResponsePolicy, Store};

/// Whether a route takes an `Idempotency-Key` (docs/protocol.md#the-key). Only consulted for POST, PUT, PATCH
/// and DELETE; GET, HEAD, OPTIONS (and any other method) always pass through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum RoutePolicy {
    /// A key is required: a request without one gets `400 idempotency-key-missing`.
    #[default]
    Required,
    /// A key is honoured when sent; a request without one runs unprotected.
    Optional,
    /// The layer ignores the route entirely, header or not.
    Off,
}

/// The status of `idempotency-key-reused`, the answer to a key sent again with a different
/// request: one of the three that implementations use, so no other can be configured.
///
/// With feature `clap` it is a `clap::ValueEnum` whose values are the numbers, as a command-line
/// flag takes them (`--mismatch-status 422`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[non_exhaustive]
pub enum MismatchStatus {
    /// 409 Conflict, the default.
    #[default]
    #[cfg_attr(feature = "clap", value(name = "409"))]
    Conflict,
    /// 422 Unprocessable Content, as the IETF draft has it.
    #[cfg_attr(feature = "clap", value(name = "422"))]
    UnprocessableContent,
    /// 400 Bad Request, as Stripe answers.
    #[cfg_attr(feature = "clap", value(name = "400"))]
    BadRequest,
}

impl MismatchStatus {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::Conflict => StatusCode::CONFLICT,
            Self::UnprocessableContent => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BadRequest => StatusCode::BAD_REQUEST,
        }
    }
}

impl From<MismatchStatus> for StatusCode {
    fn from(status: MismatchStatus) -> Self {
        status.status()
    }
}

impl fmt::Display for MismatchStatus {
    /// The number: `409`, `422` or `400`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.status().as_u16())
    }
}

/// What the record of a terminal response larger than
/// [`max_stored_response`](crate::IdempotencyLayerBuilder::max_stored_response) keeps. Either
/// way the client that made the request gets the whole response, streamed, and the handler never
/// runs again for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum OversizeResponse {
    /// A short `410 response-too-large` problem in the response's place (the default): a
    /// retry learns that the request ran and that its answer is gone.
    #[default]
    Problem,
    /// The response's status and replayable headers, without its body: a retry gets them with an
    /// empty body and `Idempotency-Body-Omitted: true` (a proxy's choice, where the status and
    /// `Location` are what a client needs).
    HeadersOnly,
}

/// The body field AIP-155 names for a request's key.
pub const AIP_155_REQUEST_ID: &str = "request_id";

/// Which sources besides the `Idempotency-Key` header a route takes its key from; every route
/// reads `Idempotency-Key`, and by default nothing else. Set per route with
/// [`IdempotencyLayerBuilder::key_sources`](crate::IdempotencyLayerBuilder::key_sources).
///
/// A request that carries its key in two places with two different values is refused with
/// `400 idempotency-key-invalid`; the same value twice is one key.
///
/// ```
/// use idempotency_tower::KeySources;
///
/// let azure = KeySources::default().repeatability();
/// let google = KeySources::default().body_field("request_id");
/// assert!(azure.accepts_repeatability() && google.field() == Some("request_id"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeySources {
    pub(crate) repeatability: bool,
    pub(crate) field: Option<Cow<'static, str>>,
}

impl KeySources {
    /// Also take the key from `Repeatability-Request-ID` (OASIS Repeatable Requests 1.0, Azure's
    /// REST guidelines). The request must also carry `Repeatability-First-Sent`, an HTTP-date; a
    /// first sending longer ago than the layer's retention is refused with
    /// `412 repeatability-expired` (the record may already be gone, so running it again could
    /// repeat it). Every answer to such a request carries `Repeatability-Result: accepted` when
    /// the request was executed or replayed, `rejected` when the layer refused it.
    pub fn repeatability(mut self) -> Self {
        self.repeatability = true;
        self
    }

    /// Also take the key from the top-level string field `name` of a JSON object body, as
    /// AIP-155 does with [`request_id`](AIP_155_REQUEST_ID). A field that is absent or `null`
    /// means no key; any other value than a valid key string (a number, an empty string) is
    /// refused with `400 idempotency-key-invalid`. The route reads its body before it knows the
    /// key, so its body limit applies to keyless requests too.
    pub fn body_field(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.field = Some(name.into());
        self
    }

    /// Whether `Repeatability-Request-ID` is read.
    pub fn accepts_repeatability(&self) -> bool {
        self.repeatability
    }

    /// The body field read, if any.
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    pub(crate) fn into_field(self) -> Option<Cow<'static, str>> {
        self.field
    }
}

pub(crate) type PrincipalFn = dyn Fn(&Parts) -> Option<Principal> + Send + Sync;
pub(crate) type PolicyFn = dyn Fn(&Method, &str) -> RoutePolicy + Send + Sync;
pub(crate) type KeySourcesFn = dyn Fn(&Method, &str) -> KeySources + Send + Sync;
pub(crate) type OperationLinkFn = dyn Fn(&Record) -> Option<String> + Send + Sync;

pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) principal: Box<PrincipalFn>,
    pub(crate) policy: Box<PolicyFn>,
    /// Where else than `Idempotency-Key` a route's key comes from; `None`: nowhere.
    pub(crate) key_sources: Option<Box<KeySourcesFn>>,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) response_policy: ResponsePolicy,
    pub(crate) mismatch_status: MismatchStatus,
    pub(crate) in_flight_ttl: Duration,
    pub(crate) retention: Duration,
    pub(crate) body_limit: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) wait_for_in_flight: Duration,
    /// The longest wait a `Prefer: wait=N` gets.
    pub(crate) max_wait: Duration,
    /// The first and the longest time between two reads of a record a request waits for.
    pub(crate) wait_poll: (Duration, Duration),
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) compression_threshold: usize,
    pub(crate) problem_base: Cow<'static, str>,
    pub(crate) max_stored_response: usize,
    pub(crate) oversize: OversizeResponse,
    pub(crate) completion_retry: CompletionRetry,
    pub(crate) anonymous: Option<Principal>,
    pub(crate) operation_link: Option<Box<OperationLinkFn>>,
    pub(crate) stale_claims: crate::uncertain::StaleClaims,
    pub(crate) on_uncertain: crate::uncertain::OnUncertain,
    /// What the layer keeps while it runs, apart from what it was configured with.
    pub(crate) state: crate::runtime::Runtime,
}

/// How a failed `complete` is retried in the background.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CompletionRetry {
    pub(crate) times: usize,
    pub(crate) first_delay: Duration,
    pub(crate) max_delay: Duration,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("fingerprinter", &self.fingerprinter)
            .field("response_policy", &self.response_policy)
            .field("mismatch_status", &self.mismatch_status)
            .field("in_flight_ttl", &self.in_flight_ttl)
            .field("retention", &self.retention)
            .field("body_limit", &self.body_limit)
            .field("replay_headers", &self.replay_headers)
            .field("wait_for_in_flight", &self.wait_for_in_flight)
            .field("max_wait", &self.max_wait)
            .field("in_progress_retry_after", &self.in_progress_retry_after)
            .field("compression_threshold", &self.compression_threshold)
            .field("problem_base", &self.problem_base)
            .field("max_stored_response", &self.max_stored_response)
            .field("oversize", &self.oversize)
            .field("completion_retry", &self.completion_retry)
            .field("anonymous", &self.anonymous)
            .field("stale_claims", &self.stale_claims)
            .field("on_uncertain", &self.on_uncertain)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The default principal: one an authentication middleware outside the layer put into the
/// request's extensions, else none (the request is refused unless the layer was told to share
/// an anonymous scope).
pub(crate) fn default_principal(parts: &Parts) -> Option<Principal> {
    parts.extensions.get::<Principal>().cloned()
}

/// The default route policy: every mutating route requires a key.
pub(crate) fn default_policy(_: &Method, _: &str) -> RoutePolicy {
    RoutePolicy::Required
}

/// The methods the layer protects (docs/protocol.md#the-key).
pub(crate) fn is_mutating(method: &Method) -> bool {
    matches!(*method, Method::POST | Method::PUT | Method::PATCH | Method::DELETE)
}

/// Response headers never replayed, even when configured: they describe one connection or one
/// moment (`Date`), carry per-client state (`Set-Cookie`), or are recomputed from the replayed
/// body (`Content-Length`).
pub(crate) fn never_replayed(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "set-cookie"
            | "set-cookie2"
            | "date"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
    ) || name == crate::headers::IDEMPOTENT_REPLAYED
}
