#![doc = include_str!("../README.md")]
//!
//! The layer is [`IdempotencyLayer`], built with [`IdempotencyLayer::builder`]; every error it
//! answers is a [`Problem`].
//!
//! The edges, briefly (each is a builder option or a default):
//!
//! - Records are scoped to a principal; a protected request without one is refused with
//!   `401 principal-missing` unless the layer was built with
//!   [`allow_anonymous`](IdempotencyLayerBuilder::allow_anonymous).
//! - The endpoint and the fingerprint use the normalized path ([`idempotency::normalize_path`]),
//!   so `/v1/workers/wkr-1` and `/v1/workers/%77kr-1` are one record.
//! - While the handler runs, its claim is renewed every quarter of the in-flight TTL, so a slow
//!   handler is never taken for a dead one and run twice.
//! - Every store call is bounded by
//!   [`store_timeout`](IdempotencyLayerBuilder::store_timeout) (default 3 s): a store that stops
//!   answering (a partition that drops packets, a locked file) is answered
//!   `503 store-unavailable` in time, and a claim that may have landed after its call gave up is
//!   released as soon as the store answers again. A store that goes on taking other writes is
//!   busy, not down: a call queued behind them waits its turn, up to
//!   [`store_queue_timeout`](IdempotencyLayerBuilder::store_queue_timeout) (default 10 s).
//! - A store error while storing the response is retried in the background
//!   ([`completion_retries`](IdempotencyLayerBuilder::completion_retries)); the client is
//!   answered at once.
//! - An attempt whose outcome the store could not take (it was down) is released as soon as the
//!   store answers again, by a background task of the layer, so a retry resumes within seconds
//!   of the store's return instead of waiting out the in-flight TTL.
//! - Every response answered from a record, or stored in one (the first execution once stored,
//!   replays, `409` in flight, the mismatch problem), carries `Idempotency-Key-Expires`: the
//!   record's expiry as an IMF-fixdate, after which the key is free again.
//! - `Prefer: wait=N` (RFC 7240) on a key in flight waits up to
//!   `min(N, `[`max_wait`](IdempotencyLayerBuilder::max_wait)`)` for the record to complete and
//!   answers the replay with `Preference-Applied: wait=W`; waiting holds no connection and no lock.
//! - A terminal response larger than
//!   [`max_stored_response`](IdempotencyLayerBuilder::max_stored_response) reaches its client
//!   whole, and a retry gets `410 response-too-large` instead of a second execution.
//! - Opt-in, for handlers that send their request on: a handler that does not know whether it
//!   acted says so with [`OutcomeUncertain`] (the record becomes `uncertain`, its client gets
//!   `504 outcome-uncertain`); [`StaleClaims`] and [`OnUncertain`] say what a stale claim
//!   becomes and what a retry of an uncertain record gets (hold, resend, or a [`Probe`]).
//!
//! Inside a handler, `axum::Extension<`[`IdempotencyContext`]`>` gives the record's key,
//! principal and [`derive`](IdempotencyContext::derive)d sub-keys for each side effect. Run the
//! core [`idempotency::Sweeper`] with [`spawn_sweeper`] to delete expired records.
//!
//! Metrics (via the `metrics` facade, with the default feature `metrics`):
//! `idempotency_requests_total{outcome}`, `idempotency_store_duration_seconds{op}` and
//! `idempotency_records_swept_total`. Each
//! protected request gets a `tracing` span `idempotency` with its key, principal, endpoint,
//! outcome and status; bodies are never logged.

mod config;
mod context;
mod deadline;
mod detached;
mod expires;
mod future;
mod headers;
mod layer;
mod metrics;
mod prefer;
mod problem;
#[cfg(feature = "reqwest")]
mod propagate;
mod protect;
mod quota;
mod release;
mod replay;
mod runtime;
mod service;
mod sources;
mod sweeper;
mod uncertain;
mod waiters;

pub use config::{AIP_155_REQUEST_ID, KeySources, MismatchStatus, OversizeResponse, RoutePolicy};
pub use context::{IdempotencyContext, MissingContext};
pub use detached::DetachedHandlers;
pub use future::ResponseFuture;
pub use headers::{
    IDEMPOTENCY_BODY_OMITTED, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, PREFER,
    PREFERENCE_APPLIED, REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID, REPEATABILITY_RESULT,
};
pub use layer::{
    BuildError, DEFAULT_BODY_LIMIT, DEFAULT_COMPLETION_RETRIES, DEFAULT_COMPLETION_RETRY_DELAY,
    DEFAULT_COMPRESSION_THRESHOLD, DEFAULT_IN_FLIGHT_TTL, DEFAULT_IN_PROGRESS_RETRY_AFTER, DEFAULT_MAX_STORED_RESPONSE,
    DEFAULT_MAX_WAIT, DEFAULT_RETENTION, DEFAULT_STORE_QUEUE_TIMEOUT, DEFAULT_STORE_TIMEOUT, DEFAULT_WAIT_POLL,
    IdempotencyLayer, IdempotencyLayerBuilder,
};
#[cfg(feature = "metrics")]
pub use metrics::{Outcome, RECORDS_SWEPT_TOTAL, REQUESTS_TOTAL, STORE_DURATION_SECONDS, describe_metrics};
pub use problem::{DEFAULT_PROBLEM_BASE, PROBLEM_JSON, Problem};
#[cfg(feature = "reqwest")]
pub use propagate::{CallKey, PropagateIdempotencyKey, SideEffect, key_header};
pub use quota::PassesRecordLimit;
pub use service::{IdempotencyService, OVERSIZE_DRAIN};
pub use sweeper::{spawn_sweeper, sweeper};
pub use uncertain::{OnUncertain, OutcomeUncertain, Probe, Probed, StaleClaims};

/// Re-exported so a service needs no direct dependency on the core for the common types.
pub use idempotency::{FingerprintMode, MemoryStore, Principal, ResponsePolicy, Store};

pub(crate) use tower::BoxError;
