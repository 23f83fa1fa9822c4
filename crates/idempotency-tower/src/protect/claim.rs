//! Claiming the key and deciding what to answer: run the handler as owner, replay the stored
//! response, wait for the record in flight (`Prefer: wait`), or refuse.

use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Response};
use idempotency::{
    ChangeSubscription, Claim, ClaimOutcome, ClaimRequest, Decision, Fingerprint, Record, RecordState, Scope,
    Timestamp, now,
};
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

use super::owner::{Run, own};
use super::uncertain::{self, Next};
use super::{Handler, Protected, store_down};
use crate::BoxError;
use crate::config::Config;
use crate::deadline::timed_out;
use crate::expires::with_expiry;
use crate::headers::PREFERENCE_APPLIED;
use crate::problem::{Rejection, rejection_response};
use crate::quota::PassesRecordLimit;
use crate::replay::replay;
use crate::uncertain::StaleClaims;
use crate::waiters::Subscription;

/// How often a request may lose a re-claim race (or find its record swept) before it stops
/// and answers `409 request-in-progress`; each loss means another request just took the key.
const MAX_RACES: u32 = 8;

/// Claims the key and answers: runs the handler as owner, replays, or refuses.
///
/// The owner path is boxed: it holds the handler's future, and a replay (or a refusal) should
/// not carry that much state in its own future.
pub(crate) async fn run<S, ResBody>(p: Protected<S>) -> Result<Response<Body>, S::Error>
where
    S: Handler<ResBody>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let cfg = p.cfg.clone();
    let waiting = Waiting::new(&cfg, &p.parts.headers, &p.scope);
    let mut waited = false;
    let mut poll = cfg.wait_poll.0.min(cfg.wait_poll.1);
    let mut races = Races::default();
    let asked = Claiming { cfg: &cfg, scope: &p.scope, fingerprint: &p.fingerprint, extensions: &p.parts.extensions };
    // When this request took a place under the record limit (given back if it creates none).
    let mut reserved = None;
    let mut claim_next = match asked.reserve(&mut reserved).await {
        Ok(claim_next) => claim_next,
        Err(res) => return Ok(res),
    };
    loop {
        // Armed before the store is read, so a completion between the read and the sleep is
        // not missed.
        let armed = waiting.arm();
        let t = now();
        let found = if claim_next { asked.claim(t, &mut reserved).await } else { asked.read(t).await };
        claim_next = false;
        let step = match found {
            ControlFlow::Continue(record) => asked.settle(record, t).await,
            ControlFlow::Break(step) => step,
        };
        match step {
            Step::Own(claim, how) => return Box::pin(own(p, claim, how)).await,
            Step::Answer(res) => return Ok(res),
            Step::Reply(res) => return Ok(waiting.applied(res, waited)),
            Step::Wait(record, retry_after) => {
                if !waiting.sleep(armed, poll).await {
                    let res = with_operation_link(&cfg, &record, in_progress(&cfg, retry_after));
                    return Ok(waiting.applied(with_expiry(res, record.expires_at), waited));
                }
                waited = true;
                poll = (poll * 2).min(cfg.wait_poll.1);
            }
            Step::Again | Step::Free => {
                if let Some(res) = races.lost(&cfg) {
                    return Ok(res);
                }
                claim_next = matches!(step, Step::Free);
            }
        }
    }
}

/// Where one round of the claim loop leads, once the record it found is decided on.
enum Step {
    /// Run the handler as the owner of this claim.
    Own(Claim, Run),
    /// Answer this, as it is.
    Answer(Response<Body>),
    /// Answer this from the record; it says the wait the request got (`Preference-Applied`).
    Reply(Response<Body>),
    /// The record is in flight: wait for it (or answer `409` with this retry-after at the
    /// deadline), then read it again.
    Wait(Record, Duration),
    /// Lost a race (the record changed under this request): read it again and decide again.
    Again,
    /// The key is free again (swept or expired since it was read): claim it afresh.
    Free,
}

/// How often this request lost a race for its key.
#[derive(Default)]
struct Races(u32);

impl Races {
    /// Counts one more lost race; past [`MAX_RACES`], the `409 request-in-progress` to answer.
    fn lost(&mut self, cfg: &Config) -> Option<Response<Body>> {
        self.0 += 1;
        (self.0 > MAX_RACES).then(|| in_progress(cfg, Duration::from_secs(1)))
    }
}

/// This request's wait for a record in flight: how long, until when, and what wakes it.
struct Waiting {
    /// The request's `Prefer: wait=N`, if it sent one.
    preferred: Option<u64>,
    wait: Duration,
    deadline: tokio::time::Instant,
    /// Woken when an attempt of this process completes or fails the record; polls find others.
    subscription: Option<Subscription>,
    /// And by the store's announcements where it makes them (PostgreSQL: other replicas too).
    announced: Option<ChangeSubscription>,
}

/// The two wake-ups of one round, armed before the store is read.
type Armed<'a> = [Option<Pin<Box<Notified<'a>>>>; 2];

impl Waiting {
    fn new(cfg: &Config, headers: &http::HeaderMap, scope: &Scope) -> Self {
        // `Prefer: wait=N` sets this request's wait, bounded by the layer's; without it, the default.
        let preferred = crate::prefer::wait_preference(headers);
        let wait = match preferred {
            Some(secs) => Duration::from_secs(secs).min(cfg.max_wait),
            None => cfg.wait_for_in_flight,
        };
        let listens = !wait.is_zero();
        Waiting {
            preferred,
            wait,
            deadline: tokio::time::Instant::now() + wait,
            subscription: listens.then(|| cfg.state.waiters.subscribe(scope)),
            announced: if listens { cfg.store.changes().map(|c| c.subscribe(scope)) } else { None },
        }
    }

    fn arm(&self) -> Armed<'_> {
        [self.subscription.as_ref().map(|s| armed(s.notify())), self.announced.as_ref().map(|s| armed(s.notify()))]
    }

    /// Sleeps until woken, for at most `poll`, or until the deadline; false when the deadline
    /// has already passed (nothing is held while waiting: no lock, no connection, only this task).
    async fn sleep(&self, armed: Armed<'_>, poll: Duration) -> bool {
        let left = self.deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let [woken, heard] = armed;
        tokio::select! {
            () = tokio::time::sleep(poll.min(left)) => {}
            () = until_notified(woken) => {}
            () = until_notified(heard) => {}
        }
        true
    }

    /// The answer, with `Preference-Applied` when the request asked for a wait and waited.
    fn applied(&self, res: Response<Body>, waited: bool) -> Response<Body> {
        match self.preferred {
            Some(_) if waited => with_preference_applied(res, self.wait),
            _ => res,
        }
    }
}

/// What the claim loop reads of the request: the layer's settings, the key's scope, the
/// request's fingerprint and extensions.
#[derive(Clone, Copy)]
struct Claiming<'a> {
    cfg: &'a Arc<Config>,
    scope: &'a Scope,
    fingerprint: &'a Fingerprint,
    extensions: &'a http::Extensions,
}

impl Claiming<'_> {
    /// Takes a place under the record limit, if there is one and the request is not exempt:
    /// `Ok(true)` to claim the key, `Ok(false)` to read the record the principal already holds.
    async fn reserve(&self, reserved: &mut Option<tokio::time::Instant>) -> Result<bool, Response<Body>> {
        let cfg = self.cfg;
        let store = &cfg.store;
        let Some(limit) =
            cfg.state.record_limit.as_ref().filter(|_| self.extensions.get::<PassesRecordLimit>().is_none())
        else {
            return Ok(true);
        };
        match cfg.state.deadline.bounded("count", limit.reserve(store.as_ref(), &self.scope.principal, now())).await {
            Ok(true) => {
                *reserved = Some(tokio::time::Instant::now());
                Ok(true)
            }
            // At the limit only a key the principal already holds is answered (replay, resume);
            // a failed one holds nothing, and running it again would make one record more.
            Ok(false) => match cfg.state.deadline.bounded("get", store.get(self.scope)).await {
                Ok(Some(record))
                    if !record.is_free(now(), cfg.in_flight_ttl) && record.state != RecordState::Failed =>
                {
                    Ok(false)
                }
                Ok(_) => {
                    let retry_after = crate::quota::RETRY_AFTER;
                    Err(rejection_response(cfg, Rejection::TooManyRecords { retry_after }))
                }
                Err(e) => Err(store_down(cfg, "get", e)),
            },
            Err(e) => Err(store_down(cfg, "count", e)),
        }
    }

    /// Claims the key: owned, or the record that holds it.
    async fn claim(&self, t: Timestamp, reserved: &mut Option<tokio::time::Instant>) -> ControlFlow<Step, Record> {
        let cfg = self.cfg;
        let req = ClaimRequest {
            scope: self.scope.clone(),
            fingerprint: self.fingerprint.clone(),
            now: t,
            in_flight_ttl: cfg.in_flight_ttl,
            expires_at: idempotency::later(t, cfg.retention),
        };
        match cfg.state.deadline.bounded("claim", cfg.store.claim(req)).await {
            Ok(ClaimOutcome::Owned(claim)) => ControlFlow::Break(Step::Own(claim, Run::Executed)),
            Ok(ClaimOutcome::Existing(record)) => {
                // A failed record keeps the place: running it again makes it count again.
                if record.state != RecordState::Failed {
                    release(cfg, self.scope, reserved);
                }
                ControlFlow::Continue(record)
            }
            Err(e) => {
                release(cfg, self.scope, reserved);
                if timed_out(&e) {
                    // The claim may still land after this answer: released if it does.
                    cfg.state.releases.push_unknown(self.scope.clone(), t);
                }
                ControlFlow::Break(Step::Answer(store_down(cfg, "claim", e)))
            }
        }
    }

    /// Reads the record again: still held, or free to claim afresh.
    async fn read(&self, t: Timestamp) -> ControlFlow<Step, Record> {
        match self.cfg.state.deadline.bounded("get", self.cfg.store.get(self.scope)).await {
            Ok(Some(record)) if !record.is_free(t, self.cfg.in_flight_ttl) => ControlFlow::Continue(record),
            // Swept or expired since we looked: the key is free, claim it afresh.
            Ok(_) => ControlFlow::Break(Step::Free),
            Err(e) => ControlFlow::Break(Step::Answer(store_down(self.cfg, "get", e))),
        }
    }

    /// Decides what a record held by another request (or by none) means for this one.
    async fn settle(&self, mut record: Record, t: Timestamp) -> Step {
        let cfg = self.cfg;
        // A replay takes the response out of the record it owns instead of copying it.
        if let Some(stored) = record.take_replay(self.fingerprint) {
            return Step::Reply(with_expiry(replay(cfg, &stored), record.expires_at));
        }
        let mut decision = record.decide(self.fingerprint, t, cfg.in_flight_ttl);
        // A gateway's rule: a stale claim's attempt may have acted, so it becomes uncertain
        // instead of running again.
        if matches!(decision, Decision::Reclaim)
            && record.state == RecordState::InFlight
            && cfg.stale_claims == StaleClaims::Uncertain
        {
            match uncertain::mark_stale(cfg, &record, t).await {
                Ok(Some(marked)) => {
                    record = marked;
                    decision = Decision::Uncertain;
                }
                // Taken over, completed or marked by another request first: read it again.
                Ok(None) => return Step::Again,
                Err(res) => return Step::Answer(res),
            }
        }
        match decision {
            Decision::Uncertain => {
                let rule = uncertain::rule_of(cfg, self.extensions);
                match uncertain::retry(cfg, &record, t, &rule).await {
                    Next::Answer(res) => Step::Reply(res),
                    Next::Own(claim) => Step::Own(claim, Run::Executed),
                    Next::Again => Step::Again,
                }
            }
            Decision::Replay(stored) => Step::Reply(with_expiry(replay(cfg, &stored), record.expires_at)),
            Decision::Mismatch => {
                Step::Answer(with_expiry(rejection_response(cfg, Rejection::Mismatch), record.expires_at))
            }
            Decision::InProgress { retry_after } => Step::Wait(record, retry_after),
            Decision::Reclaim => self.reclaim(&record, t).await,
        }
    }

    /// Takes over a failed record or a stale claim.
    async fn reclaim(&self, record: &Record, t: Timestamp) -> Step {
        let cfg = self.cfg;
        let how = if record.state == RecordState::InFlight { Run::StaleReclaimed } else { Run::Executed };
        match cfg.state.deadline.bounded("reclaim", cfg.store.reclaim(uncertain::on_record(cfg, record, t))).await {
            Ok(Some(claim)) => {
                if matches!(how, Run::StaleReclaimed) {
                    tracing::warn!(
                        generation = claim.generation(),
                        "stale in-flight claim taken over; the handler runs again"
                    );
                }
                Step::Own(claim, how)
            }
            // Another request re-claimed it first: read it again and decide again.
            Ok(None) => Step::Again,
            Err(e) => {
                if timed_out(&e) {
                    cfg.state.releases.push_unknown(self.scope.clone(), t);
                }
                Step::Answer(store_down(cfg, "reclaim", e))
            }
        }
    }
}

/// A wait for `notify`, enabled at once: a notification from now on is not missed.
fn armed(notify: &Notify) -> Pin<Box<Notified<'_>>> {
    let mut notified = Box::pin(notify.notified());
    notified.as_mut().enable();
    notified
}

/// Completes when `notified` does; never without one.
async fn until_notified(notified: Option<Pin<Box<Notified<'_>>>>) {
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
        && let Some(limit) = &cfg.state.record_limit
    {
        limit.release(&scope.principal, at);
    }
}
