//! The reverse proxy behind the idempotency layer: forwards a request to the upstream and tells
//! the layer what became of it (docs/protocol.md#gateway, "Forwarding" and the outcome rules).
//!
//! - **Never reached** (connection refused, name lookup or TLS failed, nothing written):
//!   `502 upstream-unavailable` with `Retry-After`; a 5xx, so the layer releases the record.
//! - **Answered**: the upstream's response, hop-by-hop headers removed. A 5xx is released by the
//!   layer (a route with `uncertain-on-5xx` makes it uncertain instead).
//! - **Outcome unknown** (written, then no answer within `--upstream-timeout`, or the connection
//!   reset, or the answer's body broke off): `504 outcome-uncertain`; the record becomes
//!   uncertain and the request is never forwarded again on a guess.

mod body;
pub mod client;
pub mod headers;
mod probe;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use futures::future::BoxFuture;
use http::{HeaderValue, Request, Response, StatusCode, Version};
use idempotency_tower::{IDEMPOTENCY_KEY, IdempotencyContext, OutcomeUncertain, Problem};

pub use self::client::UpstreamClient;
use crate::settings::{ForwardKey, Upstream};

/// The label of the sub-key an upstream receives under `--forward-key derived`
/// ([`IdempotencyContext::derive`]): one forwarded call per record.
pub const FORWARD_LABEL: &str = "upstream";

/// The problem of a request the upstream never received.
pub const UPSTREAM_UNAVAILABLE: &str = "upstream-unavailable";
/// The problem of a request whose outcome is unknown: it may have acted upstream.
pub const OUTCOME_UNCERTAIN: &str = idempotency::problems::OUTCOME_UNCERTAIN;

/// Options of the request's route that the proxy reads, put into its extensions by the route
/// matcher in front of the layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteOutcomes {
    /// A 5xx may have acted: the record becomes uncertain instead of released.
    pub uncertain_on_5xx: bool,
}

/// The proxy's settings.
#[derive(Debug, Clone)]
pub struct ProxySettings {
    /// Where requests go.
    pub upstream: Upstream,
    /// What the upstream receives as `Idempotency-Key`.
    pub forward_key: ForwardKey,
    /// How long the upstream may take to answer, and between two parts of its answer.
    pub timeout: Duration,
    /// The most of a protected request's answer read before it goes on (the layer's
    /// `max_stored_response`): read within the timeout, so a body that breaks off is known
    /// before the layer stores anything.
    pub max_read: usize,
}

/// The proxy service: `Clone` and cheap to clone.
#[derive(Debug, Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: UpstreamClient,
    settings: ProxySettings,
}

/// How a forwarded request ended, for the metrics and the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Not a byte reached the upstream.
    NeverReached,
    /// No answer within the timeout, after the request was (or may have been) written.
    Timeout,
    /// The connection broke after the request was (or may have been) written.
    Reset,
}

impl Failure {
    fn kind(self) -> &'static str {
        match self {
            Self::NeverReached => "connect",
            Self::Timeout => "timeout",
            Self::Reset => "reset",
        }
    }
}

impl Proxy {
    /// A proxy forwarding with `client`.
    pub fn new(client: UpstreamClient, settings: ProxySettings) -> Self {
        Self { inner: Arc::new(Inner { client, settings }) }
    }

    /// The probe of a route (`probe = "GET /orders/by-key/{key}"`): asks the upstream, with this
    /// proxy's client, what became of an uncertain record's request.
    pub fn probe(&self, route: crate::settings::MethodPath) -> Arc<dyn idempotency_tower::Probe> {
        Arc::new(probe::UpstreamProbe::new(self.inner.clone(), route))
    }

    /// The key the upstream receives for `record`'s request (`--forward-key`), `None` under
    /// `none`.
    pub fn forwarded_key(&self, record: &idempotency::Record) -> Option<String> {
        self.inner.forwarded_key(record)
    }
}

impl tower::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move { Ok(inner.forward(req).await) })
    }
}

impl Inner {
    async fn forward(&self, req: Request<Body>) -> Response<Body> {
        let protected = req.extensions().get::<IdempotencyContext>().is_some();
        let outcomes = req.extensions().get::<RouteOutcomes>().copied().unwrap_or_default();
        let req = match self.upstream_request(req) {
            Ok(req) => req,
            Err(e) => {
                tracing::warn!(error = %e, "the request cannot be forwarded");
                return Problem::new(
                    StatusCode::BAD_REQUEST,
                    "invalid-path",
                    "Invalid path",
                    "the path cannot be forwarded",
                )
                .into_response();
            }
        };
        let started = Instant::now();
        let answer = match tokio::time::timeout(self.settings.timeout, self.client.request(req)).await {
            Err(_elapsed) => Err(Failure::Timeout),
            Ok(Err(e)) => Err(classify(&e)),
            Ok(Ok(res)) => Ok(res),
        };
        metrics::histogram!("idempotency_gateway_upstream_duration_seconds").record(started.elapsed().as_secs_f64());
        let res = match answer {
            Ok(res) => res,
            Err(failure) => return self.failed(failure),
        };
        let (mut parts, incoming) = res.into_parts();
        headers::remove_hop_by_hop(&mut parts.headers);
        let timeout = self.settings.timeout;
        let body = if protected {
            match body::read_bounded(incoming, self.settings.max_read, timeout).await {
                Ok(body) => body,
                Err(e) => {
                    tracing::warn!(error = %e, status = parts.status.as_u16(), "the upstream's answer broke off");
                    return self.failed(Failure::Reset);
                }
            }
        } else {
            Body::new(tower_http::timeout::TimeoutBody::new(timeout, incoming))
        };
        if parts.status.is_server_error() {
            metrics::counter!("idempotency_gateway_upstream_errors_total", "kind" => "status_5xx").increment(1);
            if outcomes.uncertain_on_5xx && protected {
                let why =
                    format!("the upstream answered {} on a route whose 5xx may have acted", parts.status.as_u16());
                return uncertain(Response::from_parts(parts, body), why);
            }
        }
        Response::from_parts(parts, body)
    }

    /// The request as the upstream receives it.
    fn upstream_request(&self, req: Request<Body>) -> Result<Request<Body>, http::Error> {
        let (mut parts, body) = req.into_parts();
        let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let ctx = parts.extensions.remove::<IdempotencyContext>();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = self.settings.upstream.uri(path)?;
        // The upstream connection's own version (HTTP/2 only where an https:// upstream offers it).
        parts.version = Version::HTTP_11;
        headers::for_upstream(&mut parts.headers, peer, "http");
        if let Some(ctx) = ctx {
            parts.headers.remove(IDEMPOTENCY_KEY);
            if let Some(key) = self.forwarded_key(ctx.claim().record()) {
                // A key is visible ASCII, and a sub-key hex: always a valid structured string.
                let value = HeaderValue::from_str(&format!("\"{key}\"")).expect("a key is visible ASCII");
                parts.headers.insert(IDEMPOTENCY_KEY, value);
            }
        }
        parts.extensions = http::Extensions::new();
        Ok(Request::from_parts(parts, body))
    }

    /// See [`Proxy::forwarded_key`].
    fn forwarded_key(&self, record: &idempotency::Record) -> Option<String> {
        match self.settings.forward_key {
            ForwardKey::Derived => Some(record.derive(FORWARD_LABEL).to_string()),
            ForwardKey::Original => Some(record.scope.key.as_str().to_owned()),
            ForwardKey::None => None,
        }
    }

    /// The answer to a request that got no answer from the upstream.
    fn failed(&self, failure: Failure) -> Response<Body> {
        metrics::counter!("idempotency_gateway_upstream_errors_total", "kind" => failure.kind()).increment(1);
        match failure {
            Failure::NeverReached => Problem::new(
                StatusCode::BAD_GATEWAY,
                UPSTREAM_UNAVAILABLE,
                "Upstream unavailable",
                "the upstream could not be reached; nothing was sent, so a retry is safe",
            )
            .with_retry_after(1)
            .into_response(),
            Failure::Timeout | Failure::Reset => {
                let what = if failure == Failure::Timeout {
                    format!("the upstream did not answer within {}", humantime::format_duration(self.settings.timeout))
                } else {
                    "the connection to the upstream broke before its answer".to_owned()
                };
                let problem = Problem::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    OUTCOME_UNCERTAIN,
                    "Outcome uncertain",
                    format!("{what}; the request was sent and may have taken effect, so it is not sent again"),
                );
                uncertain(problem.into_response(), what)
            }
        }
    }
}

/// Marks `response` as the answer to a request whose outcome is unknown (`why`), for the layer
/// to make its record uncertain (and answer `504 outcome-uncertain`) instead of releasing it.
/// An unprotected request's client gets `response` itself.
fn uncertain(mut response: Response<Body>, why: String) -> Response<Body> {
    tracing::warn!(why, "the upstream's outcome is unknown");
    response.extensions_mut().insert(OutcomeUncertain);
    response
}

/// How the upstream client's error came about: only a failure to connect (refused, name lookup,
/// TLS, the connect timeout) is "never reached". Anything else may have happened after bytes
/// were written, so its outcome is unknown. (A pooled connection that the upstream had closed
/// before the request was written is retried on a new one by the client itself.)
fn classify(e: &hyper_util::client::legacy::Error) -> Failure {
    if e.is_connect() { Failure::NeverReached } else { Failure::Reset }
}
