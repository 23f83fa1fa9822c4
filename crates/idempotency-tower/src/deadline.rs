//! A bound on every store call the layer makes (docs/protocol.md#running-leasebroker: with the store unreachable, a request
//! is answered `503 store-unavailable` within 5 s, whatever way the store fails), that a queue
//! for a healthy store never trips.
//!
//! A store that refuses connections fails fast on its own; one whose packets are dropped (a
//! network partition, a host that froze) or whose file is locked does not: the call waits for
//! TCP's retransmission timeout (many minutes) or a busy timeout. So each call is given
//! [`store_timeout`](crate::IdempotencyLayerBuilder::store_timeout) and fails as unavailable
//! after it, unless the store took a write of this layer meanwhile: then it is busy, not down
//! (a SQLite writer queue on a loaded disk, a pool whose connections are all in use), and the
//! call keeps its place, a `store_timeout` more at a time, until the store has taken no write
//! for a whole `store_timeout`, or at most
//! [`store_queue_timeout`](crate::IdempotencyLayerBuilder::store_queue_timeout) in all.
//! Only writes count as the store's progress: a SQLite file another process holds locked still
//! answers reads, and must be taken for down.
//!
//! What a call that timed out may still have done is handled where it is made: a claim may land
//! after its caller gave up on it, and is then released
//! ([`crate::release::Releases::push_unknown`]); a completion is retried; a `fail` is tried again
//! until the store takes it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotency::{Claim, ClaimOutcome, Record, StoreError};
use tokio::time::Instant;

use crate::metrics::timed;

/// A store call that did not answer in time.
#[derive(Debug)]
pub(crate) struct StoreTimedOut {
    op: &'static str,
    after: Duration,
}

impl fmt::Display for StoreTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the store did not answer `{}` within {:?}", self.op, self.after)
    }
}

impl std::error::Error for StoreTimedOut {}

/// The writes the store took for this layer: the sign that a slow call is queued, not lost. A
/// count, not a time, so that the hot path reads no clock for it.
#[derive(Debug, Default)]
struct Progress {
    writes: AtomicU64,
}

impl Progress {
    fn mark(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }
}

/// Whether the answer of a store call shows that the store took a write.
pub(crate) trait Written {
    fn written(&self) -> bool;
}

/// `heartbeat`, `complete`, `fail`: each is a write.
impl Written for () {
    fn written(&self) -> bool {
        true
    }
}

/// A claim that owns the record wrote it; one that found it may have read only.
impl Written for ClaimOutcome {
    fn written(&self) -> bool {
        matches!(self, ClaimOutcome::Owned(_))
    }
}

/// A reclaim that won.
impl Written for Option<Claim> {
    fn written(&self) -> bool {
        self.is_some()
    }
}

/// A read.
impl Written for Option<Record> {
    fn written(&self) -> bool {
        false
    }
}

/// A resolution that completed its record.
impl Written for idempotency::Resolve {
    fn written(&self) -> bool {
        matches!(self, idempotency::Resolve::Resolved(_))
    }
}

/// The record count (a read).
impl Written for bool {
    fn written(&self) -> bool {
        false
    }
}

/// The bound on the layer's store calls: its two timeouts, and the store's progress that tells a
/// busy store from a dead one (see the module docs). One per layer, shared by its requests and its
/// background releases.
#[derive(Debug)]
pub(crate) struct StoreDeadline {
    timeout: Duration,
    queue_timeout: Duration,
    progress: Progress,
}

impl StoreDeadline {
    pub(crate) fn new(timeout: Duration, queue_timeout: Duration) -> Self {
        Self { timeout, queue_timeout, progress: Progress::default() }
    }

    /// Runs one store call (timed as `op`), failing it as unavailable once the store has taken
    /// no write for a whole store timeout (see the module docs).
    pub(crate) async fn bounded<T: Written>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let cap = started + self.queue_timeout.max(self.timeout);
        let mut until = started + self.timeout;
        let mut seen = self.progress.writes();
        let call = timed(op, call);
        let mut call = std::pin::pin!(call);
        loop {
            match tokio::time::timeout_at(until, call.as_mut()).await {
                Ok(out) => {
                    if out.as_ref().is_ok_and(Written::written) {
                        self.progress.mark();
                    }
                    return out;
                }
                // Busy, not down: the store took writes during this wait.
                Err(_) if self.progress.writes() != seen && until < cap => {
                    seen = self.progress.writes();
                    until = (until + self.timeout).min(cap);
                }
                Err(_) => return Err(StoreError::unavailable(StoreTimedOut { op, after: started.elapsed() })),
            }
        }
    }
}

/// Whether `e` is a call [`StoreDeadline::bounded`] gave up on: what it asked may still happen in the store.
pub(crate) fn timed_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(source) if source.is::<StoreTimedOut>())
}
