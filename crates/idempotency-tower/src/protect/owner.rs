//! Running the handler as the owner of a claim: what it produced becomes this client's response
//! and the record's outcome.

use std::panic::AssertUnwindSafe;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt};
use http::{Request, Response};
use http_body_util::BodyExt;
use idempotency::{Claim, ErrorChain, ResponsePolicy, StoreError, StoredBody, StoredResponse, now};
use tower::{Service, ServiceExt};

use super::finish::{complete, fail, mark_uncertain};
use super::heartbeat::with_heartbeat;
use super::{Handler, Protected};
use crate::BoxError;
use crate::config::{Config, OversizeResponse};
use crate::context::IdempotencyContext;
use crate::expires::with_expiry;
use crate::metrics::count;
use crate::problem::{Rejection, rejection_response};
use crate::replay::replayable_headers;
use crate::uncertain::OutcomeUncertain;

/// Why the owner runs the handler: counted as the request's outcome.
#[derive(Clone, Copy)]
pub(super) enum Run {
    /// A new record, or a failed one taken over.
    Executed,
    /// A stale in-flight claim taken over.
    StaleReclaimed,
}

fn outcome(how: Run) -> &'static str {
    match how {
        Run::Executed => "executed",
        Run::StaleReclaimed => "stale_reclaimed",
    }
}

/// What the handler produced, caught whole so that every way it ends is recorded in the store.
enum Handled<E> {
    /// A terminal response, read whole (at most `max_stored_response` bytes).
    Terminal(http::response::Parts, Bytes),
    /// A terminal response whose body outgrew `max_stored_response`: what was read, and the
    /// unread rest.
    TooLarge(http::response::Parts, Bytes, Body),
    /// A response that is not stored (5xx, 401, ...), body unread.
    NotTerminal(http::response::Parts, Body),
    ServiceError(E),
    BodyError(BoxError),
    /// The handler does not know whether its request acted ([`OutcomeUncertain`]).
    Uncertain,
}

/// Runs the handler as the owner of `claim`, then completes or fails the record.
pub(super) async fn own<S, ResBody>(p: Protected<S>, claim: Claim, how: Run) -> Result<Response<Body>, S::Error>
where
    S: Handler<ResBody>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Protected { cfg, inner, mut parts, body, .. } = p;
    // The handler's context and this function share one claim rather than copying the record.
    let ctx = IdempotencyContext::new(claim);
    let claim = ctx.claim_arc();
    parts.extensions.insert(ctx.clone());
    let req = Request::from_parts(parts, Body::from(body));
    let limit = cfg.max_stored_response;
    let policy = cfg.response_policy.clone();
    let handled = AssertUnwindSafe(handle(inner, req, ctx, limit, policy)).catch_unwind();
    // The claim is renewed while the handler runs, so a handler slower than the in-flight TTL
    // is not taken for a dead one and run a second time.
    let handled = with_heartbeat(&cfg, &claim, handled).await;

    // The expiry the stored response gets, said on this response too.
    let expires_at = idempotency::later(now(), cfg.retention);
    let mut stored_until = None;
    let (parts, body) = match handled {
        Ok(Handled::Terminal(parts, bytes)) => {
            let stored = StoredResponse {
                status: parts.status.as_u16(),
                headers: replayable_headers(&cfg, &parts.headers),
                body: StoredBody::encode(bytes.clone(), cfg.compression_threshold),
            };
            if let Some(e) = complete(&cfg, &claim, stored, expires_at).await {
                return Ok(not_acknowledged(&cfg, e));
            }
            stored_until = Some(expires_at);
            (parts, Body::from(bytes))
        }
        Ok(Handled::TooLarge(parts, read, rest)) => {
            let stored = oversize_stored(&cfg, &parts);
            if let Some(e) = complete(&cfg, &claim, stored, expires_at).await {
                return Ok(not_acknowledged(&cfg, e));
            }
            stored_until = Some(expires_at);
            // This client gets the whole response, streamed.
            let stream =
                futures::stream::once(async move { Ok::<_, axum::Error>(read) }).chain(rest.into_data_stream());
            (parts, Body::from_stream(stream))
        }
        Ok(Handled::NotTerminal(parts, body)) => {
            fail(&cfg, &claim, "the response is not terminal").await;
            (parts, body)
        }
        Ok(Handled::ServiceError(e)) => {
            fail(&cfg, &claim, "the inner service returned an error").await;
            count(outcome(how));
            return Err(e);
        }
        Ok(Handled::BodyError(e)) => {
            tracing::warn!(error = %e, "the handler's response body failed");
            fail(&cfg, &claim, "the response body failed").await;
            return Ok(rejection_response(&cfg, Rejection::ResponseBodyFailed));
        }
        Ok(Handled::Uncertain) => return Ok(mark_uncertain(&cfg, &claim).await),
        Err(_panic) => {
            fail(&cfg, &claim, "the handler panicked").await;
            return Ok(rejection_response(&cfg, Rejection::HandlerPanicked));
        }
    };

    let status = parts.status;
    let outcome = outcome(how);
    count(outcome);
    crate::metrics::record_outcome(outcome, status.as_u16());
    tracing::debug!(outcome, status = status.as_u16(), "handler ran");
    let mut response = Response::from_parts(parts, body);
    response.extensions_mut().insert(crate::metrics::Outcome(outcome));
    if let Some(expires_at) = stored_until {
        response = with_expiry(response, expires_at);
    }
    Ok(response)
}

/// Runs the handler and catches what it produced; a terminal response is read whole (at most
/// `limit` bytes).
async fn handle<S, ResBody>(
    inner: S,
    req: Request<Body>,
    ctx: IdempotencyContext,
    limit: usize,
    policy: ResponsePolicy,
) -> Handled<S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // The handler runs with its context current, for the calls it makes through the
    // propagating client middleware.
    let res = match ctx.scope(inner.oneshot(req)).await {
        Err(e) => return Handled::ServiceError(e),
        Ok(res) => res,
    };
    let (parts, body) = res.into_parts();
    if parts.extensions.get::<OutcomeUncertain>().is_some() {
        return Handled::Uncertain;
    }
    let body = Body::new(body);
    if !policy.is_terminal(parts.status.as_u16()) {
        return Handled::NotTerminal(parts, body);
    }
    // A terminal response is stored as one value before anyone sees it, so it is read whole,
    // but never more than can be stored.
    match collect_bounded(body, limit).await {
        Collected::Whole(bytes) => Handled::Terminal(parts, bytes),
        Collected::TooLarge(read, rest) => Handled::TooLarge(parts, read, rest),
        Collected::Failed(e) => Handled::BodyError(e),
    }
}

/// What the record keeps of a response too large to store. The side effects happened, so the
/// record must not run again: it completes with a short problem that says so (or the status and
/// headers alone).
fn oversize_stored(cfg: &Config, parts: &http::response::Parts) -> StoredResponse {
    tracing::warn!(
        limit = cfg.max_stored_response,
        status = parts.status.as_u16(),
        oversize = ?cfg.oversize,
        "the response is larger than a stored response may be; it is stored without its body"
    );
    match cfg.oversize {
        OversizeResponse::Problem => too_large_response(cfg),
        OversizeResponse::HeadersOnly => headers_only(cfg, parts),
    }
}

/// A response body read up to a limit.
enum Collected {
    Whole(Bytes),
    /// More than the limit: what was read (at most the limit) and the rest, unread.
    TooLarge(Bytes, Body),
    Failed(BoxError),
}

/// Reads `body` whole if it is at most `limit` bytes; never holds more than `limit` bytes of it
/// (besides the one frame that crossed the limit, which the handler had already made). A body
/// of one frame (what a handler's `String`, `Vec` or `Json` answer is) is kept as that frame,
/// not copied.
async fn collect_bounded(mut body: Body, limit: usize) -> Collected {
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Collected::TooLarge(Bytes::new(), body);
    }
    let mut read = Read::None;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Collected::Failed(e.into()),
        };
        // Trailers are not stored or replayed.
        let Ok(data) = frame.into_data() else { continue };
        if read.len() + data.len() > limit {
            let rest = Body::from_stream(
                futures::stream::once(async move { Ok::<_, axum::Error>(data) }).chain(body.into_data_stream()),
            );
            return Collected::TooLarge(read.into_bytes(), rest);
        }
        read = read.and(data);
    }
    Collected::Whole(read.into_bytes())
}

/// What [`collect_bounded`] has read so far.
enum Read {
    None,
    /// One frame, as it came.
    One(Bytes),
    /// Two or more, copied together.
    Many(BytesMut),
}

impl Read {
    fn len(&self) -> usize {
        match self {
            Read::None => 0,
            Read::One(b) => b.len(),
            Read::Many(b) => b.len(),
        }
    }

    fn and(self, data: Bytes) -> Self {
        match self {
            Read::None => Read::One(data),
            Read::One(first) => {
                let mut all = BytesMut::with_capacity(first.len() + data.len());
                all.extend_from_slice(&first);
                all.extend_from_slice(&data);
                Read::Many(all)
            }
            Read::Many(mut all) => {
                all.extend_from_slice(&data);
                Read::Many(all)
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Read::None => Bytes::new(),
            Read::One(b) => b,
            Read::Many(b) => b.freeze(),
        }
    }
}

/// What a retry of a request whose response was too large to store gets: a short problem,
/// stored in the response's place.
fn too_large_response(cfg: &Config) -> StoredResponse {
    let problem = Rejection::ResponseTooLarge { limit: cfg.max_stored_response }.into_problem(cfg);
    StoredResponse {
        status: problem.status().as_u16(),
        headers: vec![(http::header::CONTENT_TYPE.as_str().to_owned(), crate::problem::PROBLEM_JSON.to_owned())],
        body: StoredBody::encode(Bytes::from(problem.to_json()), cfg.compression_threshold),
    }
}

/// A response too large to store, as its status and replayable headers, marked
/// `Idempotency-Body-Omitted: true`, with an empty body.
fn headers_only(cfg: &Config, parts: &http::response::Parts) -> StoredResponse {
    let mut headers = replayable_headers(cfg, &parts.headers);
    headers.push((crate::headers::IDEMPOTENCY_BODY_OMITTED.as_str().to_owned(), "true".to_owned()));
    StoredResponse { status: parts.status.as_u16(), headers, body: StoredBody::encode(Bytes::new(), usize::MAX) }
}

/// What the client of an attempt whose completion the store wrote but could not get
/// acknowledged by its replicas gets instead of the response: `503 store-unavailable`. The
/// response is not answered as final, since a failover may lose it; a retry replays it once the
/// store has it.
fn not_acknowledged(cfg: &Config, e: StoreError) -> Response<Body> {
    tracing::warn!(
        error = %ErrorChain(&e),
        "the response was stored but not acknowledged by the store's replicas; the client gets 503 and its retry \
         replays it"
    );
    rejection_response(cfg, Rejection::StoreUnavailable(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static str]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            parts.iter().map(|p| Ok(Bytes::from_static(p.as_bytes()))).collect();
        Body::from_stream(futures::stream::iter(chunks))
    }

    async fn rest_of(body: Body) -> Bytes {
        body.collect().await.expect("rest").to_bytes()
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_read_whole_in_one_frame_or_many() {
        for (parts, limit) in [(&["abc"][..], 3), (&["ab", "c"][..], 3), (&["a", "b", "c"][..], 8), (&[][..], 0)] {
            match collect_bounded(frames(parts), limit).await {
                Collected::Whole(b) => assert_eq!(b, parts.concat().as_bytes(), "{parts:?}"),
                _ => panic!("{parts:?} within {limit} was not read whole"),
            }
        }
    }

    #[tokio::test]
    async fn a_body_over_the_limit_gives_what_was_read_and_the_rest_unread() {
        for (parts, limit, read) in
            [(&["abc"][..], 2, ""), (&["ab", "cd"][..], 3, "ab"), (&["a", "b", "cd"][..], 3, "ab")]
        {
            match collect_bounded(frames(parts), limit).await {
                Collected::TooLarge(got, rest) => {
                    assert_eq!(got, read.as_bytes(), "{parts:?}");
                    let whole = [got, rest_of(rest).await].concat();
                    assert_eq!(whole, parts.concat().as_bytes(), "{parts:?}: nothing lost");
                }
                _ => panic!("{parts:?} over {limit} was not refused"),
            }
        }
    }
}
