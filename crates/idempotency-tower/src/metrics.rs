//! The layer's metrics (with the `metrics` feature): their names, their help texts, and how
//! the layer records them.

use std::future::Future;
#[cfg(feature = "metrics")]
use std::time::Instant;

#[cfg(feature = "metrics")]
/// Counter of protected (and refused) mutating requests, labelled `outcome`.
pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
#[cfg(feature = "metrics")]
/// Histogram of store call latency in seconds, labelled `op` (`claim`, `complete`, `fail`,
/// `reclaim`, `get`).
pub const STORE_DURATION_SECONDS: &str = "idempotency_store_duration_seconds";
#[cfg(feature = "metrics")]
/// Counter of expired records the sweeper deleted.
pub const RECORDS_SWEPT_TOTAL: &str = "idempotency_records_swept_total";

#[cfg(feature = "metrics")]
/// Registers the descriptions of the layer's metrics with the installed recorder, so an
/// exporter can show help text. Optional; call it once after installing the recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        REQUESTS_TOTAL,
        "Mutating requests seen by the idempotency layer, by outcome (executed, replayed, mismatch, \
         in_progress, missing_key, invalid_key, stale_reclaimed, uncertain, ...)"
    );
    metrics::describe_histogram!(
        STORE_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Latency of idempotency store calls, by operation"
    );
    metrics::describe_counter!(RECORDS_SWEPT_TOTAL, "Expired idempotency records deleted by the sweeper");
    metrics::describe_counter!(
        idempotency::REPLAY_CACHE_HITS_TOTAL,
        "Claims and reads of completed records answered from the replay cache, without the store"
    );
}

/// `metrics::$kind!` of the metric `$name` (a literal equal to `$constant`) labelled
/// `$label => $value`. The values listed get a key of their own made at compile time (no label
/// vector built per call); any other takes the general path.
#[cfg(feature = "metrics")]
macro_rules! labelled {
    ($kind:ident, $name:literal, $constant:expr, $label:literal => $value:expr, [$($known:literal),* $(,)?]) => {
        match $value {
            $($known => metrics::$kind!($name, $label => $known),)*
            other => metrics::$kind!($constant, $label => other),
        }
    };
}

/// Counts one request under `outcome` (nothing without the `metrics` feature).
pub(crate) fn count(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    labelled!(counter, "idempotency_requests_total", REQUESTS_TOTAL, "outcome" => outcome,
        ["executed", "replayed", "in_progress", "mismatch", "stale_reclaimed", "missing_key", "invalid_key", "uncertain"])
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// The outcome of a protected request (the `outcome` label of [`REQUESTS_TOTAL`]: `executed`,
/// `replayed`, `mismatch`, ...), put in the response's extensions, so that a layer outside (a
/// trace span per request) can show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome(pub &'static str);

/// The name of the span the layer opens per protected request (when a subscriber wants it).
pub(crate) const REQUEST_SPAN: &str = "idempotency";

/// Whether `span` is the layer's request span ([`REQUEST_SPAN`]), the one its fields are recorded
/// in. Not when no subscriber wants it: the request then runs in its caller's span (or none),
/// and records nothing there.
pub(crate) fn is_request_span(span: &tracing::Span) -> bool {
    !span.is_disabled() && span.metadata().is_some_and(|m| m.name() == REQUEST_SPAN)
}

/// Records the request's outcome and status in the layer's request span, when it runs in one.
pub(crate) fn record_outcome(outcome: &'static str, status: u16) {
    let span = tracing::Span::current();
    if is_request_span(&span) {
        span.record("outcome", outcome);
        span.record("status", status);
    }
}

/// The span of one store call: target `idempotency::store` (a trace exporter can pick these out),
/// named after the operation.
fn store_span(op: &'static str) -> tracing::Span {
    tracing::info_span!(target: "idempotency::store", "idempotency.store", otel.name = op, db.operation.name = op)
}

/// Awaits one store call in its own span and records its latency under `op`.
#[cfg(feature = "metrics")]
pub(crate) async fn timed<T>(op: &'static str, fut: impl Future<Output = T>) -> T {
    let start = Instant::now();
    let out = in_span(op, fut).await;
    labelled!(histogram, "idempotency_store_duration_seconds", STORE_DURATION_SECONDS, "op" => op,
        ["claim", "complete", "fail", "get", "heartbeat", "reclaim", "count", "mark_uncertain", "take_over_uncertain"])
    .record(start.elapsed().as_secs_f64());
    out
}

/// Awaits one store call in its own span (no latency is recorded without the `metrics` feature).
#[cfg(not(feature = "metrics"))]
pub(crate) async fn timed<T>(op: &'static str, fut: impl Future<Output = T>) -> T {
    in_span(op, fut).await
}

/// Awaits `fut` in [`store_span`], or without a span when no subscriber wants it.
async fn in_span<T>(op: &'static str, fut: impl Future<Output = T>) -> T {
    use tracing::Instrument;
    let span = store_span(op);
    if span.is_disabled() { fut.await } else { fut.instrument(span).await }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    /// The literal names the static keys are made with are the metrics' names.
    #[test]
    fn the_static_keys_name_the_same_metrics() {
        assert_eq!(REQUESTS_TOTAL, "idempotency_requests_total");
        assert_eq!(STORE_DURATION_SECONDS, "idempotency_store_duration_seconds");
    }
}
