//! A fault-injecting [`Store`] wrapper for tests (feature `conformance`).
//!
//! [`FaultyStore`] wraps any store and makes chosen operations fail on demand, without touching
//! the inner store, so a test can check what a caller does when, say, `complete` fails after the
//! handler's side effects ran. It also counts the calls of each operation, and can make the
//! store busy rather than down ([`FaultyStore::busy`]): every call waits its turn.
//!
//! ```
//! use std::sync::Arc;
//! use idempotency::MemoryStore;
//! use idempotency::faulty::{FaultyStore, Op};
//!
//! let store = Arc::new(FaultyStore::new(MemoryStore::new()));
//! store.fail_next(Op::Complete, 2); // the next two `complete` calls return `Unavailable`
//! assert_eq!(store.failures_left(Op::Complete), 2);
//! assert_eq!(store.calls(Op::Complete), 0);
//! ```

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery, Renewal,
    Scope, Store, StoreError, StoredResponse, Timestamp,
};

/// One method of the [`Store`] trait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`Store::claim`].
    Claim,
    /// [`Store::reclaim`].
    Reclaim,
    /// [`Store::heartbeat`].
    Heartbeat,
    /// [`Store::complete`].
    Complete,
    /// [`Store::fail`].
    Fail,
    /// [`Store::remove`].
    Remove,
    /// [`Store::get`].
    Get,
    /// [`Store::sweep_expired`].
    SweepExpired,
    /// [`Store::ping`].
    Ping,
    /// [`Store::mark_uncertain`].
    MarkUncertain,
    /// [`Store::mark_stale_uncertain`].
    MarkStaleUncertain,
    /// [`Store::take_over_uncertain`].
    TakeOverUncertain,
}

impl Op {
    /// Every operation that can be failed on purpose.
    pub const ALL: [Op; 12] = [
        Op::Claim,
        Op::Reclaim,
        Op::Heartbeat,
        Op::Complete,
        Op::Fail,
        Op::Remove,
        Op::Get,
        Op::SweepExpired,
        Op::Ping,
        Op::MarkUncertain,
        Op::MarkStaleUncertain,
        Op::TakeOverUncertain,
    ];

    /// The method's name, e.g. `complete`.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Claim => "claim",
            Op::Reclaim => "reclaim",
            Op::Heartbeat => "heartbeat",
            Op::Complete => "complete",
            Op::Fail => "fail",
            Op::Remove => "remove",
            Op::Get => "get",
            Op::SweepExpired => "sweep_expired",
            Op::Ping => "ping",
            Op::MarkUncertain => "mark_uncertain",
            Op::MarkStaleUncertain => "mark_stale_uncertain",
            Op::TakeOverUncertain => "take_over_uncertain",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The cause inside the [`StoreError::Unavailable`] that [`FaultyStore`] returns for an
/// injected failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("injected fault: {op} failed on purpose")]
pub struct InjectedFault {
    /// The operation that failed.
    pub op: Op,
}

const OPS: usize = Op::ALL.len();

/// Wraps a [`Store`]; [`fail_next`](Self::fail_next) makes the next calls of one operation
/// return [`StoreError::Unavailable`] (with an [`InjectedFault`] cause) without reaching the
/// inner store. Every call is counted, failed or not.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    pending: Mutex<[u64; OPS]>,
    calls: [AtomicU64; OPS],
    injected: [AtomicU64; OPS],
    /// Each call's time in the queue of [`FaultyStore::busy`], in microseconds (0: no queue).
    busy_us: AtomicU64,
    queue: tokio::sync::Mutex<()>,
}

impl<S: Store> FaultyStore<S> {
    /// Wraps `inner`; nothing fails until told to.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            pending: Mutex::new([0; OPS]),
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            injected: std::array::from_fn(|_| AtomicU64::new(0)),
            busy_us: AtomicU64::new(0),
            queue: tokio::sync::Mutex::new(()),
        }
    }

    /// Makes the store busy, not down: from now on the calls run one at a time, in the order
    /// they came, and each takes `per_call` (a SQLite writer queue on a loaded disk). Zero ends
    /// it.
    pub fn busy(&self, per_call: Duration) {
        self.busy_us.store(u64::try_from(per_call.as_micros()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Makes the next `n` calls of `op` fail (added to any failures still pending for it).
    pub fn fail_next(&self, op: Op, n: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending[op.index()] = pending[op.index()].saturating_add(n);
    }

    /// Makes every call of `op` fail from now on, until [`heal`](Self::heal).
    pub fn fail_always(&self, op: Op) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())[op.index()] = u64::MAX;
    }

    /// Cancels every pending failure of `op`.
    pub fn heal(&self, op: Op) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())[op.index()] = 0;
    }

    /// How many failures of `op` are still to come.
    pub fn failures_left(&self, op: Op) -> u64 {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())[op.index()]
    }

    /// How many times `op` was called, failed or not.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op.index()].load(Ordering::SeqCst)
    }

    /// How many calls of `op` failed on purpose.
    pub fn injected(&self, op: Op) -> u64 {
        self.injected[op.index()].load(Ordering::SeqCst)
    }

    /// Counts a call of `op` and decides whether it fails.
    fn enter(&self, op: Op) -> Result<(), StoreError> {
        self.calls[op.index()].fetch_add(1, Ordering::SeqCst);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let left = &mut pending[op.index()];
        if *left == 0 {
            return Ok(());
        }
        if *left != u64::MAX {
            *left -= 1;
        }
        self.injected[op.index()].fetch_add(1, Ordering::SeqCst);
        Err(StoreError::unavailable(InjectedFault { op }))
    }

    /// Counts a call of `op`, fails it when told to, and else runs `call`, in its turn when the
    /// store is [`busy`](Self::busy).
    async fn call<T>(&self, op: Op, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.enter(op)?;
        let busy = self.busy_us.load(Ordering::SeqCst);
        if busy == 0 {
            return call.await;
        }
        let _turn = self.queue.lock().await;
        tokio::time::sleep(Duration::from_micros(busy)).await;
        call.await
    }
}

#[async_trait]
impl<S: Store> Store for FaultyStore<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.call(Op::Claim, self.inner.claim(req)).await
    }

    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        self.call(Op::MarkUncertain, self.inner.mark_uncertain(claim)).await
    }
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        self.call(Op::MarkStaleUncertain, self.inner.mark_stale_uncertain(req)).await
    }
    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        self.call(Op::TakeOverUncertain, self.inner.take_over_uncertain(req)).await
    }
    async fn resolve(
        &self,
        id: &crate::RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<crate::Resolve, StoreError> {
        self.inner.resolve(id, response, expires_at).await
    }
    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        self.call(Op::Reclaim, self.inner.reclaim(req)).await
    }

    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        self.call(Op::Heartbeat, self.inner.heartbeat(claim, renewal)).await
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        self.call(Op::Complete, self.inner.complete(claim, response, expires_at)).await
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.call(Op::Fail, self.inner.fail(claim)).await
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.call(Op::Remove, self.inner.remove(claim)).await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.call(Op::Get, self.inner.get(scope)).await
    }

    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        self.call(Op::SweepExpired, self.inner.sweep_expired(now, batch)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(Op::Ping, self.inner.ping()).await
    }

    async fn count_records(&self, principal: &crate::Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        self.inner.count_records(principal, now).await
    }

    // Operating: passed through, never failed on purpose.
    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.inner.list_records(query).await
    }

    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get_by_id(id).await
    }

    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        self.inner.forget(id).await
    }
    fn changes(&self) -> Option<std::sync::Arc<crate::RecordChanges>> {
        self.inner.changes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, Fingerprint, IdempotencyKey, MemoryStore, Principal, StoredBody, now};

    #[tokio::test]
    async fn fails_the_next_n_calls_of_one_op_only() {
        let store = FaultyStore::new(MemoryStore::new());
        let scope =
            Scope::new(Principal::new("p"), Endpoint::new("POST", "/x"), IdempotencyKey::try_from("k").unwrap());
        let t = now();
        let req = ClaimRequest {
            scope: scope.clone(),
            fingerprint: Fingerprint::from_stored("sha256:a"),
            now: t,
            in_flight_ttl: Duration::from_secs(300),
            expires_at: t + chrono::Duration::hours(1),
        };
        let ClaimOutcome::Owned(claim) = store.claim(req).await.unwrap() else { panic!("owned") };
        let resp = StoredResponse { status: 201, headers: vec![], body: StoredBody::encode("{}".into(), 1024) };
        store.fail_next(Op::Complete, 2);
        for _ in 0..2 {
            match store.complete(&claim, &resp, t).await {
                Err(StoreError::Unavailable(cause)) => {
                    assert_eq!(cause.downcast_ref::<InjectedFault>(), Some(&InjectedFault { op: Op::Complete }));
                }
                other => panic!("expected an injected failure, got {other:?}"),
            }
            // Untouched: still in flight.
            assert_eq!(store.inner().get(&scope).await.unwrap().unwrap().state, crate::RecordState::InFlight);
        }
        store.get(&scope).await.unwrap();
        store.complete(&claim, &resp, t).await.unwrap();
        assert_eq!((store.calls(Op::Complete), store.injected(Op::Complete)), (3, 2));
        assert_eq!((store.calls(Op::Get), store.injected(Op::Get), store.calls(Op::Claim)), (1, 0, 1));
        assert_eq!(store.failures_left(Op::Complete), 0);

        store.fail_always(Op::Ping);
        assert!(store.ping().await.is_err() && store.ping().await.is_err());
        store.heal(Op::Ping);
        store.ping().await.unwrap();
        assert_eq!(Op::ALL.iter().map(|op| op.index()).collect::<Vec<_>>(), (0..OPS).collect::<Vec<_>>());
    }
}
