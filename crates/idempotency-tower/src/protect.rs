//! The protected request path (SPEC 1.3): claim, decide, run as owner, store or replay.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use bytes::BytesMut;
use futures::future::Either;
use futures::{FutureExt, StreamExt};
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Decision, ErrorChain, Fingerprint, Record, RecordState, Scope, StoreError,
    StoredBody, StoredResponse, Timestamp, now,
};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::BoxError;
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::deadline::{bounded, timed_out};
use crate::expires::with_expiry;
use crate::headers::PREFERENCE_APPLIED;
use crate::metrics::count;
use crate::problem::{Rejection, rejection_response};
use crate::release::Releases;
use crate::replay::{replay, replayable_headers};

/// How often a request may lose a re-claim race (or find its record swept) before it stops
/// and answers `409 request-in-progress`; each loss means another request just took the key.
const MAX_RACES: u32 = 8;
/// The shortest time between two renewals of a claim, whatever the in-flight TTL.
const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

pub(crate) struct Protected<S> {
    pub(crate) cfg: Arc<Config>,
    pub(crate) inner: S,
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) scope: Scope,
    pub(crate) fingerprint: Fingerprint,
}

/// Why the owner runs the handler: counted as the request's outcome.
#[derive(Clone, Copy)]
enum Run {
    /// A new record, or a failed one taken over.
    Executed,
    /// A stale in-flight claim taken over.
    StaleReclaimed,
}

/// Claims the key and answers: runs the handler as owner, replays, or refuses.
///
/// The owner path is boxed: it holds the handler's future, and a replay (or a refusal) should
/// not carry that much state in its own future.
pub(crate) async fn run<S, ResBody>(p: Protected<S>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let cfg = p.cfg.clone();
    let store = &cfg.store;
    // `Prefer: wait=N` sets this request's wait, bounded by the layer's; without it, the default.
    let preferred = crate::prefer::wait_preference(&p.parts.headers);
    let wait = match preferred {
        Some(secs) => Duration::from_secs(secs).min(cfg.max_wait),
        None => cfg.wait_for_in_flight,
    };
    let deadline = tokio::time::Instant::now() + wait;
    // Woken when an attempt of this process completes or fails the record; polls find others.
    let subscription = (!wait.is_zero()).then(|| cfg.waiters.subscribe(&p.scope));
    // And by the store's announcements where it makes them (PostgreSQL: other replicas too).
    let announced = if wait.is_zero() { None } else { store.changes().map(|c| c.subscribe(&p.scope)) };
    let mut waited = false;
    let applied = |res: Response<Body>, waited: bool| match preferred {
        Some(_) if waited => with_preference_applied(res, wait),
        _ => res,
    };
    let mut poll = cfg.wait_poll.0.min(cfg.wait_poll.1);
    let mut races = 0u32;
    let mut claim_next = true;
    let mut reserved = false;
    if let Some(limit) = &cfg.record_limit {
        match bounded(&cfg, "count", limit.reserve(store.as_ref(), &p.scope.principal, now())).await {
            Ok(true) => reserved = true,
            // At the limit only a key the principal already holds is answered (replay, resume).
            Ok(false) => match bounded(&cfg, "get", store.get(&p.scope)).await {
                Ok(Some(record)) if !record.is_expired(now()) => claim_next = false,
                Ok(_) => {
                    let retry_after = crate::quota::RETRY_AFTER;
                    return Ok(rejection_response(&cfg, Rejection::TooManyRecords { retry_after }));
                }
                Err(e) => return Ok(store_down(&cfg, "get", e)),
            },
            Err(e) => return Ok(store_down(&cfg, "count", e)),
        }
    }
    loop {
        // Armed before the store is read, so a completion between the read and the sleep is
        // not missed.
        let mut woken = subscription.as_ref().map(|s| Box::pin(s.notify().notified()));
        if let Some(w) = woken.as_mut() {
            w.as_mut().enable();
        }
        let mut heard = announced.as_ref().map(|s| Box::pin(s.notify().notified()));
        if let Some(h) = heard.as_mut() {
            h.as_mut().enable();
        }
        let t = now();
        let mut record = if claim_next {
            let req = ClaimRequest {
                scope: p.scope.clone(),
                fingerprint: p.fingerprint.clone(),
                now: t,
                expires_at: after(t, cfg.retention),
            };
            match bounded(&cfg, "claim", store.claim(req)).await {
                Ok(ClaimOutcome::Owned(claim)) => return Box::pin(own(p, claim, Run::Executed)).await,
                Ok(ClaimOutcome::Existing(record)) => {
                    release(&cfg, &p.scope, &mut reserved);
                    record
                }
                Err(e) => {
                    release(&cfg, &p.scope, &mut reserved);
                    if timed_out(&e) {
                        // The claim may still land after this answer: released if it does.
                        Releases::push_unknown(&cfg, p.scope.clone(), t);
                    }
                    return Ok(store_down(&cfg, "claim", e));
                }
            }
        } else {
            match bounded(&cfg, "get", store.get(&p.scope)).await {
                Ok(Some(record)) if !record.is_expired(t) => record,
                // Swept or expired since we looked: the key is free, claim it afresh.
                Ok(_) => {
                    races += 1;
                    if races > MAX_RACES {
                        return Ok(in_progress(&cfg, Duration::from_secs(1)));
                    }
                    claim_next = true;
                    continue;
                }
                Err(e) => return Ok(store_down(&cfg, "get", e)),
            }
        };
        claim_next = false;
        // A replay takes the response out of the record it owns instead of copying it.
        if let Some(stored) = record.take_replay(&p.fingerprint) {
            return Ok(applied(with_expiry(replay(&cfg, &stored), record.expires_at), waited));
        }
        match record.decide(&p.fingerprint, t, cfg.in_flight_ttl) {
            Decision::Replay(stored) => {
                return Ok(applied(with_expiry(replay(&cfg, &stored), record.expires_at), waited));
            }
            Decision::Mismatch => {
                return Ok(with_expiry(rejection_response(&cfg, Rejection::Mismatch), record.expires_at));
            }
            Decision::InProgress { retry_after } => {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    let res = with_operation_link(&cfg, &record, in_progress(&cfg, retry_after));
                    return Ok(applied(with_expiry(res, record.expires_at), waited));
                }
                waited = true;
                // Nothing is held while waiting: no lock, no connection, only this task.
                tokio::select! {
                    () = tokio::time::sleep(poll.min(left)) => {}
                    () = until_notified(woken) => {}
                    () = until_notified(heard) => {}
                }
                poll = (poll * 2).min(cfg.wait_poll.1);
            }
            Decision::Reclaim => {
                let how = if record.state == RecordState::InFlight { Run::StaleReclaimed } else { Run::Executed };
                match bounded(&cfg, "reclaim", store.reclaim(&record, t, cfg.in_flight_ttl, after(t, cfg.retention)))
                    .await
                {
                    Ok(Some(claim)) => {
                        if matches!(how, Run::StaleReclaimed) {
                            tracing::warn!(
                                generation = claim.generation(),
                                "stale in-flight claim taken over; the handler runs again"
                            );
                        }
                        return Box::pin(own(p, claim, how)).await;
                    }
                    // Another request re-claimed it first: read it again and decide again.
                    Ok(None) => {
                        races += 1;
                        if races > MAX_RACES {
                            return Ok(in_progress(&cfg, Duration::from_secs(1)));
                        }
                    }
                    Err(e) => {
                        if timed_out(&e) {
                            Releases::push_unknown(&cfg, p.scope.clone(), t);
                        }
                        return Ok(store_down(&cfg, "reclaim", e));
                    }
                }
            }
        }
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
}

/// Runs the handler as the owner of `claim`, then completes or fails the record.
async fn own<S, ResBody>(p: Protected<S>, claim: Claim, how: Run) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
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
    let handled = AssertUnwindSafe(async move {
        // The handler runs with its context current, for the calls it makes through the
        // propagating client middleware.
        match ctx.scope(inner.oneshot(req)).await {
            Err(e) => Handled::ServiceError(e),
            Ok(res) => {
                let (parts, body) = res.into_parts();
                let body = Body::new(body);
                if !policy.is_terminal(parts.status.as_u16()) {
                    return Handled::NotTerminal(parts, body);
                }
                // A terminal response is stored as one value before anyone sees it, so it is
                // read whole, but never more than can be stored.
                match collect_bounded(body, limit).await {
                    Collected::Whole(bytes) => Handled::Terminal(parts, bytes),
                    Collected::TooLarge(read, rest) => Handled::TooLarge(parts, read, rest),
                    Collected::Failed(e) => Handled::BodyError(e),
                }
            }
        }
    })
    .catch_unwind();
    // The claim is renewed while the handler runs, so a handler slower than the in-flight TTL
    // is not taken for a dead one and run a second time.
    let handled = with_heartbeat(&cfg, &claim, handled).await;

    // The expiry the stored response gets, said on this response too.
    let expires_at = after(now(), cfg.retention);
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
            // The side effects happened, so the record must not run again: it completes with a
            // short problem that says so, and this client gets the whole response, streamed.
            tracing::warn!(
                limit = cfg.max_stored_response,
                status = parts.status.as_u16(),
                "the response is larger than a stored response may be; a retry gets 410 response-too-large"
            );
            if let Some(e) = complete(&cfg, &claim, too_large_response(&cfg), expires_at).await {
                return Ok(not_acknowledged(&cfg, e));
            }
            stored_until = Some(expires_at);
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
        Err(_panic) => {
            fail(&cfg, &claim, "the handler panicked").await;
            return Ok(rejection_response(&cfg, Rejection::HandlerPanicked));
        }
    };

    let status = parts.status;
    let outcome = outcome(how);
    count(outcome);
    let span = tracing::Span::current();
    span.record("outcome", outcome);
    span.record("status", status.as_u16());
    tracing::debug!(outcome, status = status.as_u16(), "handler ran");
    let mut response = Response::from_parts(parts, body);
    response.extensions_mut().insert(crate::metrics::Outcome(outcome));
    if let Some(expires_at) = stored_until {
        response = with_expiry(response, expires_at);
    }
    Ok(response)
}

/// A response body read up to a limit.
enum Collected {
    Whole(Bytes),
    /// More than the limit: what was read (at most the limit) and the rest, unread.
    TooLarge(Bytes, Body),
    Failed(BoxError),
}

/// Reads `body` whole if it is at most `limit` bytes; never holds more than `limit` bytes of it
/// (besides the one frame that crossed the limit, which the handler had already made).
async fn collect_bounded(mut body: Body, limit: usize) -> Collected {
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Collected::TooLarge(Bytes::new(), body);
    }
    let mut read = BytesMut::new();
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
            return Collected::TooLarge(read.freeze(), rest);
        }
        read.extend_from_slice(&data);
    }
    Collected::Whole(read.freeze())
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

/// Stores the response of `claim`'s attempt. A store error (other than being fenced) is retried
/// with backoff in a task of its own, so the client is answered at once; the claim is renewed
/// while it retries. If every retry fails, the record is released (failed) as soon as the store
/// answers again ([`Releases`]), and the next retry runs the handler again, which resumes
/// through its sub-keys.
///
/// Returns the error when the store wrote the completion but its replicas did not acknowledge
/// it ([`StoreError::is_not_acknowledged`]): nothing is retried (the write is in the store
/// already), and the caller must not answer the response as final.
async fn complete(
    cfg: &Arc<Config>,
    claim: &Arc<Claim>,
    stored: StoredResponse,
    expires_at: Timestamp,
) -> Option<StoreError> {
    let first = bounded(cfg, "complete", cfg.store.complete(claim, &stored, expires_at)).await;
    let error = match first {
        Ok(()) => {
            cfg.waiters.wake(claim.scope());
            return None;
        }
        Err(StoreError::Fenced { generation }) => {
            tracing::warn!(
                generation,
                "a newer attempt owns this key; its response is the one replayed, this client gets its own"
            );
            return None;
        }
        Err(e) if e.is_not_acknowledged() => return Some(e),
        Err(e) => e,
    };
    let retry = cfg.completion_retry;
    tracing::warn!(
        error = %ErrorChain(&error),
        retries = retry.times,
        "storing the response failed; retrying in the background"
    );
    let (cfg, claim) = (cfg.clone(), claim.clone());
    let task = async move {
        let delays = ExponentialBuilder::default()
            .with_min_delay(retry.first_delay)
            .with_max_delay(retry.max_delay)
            .with_max_times(retry.times)
            .with_jitter()
            .build();
        let retried = async {
            let mut last = error;
            for delay in delays {
                tokio::time::sleep(delay).await;
                match bounded(&cfg, "complete", cfg.store.complete(&claim, &stored, expires_at)).await {
                    Ok(()) => return Ok(()),
                    Err(e @ StoreError::Fenced { .. }) => return Err(e),
                    Err(e) => {
                        tracing::debug!(error = %ErrorChain(&e), "storing the response failed again");
                        last = e;
                    }
                }
            }
            Err(last)
        };
        match with_heartbeat(&cfg, &claim, retried).await {
            Ok(()) => {
                cfg.waiters.wake(claim.scope());
                tracing::info!("the response was stored on a retry")
            }
            Err(StoreError::Fenced { generation }) => {
                tracing::warn!(generation, "a newer attempt took the key over while the response was being stored")
            }
            Err(e) => {
                tracing::error!(
                    error = %ErrorChain(&e),
                    "storing the response failed on every retry; the record is released when the store answers, \
                     and the next retry runs the handler again"
                );
                Releases::push(&cfg, claim, "the response could not be stored");
            }
        }
    };
    // Counted like a detached handler, so a shutdown drain waits for the response to be stored.
    let guard = crate::future::DetachedGuard::new();
    tokio::spawn(
        async move {
            let _guard = guard;
            task.await
        }
        .instrument(tracing::Span::current()),
    );
    None
}

/// Runs `work` while renewing `claim` every quarter of the in-flight TTL, so a live attempt
/// never goes stale. A fenced heartbeat (the claim was taken over, or the record is final)
/// stops the renewal; `work` still runs to its end.
async fn with_heartbeat<F: Future>(cfg: &Config, claim: &Claim, work: F) -> F::Output {
    let every = (cfg.in_flight_ttl / 4).max(MIN_HEARTBEAT);
    let beat = async {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match bounded(cfg, "heartbeat", cfg.store.heartbeat(claim, now())).await {
                Ok(()) => {}
                Err(StoreError::Fenced { generation }) => {
                    tracing::warn!(generation, "the claim is no longer this attempt's; renewal stops");
                    return;
                }
                Err(e) => tracing::warn!(
                    error = %ErrorChain(&e),
                    "renewing the claim failed; trying again at the next beat"
                ),
            }
        }
    };
    let work = std::pin::pin!(work);
    match futures::future::select(work, std::pin::pin!(beat)).await {
        Either::Left((out, _)) => out,
        Either::Right(((), work)) => work.await,
    }
}

fn outcome(how: Run) -> &'static str {
    match how {
        Run::Executed => "executed",
        Run::StaleReclaimed => "stale_reclaimed",
    }
}

/// Marks the attempt failed so the next retry runs the handler at once. When the store does not
/// take it, the claim is queued for release as soon as the store answers again
/// ([`Releases`]).
async fn fail(cfg: &Arc<Config>, claim: &Arc<Claim>, why: &'static str) {
    match bounded(cfg, "fail", cfg.store.fail(claim)).await {
        Ok(()) => {
            // A waiter takes the record over and runs the handler itself.
            cfg.waiters.wake(claim.scope());
            tracing::info!(why, "attempt failed; a retry runs the handler again")
        }
        Err(StoreError::Fenced { generation }) => {
            tracing::warn!(generation, why, "attempt failed after a newer attempt took the key over")
        }
        Err(e) => {
            tracing::error!(
                error = %ErrorChain(&e),
                why,
                "marking the attempt failed did not work; it is released when the store answers again"
            );
            Releases::push(cfg, claim.clone(), why);
        }
    }
}

/// Completes when `notified` does; never without one.
async fn until_notified(notified: Option<std::pin::Pin<Box<tokio::sync::futures::Notified<'_>>>>) {
    match notified {
        Some(n) => n.await,
        None => std::future::pending().await,
    }
}

/// Adds `Preference-Applied: wait=W` (RFC 7240 3): the request's `Prefer: wait` was honoured,
/// with `W` the wait it got.
fn with_preference_applied(mut res: Response<Body>, wait: Duration) -> Response<Body> {
    if let Ok(value) = HeaderValue::from_str(&format!("wait={}", wait.as_secs())) {
        res.headers_mut().insert(PREFERENCE_APPLIED, value);
    }
    res
}

fn in_progress(cfg: &Config, until_stale: Duration) -> Response<Body> {
    let retry_after = until_stale.min(cfg.in_progress_retry_after);
    rejection_response(cfg, Rejection::InProgress { retry_after })
}

/// Adds `Link: <URL>; rel="monitor"` to a `409 request-in-progress` when the layer was told where
/// the record's operation can be followed ([`crate::IdempotencyLayerBuilder::operation_link`]).
fn with_operation_link(cfg: &Config, record: &Record, mut response: Response<Body>) -> Response<Body> {
    let link = cfg.operation_link.as_ref().and_then(|f| f(record));
    if let Some(value) = link.and_then(|url| HeaderValue::from_str(&format!("<{url}>; rel=\"monitor\"")).ok()) {
        response.headers_mut().insert(http::header::LINK, value);
    }
    response
}

fn store_down(cfg: &Config, op: &'static str, e: StoreError) -> Response<Body> {
    tracing::error!(error = %ErrorChain(&e), op, "idempotency store call failed; the handler did not run");
    rejection_response(cfg, Rejection::StoreUnavailable(e))
}

/// Gives back the record place this request reserved, once: it created no record.
fn release(cfg: &Config, scope: &Scope, reserved: &mut bool) {
    if std::mem::take(reserved)
        && let Some(limit) = &cfg.record_limit
    {
        limit.release(&scope.principal);
    }
}

/// `t + d`, saturating: a retention of "forever" must not overflow.
fn after(t: Timestamp, d: Duration) -> Timestamp {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC)
}
