//! Claiming the key and deciding what to answer: run the handler as owner, replay the stored
//! response, wait for the record in flight (`Prefer: wait`), or refuse.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use idempotency::{ClaimOutcome, ClaimRequest, Decision, Record, RecordState, Scope, now};
use tower::Service;

use super::owner::{Run, own};
use super::uncertain::{self, Next};
use super::{Protected, store_down};
use crate::BoxError;
use crate::config::Config;
use crate::deadline::{bounded, timed_out};
use crate::expires::with_expiry;
use crate::headers::PREFERENCE_APPLIED;
use crate::problem::{Rejection, rejection_response};
use crate::quota::PassesRecordLimit;
use crate::release::Releases;
use crate::replay::replay;
use crate::uncertain::StaleClaims;

/// How often a request may lose a re-claim race (or find its record swept) before it stops
/// and answers `409 request-in-progress`; each loss means another request just took the key.
const MAX_RACES: u32 = 8;

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
    // When this request took a place under the record limit (given back if it creates none).
    let mut reserved = None;
    if let Some(limit) = cfg.record_limit.as_ref().filter(|_| p.parts.extensions.get::<PassesRecordLimit>().is_none()) {
        match bounded(&cfg, "count", limit.reserve(store.as_ref(), &p.scope.principal, now())).await {
            Ok(true) => reserved = Some(tokio::time::Instant::now()),
            // At the limit only a key the principal already holds is answered (replay, resume);
            // a failed one holds nothing, and running it again would make one record more.
            Ok(false) => match bounded(&cfg, "get", store.get(&p.scope)).await {
                Ok(Some(record))
                    if !record.is_free(now(), cfg.in_flight_ttl) && record.state != RecordState::Failed =>
                {
                    claim_next = false
                }
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
                in_flight_ttl: cfg.in_flight_ttl,
                expires_at: idempotency::later(t, cfg.retention),
            };
            match bounded(&cfg, "claim", store.claim(req)).await {
                Ok(ClaimOutcome::Owned(claim)) => return Box::pin(own(p, claim, Run::Executed)).await,
                Ok(ClaimOutcome::Existing(record)) => {
                    // A failed record keeps the place: running it again makes it count again.
                    if record.state != RecordState::Failed {
                        release(&cfg, &p.scope, &mut reserved);
                    }
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
                Ok(Some(record)) if !record.is_free(t, cfg.in_flight_ttl) => record,
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
        let mut decision = record.decide(&p.fingerprint, t, cfg.in_flight_ttl);
        // A gateway's rule: a stale claim's attempt may have acted, so it becomes uncertain
        // instead of running again.
        if matches!(decision, Decision::Reclaim)
            && record.state == RecordState::InFlight
            && cfg.stale_claims == StaleClaims::Uncertain
        {
            match uncertain::mark_stale(&cfg, &record, t).await {
                Ok(Some(marked)) => {
                    record = marked;
                    decision = Decision::Uncertain;
                }
                // Taken over, completed or marked by another request first: read it again.
                Ok(None) => {
                    races += 1;
                    if races > MAX_RACES {
                        return Ok(in_progress(&cfg, Duration::from_secs(1)));
                    }
                    continue;
                }
                Err(res) => return Ok(res),
            }
        }
        match decision {
            Decision::Uncertain => {
                let rule = uncertain::rule_of(&cfg, &p.parts.extensions);
                match uncertain::retry(&cfg, &record, t, &rule).await {
                    Next::Answer(res) => return Ok(applied(res, waited)),
                    Next::Own(claim) => return Box::pin(own(p, claim, Run::Executed)).await,
                    Next::Again => {
                        races += 1;
                        if races > MAX_RACES {
                            return Ok(in_progress(&cfg, Duration::from_secs(1)));
                        }
                    }
                }
            }
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
                match bounded(&cfg, "reclaim", store.reclaim(uncertain::on_record(&cfg, &record, t))).await {
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

/// Gives back the record place this request reserved, once: it created no record.
fn release(cfg: &Config, scope: &Scope, reserved: &mut Option<tokio::time::Instant>) {
    if let Some(at) = reserved.take()
        && let Some(limit) = &cfg.record_limit
    {
        limit.release(&scope.principal, at);
    }
}
