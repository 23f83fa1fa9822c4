//! The [`IdempotencyService`]: decides, per request, whether the layer protects it.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::OriginalUri;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idempotency::{Endpoint, Fingerprint, IdempotencyKey, RequestParts, Scope};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::BoxError;
use crate::config::{Config, RoutePolicy, is_mutating};
use crate::detached::Detach;
use crate::future::ResponseFuture;
use crate::problem::{Rejection, rejection_response};
use crate::protect::{Protected, run};
use crate::sources::{HeaderKey, agree, body_key, header_key, with_result};

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around an inner service `S`.
///
/// `S` takes `Request<axum::body::Body>`; the protected request reaches it with its body
/// already read (once, within the limit) and an [`IdempotencyContext`](crate::IdempotencyContext)
/// in its extensions. A protected request runs to its end even when its client goes away: in
/// place while the client waits, and moved to a task of its own if the response future is
/// dropped first. So `S` must be `Clone`, `Send` and `'static`, and the layer needs a tokio
/// runtime.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").field("config", &self.config).finish_non_exhaustive()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// Gets a reference to the inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Gets a mutable reference to the inner service.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes this service, returning the inner one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let cfg = &self.config;
        if !is_mutating(req.method()) {
            return ResponseFuture::inner(self.inner.call(req.map(Body::new)));
        }
        let (parts, body) = req.into_parts();
        let path = request_path(&parts);
        let policy = (cfg.policy)(&parts.method, path);
        if policy == RoutePolicy::Off {
            return ResponseFuture::inner(self.inner.call(Request::from_parts(parts, Body::new(body))));
        }
        let sources = cfg.key_sources.as_ref().map(|f| f(&parts.method, path)).unwrap_or_default();
        let HeaderKey { key, repeatable } = match header_key(&parts, &sources, cfg.retention) {
            Ok(found) => found,
            Err((rejection, repeatable)) => return reject(cfg, rejection, None, repeatable),
        };
        let span = tracing::info_span!(
            crate::metrics::REQUEST_SPAN,
            key = tracing::field::Empty,
            principal = tracing::field::Empty,
            endpoint = tracing::field::Empty,
            outcome = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let keyed = match sources.into_field() {
            // The key is in the body: known once the body is read.
            Some(field) => Keyed::FromBody { header: key, field, policy },
            None => {
                let key = match key {
                    Some(key) => key,
                    None if policy == RoutePolicy::Optional => {
                        return ResponseFuture::inner(self.inner.call(Request::from_parts(parts, Body::new(body))));
                    }
                    None => return reject(cfg, Rejection::MissingKey, None, repeatable),
                };
                match scope_of(cfg, &parts, key, &span) {
                    Ok(scope) => Keyed::Known(scope),
                    Err((rejection, key)) => return reject(cfg, rejection, Some(&key), repeatable),
                }
            }
        };

        // The service that was polled ready goes with this request; a clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = cfg.clone();
        let fut = async move {
            let answer = |res: Response<Body>| if repeatable { with_result(res) } else { res };
            let body = match read_body(body, &parts, cfg.body_limit).await {
                Ok(body) => body,
                Err(rejection) => return Ok(answer(rejection_response(&cfg, rejection))),
            };
            let scope = match keyed.scope(&cfg, &parts, &body) {
                Ok(Some(scope)) => scope,
                // No key on a route where the key is optional: the request passes unprotected.
                Ok(None) => {
                    let req = Request::from_parts(parts, Body::from(body));
                    return inner.oneshot(req).await.map(|res| res.map(Body::new));
                }
                Err(rejection) => return Ok(answer(rejection_response(&cfg, rejection))),
            };
            let fingerprint = match fingerprint_of(&cfg, &parts, &body) {
                Ok(fingerprint) => fingerprint,
                Err(rejection) => return Ok(answer(rejection_response(&cfg, rejection))),
            };
            // From the claim on, the work must run to its end: a client that goes away drops
            // this future, but must not cut the handler between two side effects, nor leave a
            // claim that nobody completes. `Detach` runs it here while the client waits and in a
            // task of its own, counted in the layer's detached handlers, if this future is dropped
            // first.
            let protected = Protected { cfg: cfg.clone(), inner, parts, body, scope, fingerprint };
            let work = Detach::new(run(protected), &cfg.state.detached);
            match work.await {
                Ok(result) => result.map(answer),
                Err(_panic) => {
                    tracing::error!("the protected request panicked outside the handler");
                    Ok(answer(rejection_response(&cfg, Rejection::HandlerPanicked)))
                }
            }
        };
        // Without a subscriber that wants the span, the request runs without one: entering and
        // leaving a disabled span on every poll (and when the future is dropped) still costs
        // (`tracing`'s `log` feature, which sqlx turns on, looks for a logger each time).
        if span.is_disabled() {
            ResponseFuture::protected(Box::pin(fut))
        } else {
            ResponseFuture::protected(Box::pin(fut.instrument(span)))
        }
    }
}

/// The concrete path the client sent: axum strips a nested router's prefix from the URI and
/// keeps the original in [`OriginalUri`], and the endpoint must be the full path.
fn request_path(parts: &Parts) -> &str {
    match parts.extensions.get::<OriginalUri>() {
        Some(OriginalUri(uri)) => uri.path(),
        None => parts.uri.path(),
    }
}

/// How a protected request's scope is known: from its headers at once, or once its body is read.
enum Keyed {
    Known(Scope),
    FromBody { header: Option<IdempotencyKey>, field: Cow<'static, str>, policy: RoutePolicy },
}

impl Keyed {
    /// The scope, once the body is read: `Ok(None)` when the route's key is optional and the
    /// request sent none.
    fn scope(self, cfg: &Config, parts: &Parts, body: &[u8]) -> Result<Option<Scope>, Rejection> {
        let (header, field, policy) = match self {
            Keyed::Known(scope) => return Ok(Some(scope)),
            Keyed::FromBody { header, field, policy } => (header, field, policy),
        };
        let key = body_key(body, &field)
            .and_then(|from_body| agree(header, from_body, "a header", &format!("body field {field:?}")))?;
        let key = match key {
            Some(key) => key,
            None if policy == RoutePolicy::Optional => return Ok(None),
            None => return Err(Rejection::MissingKey),
        };
        match scope_of(cfg, parts, key, &tracing::Span::current()) {
            Ok(scope) => Ok(Some(scope)),
            Err((rejection, _)) => Err(rejection),
        }
    }
}

/// The request's fingerprint: its method, full path, query, content type and body.
fn fingerprint_of(cfg: &Config, parts: &Parts, body: &[u8]) -> Result<Fingerprint, Rejection> {
    let content_type = parts.headers.get(http::header::CONTENT_TYPE).map_or(&b""[..], |v| v.as_bytes());
    let request = RequestParts {
        method: parts.method.as_str(),
        path: request_path(parts),
        query: parts.uri.query().unwrap_or(""),
        content_type,
        body,
    };
    cfg.fingerprinter.fingerprint(&request).map_err(|_| Rejection::BodyTooLarge { limit: cfg.body_limit })
}

/// The record's scope for `key`, recorded in `span`; refused when the request has no principal.
fn scope_of(
    cfg: &Config,
    parts: &Parts,
    key: IdempotencyKey,
    span: &tracing::Span,
) -> Result<Scope, (Rejection, IdempotencyKey)> {
    let Some(principal) = (cfg.principal)(parts).or_else(|| cfg.anonymous.clone()) else {
        return Err((Rejection::PrincipalMissing, key));
    };
    let endpoint = Endpoint::new(parts.method.as_str(), request_path(parts));
    if crate::metrics::is_request_span(span) {
        span.record("key", tracing::field::display(&key));
        span.record("principal", tracing::field::display(&principal));
        span.record("endpoint", tracing::field::display(&endpoint));
    }
    Ok(Scope::new(principal, endpoint, key))
}

/// After refusing an oversized body, how much more of it the layer reads and throws away. A
/// client is usually still uploading when the 413 is ready; if the server closed the connection
/// with the upload unread, the client's next write would fail (broken pipe, or a reset that
/// discards the 413 it has not read yet) and it would see a network error instead of the answer.
/// Reading on to the end of a body that is at most this much over the limit lets the client
/// finish its upload and read the 413, on a connection that stays usable. A larger body is
/// refused without being read, and its connection is closed mid-upload.
pub const OVERSIZE_DRAIN: u64 = 4 * 1024 * 1024;

/// Reads the whole body once, refusing more than `limit` bytes (early, when the declared length
/// already says so). A refused body is drained (see [`OVERSIZE_DRAIN`]).
async fn read_body<B>(body: B, parts: &Parts, limit: usize) -> Result<Bytes, Rejection>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = std::pin::pin!(body);
    if let Some(declared) = declared.filter(|&n| n > limit as u64) {
        if declared - limit as u64 <= OVERSIZE_DRAIN {
            drain(body.as_mut(), declared).await;
        }
        return Err(Rejection::BodyTooLarge { limit });
    }
    match Limited::new(body.as_mut(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            drain(body, OVERSIZE_DRAIN).await;
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(e) if is_timeout(&*e) => {
            tracing::debug!(error = %e, "request body timed out");
            Err(Rejection::BodyTimeout)
        }
        Err(e) => {
            tracing::debug!(error = %e, "request body unreadable");
            Err(Rejection::BodyUnreadable)
        }
    }
}

/// Whether a body error is a deadline: an [`std::io::Error`] of kind
/// [`TimedOut`](std::io::ErrorKind::TimedOut) anywhere in its chain (what a body wrapper that
/// bounds the time of the whole body reports), answered `408` rather than `400`.
fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Reads and discards the rest of `body`, up to `budget` bytes; stops at the first error.
async fn drain<B>(mut body: std::pin::Pin<&mut B>, budget: u64)
where
    B: http_body::Body<Data = Bytes>,
{
    let mut left = budget;
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            match left.checked_sub(data.len() as u64) {
                Some(rest) => left = rest,
                None => return,
            }
        }
    }
}

fn reject<F, E>(
    cfg: &Config,
    rejection: Rejection,
    key: Option<&IdempotencyKey>,
    repeatable: bool,
) -> ResponseFuture<F, E> {
    let _span = tracing::info_span!(
        crate::metrics::REQUEST_SPAN,
        key = key.map(tracing::field::display),
        outcome = tracing::field::Empty,
        status = tracing::field::Empty
    )
    .entered();
    let res = rejection_response(cfg, rejection);
    ResponseFuture::ready(if repeatable { with_result(res) } else { res })
}
