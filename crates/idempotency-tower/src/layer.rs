//! The [`IdempotencyLayer`] and its builder.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{CONTENT_TYPE, LOCATION};
use http::request::Parts;
use http::{HeaderName, Method};
use idempotency::{DEFAULT_MAX_BODY, FingerprintMode, Fingerprinter, Principal, Record, ResponsePolicy, Store};
use tower::Layer;

use crate::config::{
    CompletionRetry, Config, KeySources, KeySourcesFn, MismatchStatus, OperationLinkFn, OversizeResponse, PolicyFn,
    PrincipalFn, RoutePolicy, default_policy, default_principal,
};
use crate::deadline::StoreDeadline;
use crate::detached::DetachedHandlers;
use crate::problem::DEFAULT_PROBLEM_BASE;
use crate::release::Releases;
use crate::runtime::Runtime;
use crate::service::IdempotencyService;
use crate::uncertain::{OnUncertain, StaleClaims};

/// The default time an in-flight claim is honoured before another request may take it over.
pub const DEFAULT_IN_FLIGHT_TTL: Duration = Duration::from_secs(5 * 60);
/// The default time a completed response is kept for replay.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// The default largest request body the layer reads (1 MiB).
pub const DEFAULT_BODY_LIMIT: usize = DEFAULT_MAX_BODY;
/// The default size above which stored response bodies are compressed.
pub const DEFAULT_COMPRESSION_THRESHOLD: usize = 1024;
/// The default `Retry-After` ceiling for `409 request-in-progress`.
pub const DEFAULT_IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default largest response stored for replay (1 MiB).
pub const DEFAULT_MAX_STORED_RESPONSE: usize = 1024 * 1024;
/// The default longest wait a request's `Prefer: wait=N` gets (docs/protocol.md#records).
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);
/// The default first and longest time between two reads of a record a request waits for.
pub const DEFAULT_WAIT_POLL: (Duration, Duration) = (Duration::from_millis(10), Duration::from_millis(500));
/// The default number of times a failed completion is retried.
pub const DEFAULT_COMPLETION_RETRIES: usize = 8;
/// The default wait before the first retry of a failed completion; each wait doubles, up to
/// 5 seconds.
pub const DEFAULT_COMPLETION_RETRY_DELAY: Duration = Duration::from_millis(100);
const MAX_COMPLETION_RETRY_DELAY: Duration = Duration::from_secs(5);
/// The default bound on one store call (3 s): with the store unreachable a request is answered
/// `503 store-unavailable` within 5 s (docs/protocol.md#running-leasebroker), with time to spare for the answer.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(3);
/// The default longest wait of one store call while the store goes on taking other writes
/// (10 s): a queue, not an outage.
pub const DEFAULT_STORE_QUEUE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why [`IdempotencyLayerBuilder::try_build`] refused a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The retention is not longer than the in-flight TTL. A record in flight lives at least the
    /// TTL past its claim's last renewal anyway (docs/protocol.md#records), so that retention would not be the
    /// records'; and a dead attempt's record would expire no later than its claim goes stale, so
    /// the retry after the TTL would find a new record (new sub-keys) instead of resuming the
    /// attempt's side effects through the old ones.
    #[error("the retention ({retention:?}) must be longer than the in-flight TTL ({in_flight_ttl:?})")]
    RetentionNotLongerThanInFlightTtl {
        /// The retention asked for.
        retention: Duration,
        /// The in-flight TTL asked for.
        in_flight_ttl: Duration,
    },
}

/// A [`tower::Layer`] that makes the mutating routes of a service safe to retry with an
/// `Idempotency-Key` header. Build it with [`IdempotencyLayer::builder`]; cloning is cheap.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer").field("config", &self.config).finish()
    }
}

impl IdempotencyLayer {
    /// Starts configuring a layer over `store`.
    pub fn builder(store: Arc<dyn Store>) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            store,
            principal: Box::new(default_principal),
            policy: Box::new(default_policy),
            key_sources: None,
            fingerprint_mode: FingerprintMode::Raw,
            response_policy: ResponsePolicy::default(),
            mismatch_status: MismatchStatus::Conflict,
            in_flight_ttl: DEFAULT_IN_FLIGHT_TTL,
            retention: DEFAULT_RETENTION,
            body_limit: DEFAULT_BODY_LIMIT,
            replay_headers: vec![CONTENT_TYPE, LOCATION],
            wait_for_in_flight: Duration::ZERO,
            max_wait: DEFAULT_MAX_WAIT,
            wait_poll: DEFAULT_WAIT_POLL,
            in_progress_retry_after: DEFAULT_IN_PROGRESS_RETRY_AFTER,
            compression_threshold: DEFAULT_COMPRESSION_THRESHOLD,
            problem_base: Cow::Borrowed(DEFAULT_PROBLEM_BASE),
            max_stored_response: DEFAULT_MAX_STORED_RESPONSE,
            oversize: OversizeResponse::Problem,
            completion_retry: CompletionRetry {
                times: DEFAULT_COMPLETION_RETRIES,
                first_delay: DEFAULT_COMPLETION_RETRY_DELAY,
                max_delay: MAX_COMPLETION_RETRY_DELAY,
            },
            anonymous: None,
            operation_link: None,
            max_records_per_principal: None,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            store_queue_timeout: DEFAULT_STORE_QUEUE_TIMEOUT,
            stale_claims: StaleClaims::default(),
            on_uncertain: OnUncertain::default(),
        }
    }

    /// A layer over `store` with every default.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self::builder(store).build()
    }

    /// The handlers of this layer (and of its clones) still running after their client stopped
    /// waiting, with the completions and releases it retries in the background. A server that
    /// shuts down [`close`](DetachedHandlers::close)s them and [`wait`](DetachedHandlers::wait)s
    /// for them, bounded by its own timeout, so their responses are stored before it exits.
    pub fn detached(&self) -> DetachedHandlers {
        self.config.state.detached.clone()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.config.clone())
    }
}

/// Configures an [`IdempotencyLayer`]; every option has a default.
pub struct IdempotencyLayerBuilder {
    store: Arc<dyn Store>,
    principal: Box<PrincipalFn>,
    policy: Box<PolicyFn>,
    key_sources: Option<Box<KeySourcesFn>>,
    fingerprint_mode: FingerprintMode,
    response_policy: ResponsePolicy,
    mismatch_status: MismatchStatus,
    in_flight_ttl: Duration,
    retention: Duration,
    body_limit: usize,
    replay_headers: Vec<HeaderName>,
    wait_for_in_flight: Duration,
    max_wait: Duration,
    wait_poll: (Duration, Duration),
    in_progress_retry_after: Duration,
    compression_threshold: usize,
    problem_base: Cow<'static, str>,
    max_stored_response: usize,
    oversize: OversizeResponse,
    completion_retry: CompletionRetry,
    anonymous: Option<Principal>,
    operation_link: Option<Box<OperationLinkFn>>,
    max_records_per_principal: Option<u64>,
    store_timeout: Duration,
    store_queue_timeout: Duration,
    stale_claims: StaleClaims,
    on_uncertain: OnUncertain,
}

impl fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("fingerprint_mode", &self.fingerprint_mode)
            .field("mismatch_status", &self.mismatch_status)
            .field("in_flight_ttl", &self.in_flight_ttl)
            .field("retention", &self.retention)
            .field("body_limit", &self.body_limit)
            .field("max_stored_response", &self.max_stored_response)
            .field("anonymous", &self.anonymous)
            .field("max_records_per_principal", &self.max_records_per_principal)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayerBuilder {
    /// Who the request runs as; records are scoped to it, so two principals never share one.
    ///
    /// Default: a [`Principal`] found in the request's extensions (put there by an authentication
    /// middleware outside this layer). When the function returns `None` on a protected request,
    /// the layer answers `401 principal-missing` and does not run the handler: a key it cannot
    /// scope would let two callers share a record, and anyone who learns a key could replay
    /// another caller's response. See [`allow_anonymous`](Self::allow_anonymous) for the
    /// explicit opt-in to one shared scope.
    pub fn principal(mut self, f: impl Fn(&Parts) -> Option<Principal> + Send + Sync + 'static) -> Self {
        self.principal = Box::new(f);
        self
    }

    /// Opt-in: a protected request for which the principal function yields none runs under
    /// `principal` instead of being refused. Every such request shares that one scope, so two
    /// callers that send the same key share one record and one response: only for a service
    /// with no notion of callers (or where every caller is trusted with every response).
    pub fn allow_anonymous(mut self, principal: Principal) -> Self {
        self.anonymous = Some(principal);
        self
    }

    /// The [`RoutePolicy`] of a mutating request, from its method and path (without the query).
    /// Default: [`RoutePolicy::Required`] for every POST, PUT, PATCH and DELETE.
    pub fn policy(mut self, f: impl Fn(&Method, &str) -> RoutePolicy + Send + Sync + 'static) -> Self {
        self.policy = Box::new(f);
        self
    }

    /// Where else than `Idempotency-Key` the key of a mutating request may come from, by its
    /// method and path, next to its [`policy`](Self::policy) (docs/protocol.md#records, "Other key sources"):
    /// `Repeatability-Request-ID` ([`KeySources::repeatability`]) and a JSON body field
    /// ([`KeySources::body_field`], AIP-155's `request_id`). Each names the same record, in the
    /// same scope, as `Idempotency-Key` with that value; a request with two different keys gets
    /// `400 idempotency-key-invalid`. A `Required` route is satisfied by a key from any of its
    /// sources. Default: `Idempotency-Key` only, on every route.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency::MemoryStore;
    /// use idempotency_tower::{IdempotencyLayer, KeySources};
    ///
    /// let layer = IdempotencyLayer::builder(Arc::new(MemoryStore::new()))
    ///     .key_sources(|_method, path| match path {
    ///         p if p.starts_with("/azure/") => KeySources::default().repeatability(),
    ///         p if p.starts_with("/google/") => KeySources::default().body_field("request_id"),
    ///         _ => KeySources::default(),
    ///     })
    ///     .build();
    /// # let _ = layer;
    /// ```
    pub fn key_sources(mut self, f: impl Fn(&Method, &str) -> KeySources + Send + Sync + 'static) -> Self {
        self.key_sources = Some(Box::new(f));
        self
    }

    /// How the body enters the fingerprint. Default [`FingerprintMode::Raw`]: byte for byte.
    pub fn fingerprint_mode(mut self, mode: FingerprintMode) -> Self {
        self.fingerprint_mode = mode;
        self
    }

    /// Which statuses are terminal (stored and replayed). Default: every 2xx and
    /// 400, 404, 405, 409, 410, 413, 415, 422; never 5xx, 401, 403, 408, 425, 429.
    pub fn response_policy(mut self, policy: ResponsePolicy) -> Self {
        self.response_policy = policy;
        self
    }

    /// The status of `idempotency-key-reused`: `409` (default), `422` (IETF draft) or `400`
    /// (Stripe).
    pub fn mismatch_status(mut self, status: MismatchStatus) -> Self {
        self.mismatch_status = status;
        self
    }

    /// How long an in-flight claim is honoured without renewal; after that the next request with
    /// the key takes it over and runs the handler again. Default 5 minutes. While a handler runs
    /// the layer renews its claim every quarter of this (a fenced `Store::heartbeat`), so a slow
    /// handler is never run twice at once: the TTL only bounds how long a dead attempt (a
    /// crashed process) blocks its key, and can be short. It must be shorter than the
    /// [`retention`](Self::retention) ([`BuildError::RetentionNotLongerThanInFlightTtl`]).
    pub fn in_flight_ttl(mut self, ttl: Duration) -> Self {
        self.in_flight_ttl = ttl;
        self
    }

    /// How long a completed response is replayed. Default 24 hours. Longer than the
    /// [`in_flight_ttl`](Self::in_flight_ttl), or the layer is refused
    /// ([`BuildError::RetentionNotLongerThanInFlightTtl`]). A record in flight expires no earlier
    /// than a TTL after its claim's last renewal, and every renewal moves its expiry to at least
    /// a retention later, so a handler that runs longer than the retention keeps its record.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The largest request body read on a protected request; larger ones get
    /// `413 body-too-large`. Default 1 MiB.
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = limit;
        self
    }

    /// Also replays response header `name` (default allowlist: `Content-Type`, `Location`).
    /// `Set-Cookie`, `Date`, `Content-Length` and hop-by-hop headers are never replayed.
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        if !self.replay_headers.contains(&name) {
            self.replay_headers.push(name);
        }
        self
    }

    /// How long a request that states no preference waits for a concurrent in-flight request
    /// with its key to finish, to replay its response instead of answering
    /// `409 request-in-progress`. Default zero: answer at once. A request with `Prefer: wait=N`
    /// waits `N` seconds instead, at most [`max_wait`](Self::max_wait).
    ///
    /// A waiter holds nothing (no connection, no lock): it is woken as soon as a request of this
    /// process completes or fails the record, or the store announces that another process did
    /// ([`Store::changes`]: PostgreSQL's LISTEN/NOTIFY), and otherwise reads the record again
    /// with backoff ([`wait_poll`](Self::wait_poll): 10 ms doubling to 500 ms).
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.wait_for_in_flight = wait;
        self
    }

    /// The longest wait a request asking `Prefer: wait=N` (RFC 7240) gets when its key is in
    /// flight: it waits `min(N, max_wait)` for the record to complete, and its replay then says
    /// `Preference-Applied: wait=W` (W that wait, in seconds); still in flight after it, the usual
    /// `409` with `Retry-After` (with `Preference-Applied` too). Default 30 seconds
    /// ([`DEFAULT_MAX_WAIT`]); zero turns the preference off.
    pub fn max_wait(mut self, max: Duration) -> Self {
        self.max_wait = max;
        self
    }

    /// How often a waiting request reads its record again when nothing woke it: first after
    /// `first`, then each time twice as long, at most `max` (default 10 ms and 500 ms,
    /// [`DEFAULT_WAIT_POLL`]). Reading is how a waiter learns of a completion in another process
    /// on a store that announces none (SQLite is one process; Redis); with PostgreSQL's
    /// announcements both can be long.
    pub fn wait_poll(mut self, first: Duration, max: Duration) -> Self {
        self.wait_poll = (first, max.max(first));
        self
    }

    /// The largest `Retry-After` sent with `409 request-in-progress` (default 1 second). The
    /// answer is the smaller of this and the time until the claim goes stale: most handlers
    /// finish in seconds, so telling a client to wait out the whole in-flight TTL would be slow.
    pub fn in_progress_retry_after(mut self, max: Duration) -> Self {
        self.in_progress_retry_after = max;
        self
    }

    /// Stored response bodies longer than this many bytes are zstd-compressed. Default 1 KiB.
    pub fn compression_threshold(mut self, bytes: usize) -> Self {
        self.compression_threshold = bytes;
        self
    }

    /// The prefix of the layer's problem `type`s (default `/problems/`), e.g.
    /// `https://errors.example.com/`.
    pub fn problem_base(mut self, base: impl Into<Cow<'static, str>>) -> Self {
        self.problem_base = base.into();
        self
    }

    /// The largest response body stored for replay, in bytes (default 1 MiB). The layer never
    /// holds more than this of a terminal response in memory. A terminal response that is larger
    /// is still sent whole to the client that made the request (streamed, not buffered), but
    /// its record completes with a short `410 response-too-large` problem in its place: the
    /// handler's side effects happened and must not happen twice, so a retry with the key gets
    /// that problem, replayed, and never runs the handler again.
    pub fn max_stored_response(mut self, bytes: usize) -> Self {
        self.max_stored_response = bytes;
        self
    }

    /// What the record of a response larger than
    /// [`max_stored_response`](Self::max_stored_response) keeps: a `410 response-too-large`
    /// problem ([`OversizeResponse::Problem`], the default) or the response's status and headers
    /// without its body ([`OversizeResponse::HeadersOnly`], replayed with
    /// `Idempotency-Body-Omitted: true`).
    pub fn oversize_response(mut self, oversize: OversizeResponse) -> Self {
        self.oversize = oversize;
        self
    }

    /// How often storing a response is retried when the store fails (default 8 times, the first
    /// wait `first_delay` (default 100 ms), each next one doubled, at most 5 s, with jitter). The
    /// client is answered at once; the retries run in a task of their own, renewing the claim
    /// meanwhile. When all of them fail, the record stays in flight (its client was answered as
    /// final, so the handler must not run again at once): the first retry after the in-flight TTL
    /// takes the claim over and runs the handler again, resuming through its sub-keys.
    pub fn completion_retries(mut self, times: usize, first_delay: Duration) -> Self {
        self.completion_retry.times = times;
        self.completion_retry.first_delay = first_delay;
        self.completion_retry.max_delay = MAX_COMPLETION_RETRY_DELAY.max(first_delay);
        self
    }

    /// Where a long-running operation started by a record can be followed, for handlers that
    /// complete their record at acceptance and keep working (`202` + `Location`; see the crate
    /// docs, "Long-running operations"). When a retry arrives while the first attempt still runs,
    /// before its `202` is stored, its `409 request-in-progress` carries
    /// `Link: <URL>; rel="monitor"` with the URL `f` gives for the record, so the client can follow
    /// the operation instead of only waiting. `f` sees the record (scope, id, sub-keys through
    /// [`Record::derive`](idempotency::Record::derive)) and answers `None` for records that start
    /// no operation. The URL is computed, not looked up: until the handler has created the
    /// operation (the first steps of its first attempt) it may answer `404`.
    pub fn operation_link(mut self, f: impl Fn(&Record) -> Option<String> + Send + Sync + 'static) -> Self {
        self.operation_link = Some(Box::new(f));
        self
    }

    /// The most live records one principal may hold (default: no limit): records that hold a
    /// stored response or a live attempt; a failed one (a `5xx`, a refusal) does not count. A
    /// request with a new key from a principal at the limit is answered `429 too-many-requests`
    /// with `Retry-After` and stores nothing; a retry of a key it already holds (completed or in
    /// flight) still replays or resumes; a request marked [`crate::PassesRecordLimit`] is never
    /// refused. Needs a store that counts ([`Store::count_records`]); on one that does not,
    /// nothing is limited.
    /// Each process counts through the store at most once a second per principal and adds the
    /// records it creates meanwhile, so several replicas may together overshoot the limit by the
    /// records they create within that second.
    pub fn max_records_per_principal(mut self, limit: Option<u64>) -> Self {
        self.max_records_per_principal = limit;
        self
    }

    /// How long one store call may wait while the store takes no write of this layer's
    /// (default [`DEFAULT_STORE_TIMEOUT`], 3 s) before it fails as unavailable and the request is
    /// answered `503 store-unavailable` with `Retry-After`. A store that refuses connections
    /// fails at once; this bounds the store that does not answer at all (packets dropped by a
    /// partition, a locked SQLite file, a frozen host), which would otherwise hold the request
    /// for TCP's retransmission timeout. A store that goes on taking other writes meanwhile is
    /// busy, not down (its writers queue on a loaded disk): the call keeps its place, up to
    /// [`store_queue_timeout`](Self::store_queue_timeout). A claim whose call timed out may
    /// still land in the store after the request was answered: the layer then releases it (marks
    /// it failed, fenced by its generation) as soon as the store answers again, so a retry runs
    /// the handler instead of waiting out the in-flight TTL.
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// The longest one store call may wait in all while the store goes on taking other writes
    /// (default [`DEFAULT_STORE_QUEUE_TIMEOUT`], 10 s; never less than the
    /// [`store_timeout`](Self::store_timeout)): the bound on a queue, where the store timeout is
    /// the bound on silence. It is also how long a store that answers some calls and not others
    /// (one Redis Cluster primary down while the others answer) holds the calls to its silent
    /// part before they are answered `503`.
    pub fn store_queue_timeout(mut self, timeout: Duration) -> Self {
        self.store_queue_timeout = timeout;
        self
    }

    /// What a claim gone stale becomes when a retry finds it (default [`StaleClaims::Reclaim`]:
    /// taken over, the handler runs again). [`StaleClaims::Uncertain`] makes it uncertain
    /// instead, for a handler that sends its request on to a target that may have acted (a
    /// gateway's rule): the retry then gets what [`on_uncertain`](Self::on_uncertain) says.
    pub fn stale_claims(mut self, rule: StaleClaims) -> Self {
        self.stale_claims = rule;
        self
    }

    /// What a retry of an uncertain record gets (default [`OnUncertain::Hold`]:
    /// `409 outcome-uncertain` naming the record id). A request's own [`OnUncertain`] in its
    /// extensions (put there by a middleware before the layer, per route) wins over this.
    pub fn on_uncertain(mut self, rule: OnUncertain) -> Self {
        self.on_uncertain = rule;
        self
    }

    /// Builds the layer.
    ///
    /// # Panics
    ///
    /// When [`try_build`](Self::try_build) refuses the configuration (a retention not longer
    /// than the in-flight TTL): a service that takes these settings from its operator calls
    /// `try_build` and reports the error instead.
    pub fn build(self) -> IdempotencyLayer {
        match self.try_build() {
            Ok(layer) => layer,
            Err(e) => panic!("idempotency layer: {e}"),
        }
    }

    /// Builds the layer, or says why its configuration is refused ([`BuildError`]).
    pub fn try_build(self) -> Result<IdempotencyLayer, BuildError> {
        if self.retention <= self.in_flight_ttl {
            return Err(BuildError::RetentionNotLongerThanInFlightTtl {
                retention: self.retention,
                in_flight_ttl: self.in_flight_ttl,
            });
        }
        // The layer enforces the body limit while reading, so the fingerprinter need not again.
        let fingerprinter = Fingerprinter::new(self.fingerprint_mode).max_body(usize::MAX);
        let deadline = Arc::new(StoreDeadline::new(self.store_timeout, self.store_queue_timeout));
        let detached = DetachedHandlers::new();
        let releases = Releases::new(
            self.store.clone(),
            deadline.clone(),
            self.in_flight_ttl,
            self.completion_retry.first_delay,
            detached.clone(),
        );
        Ok(IdempotencyLayer {
            config: Arc::new(Config {
                store: self.store,
                principal: self.principal,
                policy: self.policy,
                key_sources: self.key_sources,
                fingerprinter,
                response_policy: self.response_policy,
                mismatch_status: self.mismatch_status,
                in_flight_ttl: self.in_flight_ttl,
                retention: self.retention,
                body_limit: self.body_limit,
                replay_headers: self.replay_headers,
                wait_for_in_flight: self.wait_for_in_flight,
                max_wait: self.max_wait,
                wait_poll: self.wait_poll,
                in_progress_retry_after: self.in_progress_retry_after,
                compression_threshold: self.compression_threshold,
                problem_base: self.problem_base,
                max_stored_response: self.max_stored_response,
                oversize: self.oversize,
                completion_retry: self.completion_retry,
                anonymous: self.anonymous,
                operation_link: self.operation_link,
                stale_claims: self.stale_claims,
                on_uncertain: self.on_uncertain,
                state: Runtime {
                    deadline,
                    waiters: Default::default(),
                    releases,
                    detached,
                    record_limit: self.max_records_per_principal.map(crate::quota::RecordLimit::new),
                },
            }),
        })
    }
}
