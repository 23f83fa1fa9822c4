//! Releasing records whose attempt ended while the store was down (docs/protocol.md#running-leasebroker).
//!
//! An attempt whose handler was cut by a store outage ends with a `fail` that the store cannot
//! take either. (An attempt whose handler answered as final but whose response could not be
//! stored on any retry is not released: its record stays in flight, docs/protocol.md#side-effects.) Without more,
//! its record stays in flight until the claim goes stale, and every retry meanwhile gets
//! `409 request-in-progress`, for up to the in-flight TTL after the store is back. So the layer
//! keeps such claims in a small queue and one background task tries them again with backoff:
//! the first `fail` the store takes releases its record, and the rest follow at once, so a retry
//! resumes within about a second of the store's return. `fail` is fenced by the claim's
//! generation: a release that comes late (the claim went stale and another attempt took it) is
//! refused by the store and changes nothing.
//!
//! A claim whose store call timed out ([`crate::deadline`]) is queued too, as a scope and the
//! claim's time: the request was answered `503` and ran no handler, but the store may still have
//! taken the claim (the statement reached it and committed after the layer gave up). When the
//! store answers again, the record is read; if it is in flight since exactly that time (this
//! attempt's claim, which nobody renews), it is failed, fenced by its generation like any other.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use idempotency::{Claim, ErrorChain, RecordState, Scope, Store, StoreError, Timestamp};
use tokio::time::Instant;
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::deadline::StoreDeadline;
use crate::detached::DetachedHandlers;

/// The most claims kept for release; past it the oldest one is left to go stale instead.
const MAX_PENDING: usize = 10_000;
/// The longest wait between two tries while the store does not answer: how late after the
/// store's return a record is released, at worst.
const MAX_DELAY: Duration = Duration::from_secs(1);
/// How long after the store answers again a claim whose call timed out is still looked for: the
/// connection that carried it may come back later than others (TCP retransmits with a backoff of
/// up to two minutes after a partition), and its statement lands then.
const LATE_LANDING: Duration = Duration::from_secs(150);

/// What to release.
enum Release {
    /// A claim this process holds.
    Claim(Arc<Claim>),
    /// A claim (or reclaim) of `scope` made at `at` whose call timed out: released only if the
    /// store took it.
    Unknown { scope: Scope, at: Timestamp },
}

/// The claims waiting for the store to take their `fail`, and what releasing them needs. Cheap
/// to clone: one queue per layer.
#[derive(Clone)]
pub(crate) struct Releases {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    store: Arc<dyn Store>,
    deadline: Arc<StoreDeadline>,
    /// How long a claim is worth releasing: after it, the claim is stale anyway.
    in_flight_ttl: Duration,
    /// The first wait between two tries.
    first_delay: Duration,
    detached: DetachedHandlers,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Pending>,
    /// Whether a task is draining the queue.
    draining: bool,
}

struct Pending {
    what: Release,
    why: &'static str,
    /// After this the claim is stale anyway: the in-flight TTL takes over.
    until: Instant,
    /// For a claim whose call timed out: until when it is looked for again while it is not in
    /// the store (set when the store first answers without it).
    look_until: Option<Instant>,
    /// Counted as the layer's detached work, so a shutdown drain gives the store a chance to come
    /// back; no longer once the store answered and a claim whose call timed out is only looked
    /// for again.
    _guard: Option<TaskTrackerToken>,
}

impl Releases {
    pub(crate) fn new(
        store: Arc<dyn Store>,
        deadline: Arc<StoreDeadline>,
        in_flight_ttl: Duration,
        first_delay: Duration,
        detached: DetachedHandlers,
    ) -> Self {
        let state = Mutex::default();
        Self { inner: Arc::new(Inner { state, store, deadline, in_flight_ttl, first_delay, detached }) }
    }

    /// Queues `claim` for release and starts the draining task if none runs.
    pub(crate) fn push(&self, claim: Arc<Claim>, why: &'static str) {
        self.push_pending(Release::Claim(claim), why);
    }

    /// Queues the claim of `scope` made at `at`, whose store call timed out, for release if the
    /// store took it.
    pub(crate) fn push_unknown(&self, scope: Scope, at: Timestamp) {
        self.push_pending(Release::Unknown { scope, at }, "the claim's store call timed out");
    }

    fn push_pending(&self, what: Release, why: &'static str) {
        let inner = &self.inner;
        let until = Instant::now() + inner.in_flight_ttl;
        let pending = Pending { what, why, until, look_until: None, _guard: Some(inner.detached.token()) };
        let start = {
            let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.queue.len() >= MAX_PENDING
                && let Some(dropped) = state.queue.pop_front()
            {
                tracing::warn!(why = dropped.why, "too many records wait for release; the oldest is left to go stale");
            }
            state.queue.push_back(pending);
            !std::mem::replace(&mut state.draining, true)
        };
        if start {
            tokio::spawn(drain(self.inner.clone()));
        }
    }
}

/// Tries the queued releases in turn until the queue is empty. While the store refuses, one
/// release is tried per backoff step (a probe, not one call per waiting claim); one that fails
/// goes to the back of the queue.
async fn drain(inner: Arc<Inner>) {
    let backoff = || {
        ExponentialBuilder::default()
            .with_min_delay(inner.first_delay.min(MAX_DELAY))
            .with_max_delay(MAX_DELAY)
            .with_jitter()
            .without_max_times()
            .build()
    };
    let mut delays = backoff();
    loop {
        let mut next = {
            let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            match state.queue.pop_front() {
                Some(pending) => pending,
                None => {
                    state.draining = false;
                    return;
                }
            }
        };
        if Instant::now() >= next.until {
            tracing::warn!(
                why = next.why,
                "the store did not answer within the in-flight TTL; the record goes stale instead of being released"
            );
            continue;
        }
        let claim = match &next.what {
            Release::Claim(claim) => claim.clone(),
            Release::Unknown { scope, at } => match inner.deadline.bounded("get", inner.store.get(scope)).await {
                // In flight since that very claim: the store took it after the call timed out.
                Ok(Some(r)) if r.state == RecordState::InFlight && r.started_at == *at => Arc::new(Claim::new(r)),
                // Not there (yet): its statement may still be on its way, so it is looked for
                // again for a while, then given up.
                Ok(_) => {
                    let look_until = *next.look_until.get_or_insert_with(|| Instant::now() + LATE_LANDING);
                    next._guard = None;
                    if Instant::now() < look_until {
                        inner.state.lock().unwrap_or_else(|e| e.into_inner()).queue.push_back(next);
                        tokio::time::sleep(delays.next().unwrap_or(MAX_DELAY)).await;
                    } else {
                        tracing::debug!("a claim whose call timed out never landed; nothing to release");
                    }
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %ErrorChain(&e), "reading a record to release failed");
                    inner.state.lock().unwrap_or_else(|e| e.into_inner()).queue.push_back(next);
                    tokio::time::sleep(delays.next().unwrap_or(MAX_DELAY)).await;
                    continue;
                }
            },
        };
        match inner.deadline.bounded("fail", inner.store.fail(&claim)).await {
            Ok(()) => {
                tracing::info!(why = next.why, "the store answers again; the attempt's record is released");
                delays = backoff();
            }
            Err(StoreError::Fenced { generation }) => {
                tracing::info!(generation, "a newer attempt took the key over before the release");
                delays = backoff();
            }
            Err(e @ StoreError::Corrupt(_)) => {
                // Trying again would not help: this record goes stale instead.
                tracing::error!(error = %ErrorChain(&e), "the record cannot be released; it goes stale instead");
            }
            Err(e) => {
                tracing::debug!(error = %ErrorChain(&e), "releasing the record failed again");
                // To the back: one record the store keeps refusing does not hold up the others.
                inner.state.lock().unwrap_or_else(|e| e.into_inner()).queue.push_back(next);
                let delay = delays.next().unwrap_or(MAX_DELAY);
                tokio::time::sleep(delay).await;
            }
        }
    }
}
