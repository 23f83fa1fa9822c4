//! Traces over OTLP (docs/protocol.md#operating-it, `--otlp-endpoint`): a span per request with its outcome, child spans
//! per store call and per hypervisor call, the key hashed, the trace id in the log lines.
//!
//! Spans go to the collector from the SDK's batch processor, off the request path: ending a span
//! only queues it (a full queue drops spans, it never waits). The export itself runs on the
//! service's tokio runtime with a timeout, and a failing export is logged at most once a minute
//! ([`LoggedExporter`]). Only spans of three targets are exported: the request spans
//! ([`REQUEST_TARGET`]), the store calls (`idempotency::store`) and the hypervisor calls
//! (`leasebroker::downstream`); the idempotency layer's own span, which carries the key in clear
//! for the log, is not.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{Layer, Registry};

/// The target of the request spans.
pub const REQUEST_TARGET: &str = "leasebroker::request";

/// The service name traces carry.
pub const SERVICE_NAME: &str = "leasebroker";

/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often, at most, a failing export is logged.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// `--otlp-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention; `/v1/traces` is appended).
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

/// An exporter that runs `inner`'s exports on the tokio runtime it was made on, each within
/// [`EXPORT_TIMEOUT`], and logs failures at most once every [`LOG_EVERY`] (with how many failed
/// since the last line).
#[derive(Debug)]
pub struct LoggedExporter<E> {
    inner: std::sync::Arc<E>,
    runtime: tokio::runtime::Handle,
    last_logged: Mutex<Option<Instant>>,
    failed_since: std::sync::atomic::AtomicU64,
}

impl<E: SpanExporter + 'static> LoggedExporter<E> {
    /// Wraps `inner`; call within the tokio runtime the exports should run on.
    pub fn new(inner: E) -> Self {
        Self {
            inner: std::sync::Arc::new(inner),
            runtime: tokio::runtime::Handle::current(),
            last_logged: Mutex::new(None),
            failed_since: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn failed(&self, error: &str) {
        use std::sync::atomic::Ordering;
        let failures = self.failed_since.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last_logged.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            *last = Some(Instant::now());
            self.failed_since.store(0, Ordering::Relaxed);
            tracing::warn!(error, failures, "trace exports fail: spans are dropped (logged at most once a minute)");
        }
    }
}

impl<E: SpanExporter + 'static> SpanExporter for LoggedExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = self.inner.clone();
        let task = self.runtime.spawn(async move { tokio::time::timeout(EXPORT_TIMEOUT, inner.export(batch)).await });
        let result = match task.await {
            Ok(Ok(result)) => result,
            Ok(Err(_elapsed)) => Err(OTelSdkError::Timeout(EXPORT_TIMEOUT)),
            Err(join) => Err(OTelSdkError::InternalFailure(join.to_string())),
        };
        if let Err(e) = &result {
            self.failed(&e.to_string());
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        if let Some(inner) = std::sync::Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

/// The tracer provider exporting to `endpoint` over `protocol`, service name `leasebroker`. Call
/// within the tokio runtime; shut it down on exit to send what is queued.
pub fn provider(endpoint: &str, protocol: OtlpProtocol) -> anyhow::Result<SdkTracerProvider> {
    let exporter = match protocol {
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
    }
    .context("the OTLP exporter")?;
    let processor = BatchSpanProcessor::builder(LoggedExporter::new(exporter)).build();
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(SERVICE_NAME).build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}

/// The layer that turns the exported targets' spans into OTLP spans of `provider`.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
{
    tracing_opentelemetry::layer().with_tracer(provider.tracer(SERVICE_NAME)).with_filter(filter_fn(|meta| {
        let target = meta.target();
        target == REQUEST_TARGET || target == "idempotency::store" || target == "leasebroker::downstream"
    }))
}

/// Installs the process's subscriber (`logs`, and the provider's traces when there is one), runs
/// `work`, then sends the traces still queued: what a binary does around its work.
pub async fn traced<L, F>(logs: L, provider: Option<SdkTracerProvider>, work: F) -> F::Output
where
    L: Layer<Registry> + Send + Sync + 'static,
    F: Future,
{
    let traces = provider.as_ref().map(layer);
    tracing_subscriber::registry().with(logs).with(traces).init();
    let output = work.await;
    if let Some(provider) = provider {
        // Sends what is queued; blocking, so not on a runtime thread.
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
    output
}

/// A short SHA-256 of an idempotency key (the first 16 bytes, hex): what traces carry instead of
/// the key.
pub fn key_hash(key: &[u8]) -> String {
    hex::encode(&Sha256::digest(key)[..16])
}

/// The middleware that runs each request in its span: `http.request.method`, `http.route`,
/// `http.response.status_code`, `idempotency.outcome`, `idempotency.key_hash`, and `trace_id`
/// (which the log lines inside the request show).
pub async fn request_span(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str).to_owned();
    let key_hash = req.headers().get("idempotency-key").map(|k| key_hash(k.as_bytes()));
    let span = tracing::info_span!(
        target: REQUEST_TARGET,
        "request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        idempotency.outcome = tracing::field::Empty,
        idempotency.key_hash = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    if let Some(hash) = &key_hash {
        span.record("idempotency.key_hash", tracing::field::display(hash));
    }
    let trace_id = span.context().span().span_context().trace_id();
    if trace_id != opentelemetry::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
    let response = next.run(req).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    if let Some(outcome) = response.extensions().get::<idempotency_tower::Outcome>() {
        span.record("idempotency.outcome", outcome.0);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hashed_to_32_hex_digits() {
        let h = key_hash(b"7c3f5d1e-91a4-4b8c");
        assert_eq!(h.len(), 32);
        assert_ne!(h, key_hash(b"7c3f5d1e-91a4-4b8d"));
        assert_eq!(h, key_hash(b"7c3f5d1e-91a4-4b8c"));
    }
}
