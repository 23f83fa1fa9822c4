//! The store interface: each state transition is one method, one atomic statement.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Claim, ClaimOutcome, ClaimRequest, Forget, Principal, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery,
    Renewal, Resolve, Scope, StoredResponse, Timestamp,
};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached or the operation failed in it (connection refused, pool
    /// timeout, I/O error). Nothing is known about the record; never treat this as ownership.
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The claim is no longer the record's current one (it went stale and was re-claimed, or
    /// the record was completed, failed or swept since). Nothing was written.
    #[error("the claim was superseded (generation {generation} is no longer current)")]
    Fenced {
        /// The superseded claim's generation.
        generation: i64,
    },
    /// A stored row could not be read back (unknown state, bad encoding).
    #[error("a stored record is corrupt: {0}")]
    Corrupt(String),
    /// A listing's cursor is not one this store made (`list_records`). Nothing was read.
    #[error("the cursor is not valid for this store")]
    InvalidCursor,
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Unavailable(Box::new(e))
    }

    /// True when this is [`StoreError::Unavailable`] because the write was made but not
    /// acknowledged as durable as the store was told to make it ([`NotAcknowledged`] anywhere in
    /// its causes): the record may hold the write, or may lose it in a failover.
    pub fn is_not_acknowledged(&self) -> bool {
        let Self::Unavailable(source) = self else { return false };
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
        while let Some(e) = cause {
            if e.is::<NotAcknowledged>() {
                return true;
            }
            cause = e.source();
        }
        false
    }
}

/// The cause of a [`StoreError::Unavailable`] for a write the store applied but could not get
/// acknowledged by as many replicas as it was told to wait for (Redis `WAIT`), in time. A
/// failover may lose such a write, so it is not taken as done: a claim so refused runs no
/// handler, and a response whose completion is so refused is not answered as final.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {acknowledged} of {wanted} replicas acknowledged it within {timeout:?}")]
pub struct NotAcknowledged {
    /// The transition (`claim`, `complete`, ...).
    pub what: &'static str,
    /// How many replicas acknowledged it.
    pub acknowledged: i64,
    /// How many were asked for.
    pub wanted: u32,
    /// How long the store waited.
    pub timeout: Duration,
}

/// An error and its causes on one line, `what failed: why: why`, for logs.
///
/// The errors of these crates say what failed and carry the cause as their
/// [`source`](std::error::Error::source), never in their message too, so `{:#}` in `anyhow` and
/// this adapter read as a clean chain. Log with `error = %ErrorChain(&e)`, which every log format
/// shows whole (a `tracing` subscriber's JSON output drops an error's sources).
///
/// ```
/// use idempotency::{ErrorChain, StoreError};
///
/// let e = StoreError::unavailable(std::io::Error::other("connection refused"));
/// assert_eq!(e.to_string(), "the idempotency store is unavailable");
/// assert_eq!(ErrorChain(&e).to_string(), "the idempotency store is unavailable: connection refused");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}

/// Where idempotency records live. Every method is one atomic statement or transaction; no
/// transaction is held open between `claim` and `complete`.
///
/// Implementations: [`crate::MemoryStore`] here; SQLite and PostgreSQL in `idempotency-sqlx`;
/// Redis and Redis Cluster in `idempotency-redis`. All of them pass the conformance suite
/// (feature `conformance`: the `store_conformance_suite!` macro, and `conformance::Holding` to
/// keep a fixture's test database or server alive as long as the store).
///
/// # Writing a store
///
/// The Redis store is the closest reference for a new backend: each transition is one script on
/// one key, with no SQL around it, so what a transition must check and write reads directly.
/// Rules every store keeps, and the suite checks:
///
/// - **Time comes from the caller.** A store never reads its own clock (nor the database's):
///   every `now`, `expires_at` and `started_at` it compares or writes is passed in, so replicas
///   with skewed clocks agree on what the caller decided, and tests can move time.
/// - **Timestamps are kept to the microsecond.** Callers pass [`crate::now`]'s values (truncated
///   to microseconds); a store keeps at least that precision and reads back exactly what it was
///   given, so a record read back compares equal to the one written.
/// - **A record in flight outlives its live attempt** (docs/protocol.md#records). A claim, a reclaim and a
///   heartbeat each leave the record expiring no earlier than their `now + in_flight_ttl`
///   (`record_expires_at` of [`ClaimRequest`], [`ReclaimRequest`] and [`Renewal`]), however
///   short the retention they ask for; and a claim never replaces an expired record that is in
///   flight under a live claim ([`Record::is_free`]). So no sweep and no claim frees the key of a
///   handler that still runs.
/// - **Uncertain is never run on a guess.** A record in state
///   [`uncertain`](crate::RecordState::Uncertain) is returned by `claim` as an existing record
///   however old its attempt, is never taken by `reclaim`, and leaves that state only by
///   `take_over_uncertain`, `resolve`, `forget` or its expiry.
/// - **Fenced writes.** `complete`, `fail`, `mark_uncertain`, `heartbeat` and `remove` write only while the claim's
///   record id and generation are the record's current ones and it is in flight; otherwise
///   [`StoreError::Fenced`] and nothing is written (a fenced call never recreates a removed
///   record).
/// - **Errors by kind.** A backend error is [`StoreError::Unavailable`] (never ownership), an
///   unreadable row [`StoreError::Corrupt`].
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// none -> in_flight, atomically: creates the record (expiring at
    /// [`ClaimRequest::record_expires_at`]) and returns [`ClaimOutcome::Owned`], or, when a live
    /// record exists, returns it as [`ClaimOutcome::Existing`] without changing it. A record whose
    /// key is free ([`Record::is_free`] at `req.now` by `req.in_flight_ttl`: expired, and not in
    /// flight under a live claim) counts as absent: it is replaced by a new record with a new
    /// record id. Exactly one of many concurrent callers owns a new key.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError>;

    /// failed -> in_flight, or a stale in_flight -> in_flight: a compare-and-set on the record's
    /// generation. Succeeds (with generation + 1 and `started_at = req.now`) only if the record
    /// still has `req.record.generation` and is failed, or in flight with
    /// `started_at + req.in_flight_ttl <= req.now`. Of concurrent callers exactly one gets `Some`.
    ///
    /// The record's `expires_at` becomes the later of its own and
    /// [`ReclaimRequest::record_expires_at`] (the new attempt's `now + retention`, at least
    /// `now + in_flight_ttl`), so the sweeper never removes a record while an attempt runs, and a
    /// claim near the end of the retention window is not replaced by a new record.
    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError>;

    /// Renews a live claim: sets the in-flight record's `started_at` to `renewal.now` (never
    /// earlier than it was), so the claim does not go stale while its handler still runs, and its
    /// `expires_at` to the later of its own and [`Renewal::record_expires_at`], so the record
    /// does not expire under it either (a handler may run longer than the retention). Fenced like
    /// `complete`: [`StoreError::Fenced`] when the claim was superseded, or the record completed,
    /// failed or is gone; nothing is written then.
    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError>;

    /// Deletes the claim's record, fenced like `complete` (the record must still be in flight
    /// under this claim's generation; [`StoreError::Fenced`] otherwise, and nothing is deleted).
    /// A later claim of the key creates a new record, with a new record id and so new sub-keys.
    /// For a reaper that rolled back an abandoned operation after taking its claim with
    /// `reclaim`.
    async fn remove(&self, claim: &Claim) -> Result<(), StoreError>;

    /// in_flight -> completed, storing `response`, fenced by the claim's generation. Returns
    /// [`StoreError::Fenced`] and writes nothing when the claim is no longer current.
    async fn complete(&self, claim: &Claim, response: &StoredResponse, expires_at: Timestamp)
    -> Result<(), StoreError>;

    /// in_flight -> failed, fenced like `complete`.
    async fn fail(&self, claim: &Claim) -> Result<(), StoreError>;

    /// in_flight -> uncertain, fenced like `complete`: the claim's attempt sent its request on
    /// and cannot tell whether it acted (its answer was lost). The record keeps its expiry (at
    /// least the retention from the claim: see [`ClaimRequest::record_expires_at`]), no TTL makes
    /// it run again, and the next request with its key gets it back as an existing record
    /// ([`crate::Decision::Uncertain`]). Announced like `complete` ([`Store::changes`]).
    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError>;

    /// A stale in_flight -> uncertain: a compare-and-set like `reclaim`'s, for an attempt that
    /// died and may have sent its request on, which a caller must not run again on a guess (a
    /// gateway's rule; `reclaim` is the rule of a handler that resumes through its sub-keys).
    /// Succeeds, returning the record as it now is, only while the record still has
    /// `req.record`'s record id and generation and is in flight with
    /// `started_at + req.in_flight_ttl <= req.now`; its generation stays, its expiry becomes the
    /// later of its own and [`ReclaimRequest::record_expires_at`]. Of concurrent callers exactly
    /// one gets `Some`.
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError>;

    /// uncertain -> in_flight, to run the request again (it is known not to have happened, or
    /// its target deduplicates): a compare-and-set on the record id and generation, as
    /// `reclaim` does for a failed record. Succeeds (generation + 1, `started_at = req.now`,
    /// expiry as `reclaim` sets it) only while the record still has `req.record`'s generation
    /// and is uncertain. Of concurrent callers exactly one gets `Some`.
    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError>;

    /// Reads a record, expired or not.
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError>;

    /// Deletes at most `batch` records with `expires_at <= now`; returns how many it deleted.
    ///
    /// A store that drops whole partitions of expired records (PostgreSQL partitioned by expiry
    /// day) deletes, in one call, every record of each partition that has expired as a whole,
    /// however many (dropping costs the same whatever a partition holds), and returns that
    /// exact count; records whose partition has not expired as a whole stay until it has.
    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError>;

    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// How many records `principal` holds that count against a per-principal limit
    /// (`max_records_per_principal` in the tower layer): those that hold a stored response or a
    /// live attempt, completed, in flight or uncertain, and have not expired at `now`. A failed record
    /// stored nothing and does not count; a removed or forgotten one is gone. `None`: this store
    /// does not count (the default), and no such limit can be enforced on it. Stores answer from
    /// an index on the principal, so a count costs one index range scan, not a table scan.
    async fn count_records(&self, principal: &Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        let _ = (principal, now);
        Ok(None)
    }
    // Operating (docs/protocol.md#operating-it): list, read by id, forget.

    /// Lists the live records (not expired at `query.now`) that match `query`'s filters, at most
    /// [`RecordQuery::page_size`] of them, from `query.cursor` on. Paging is by cursor: a page
    /// never re-reads the records of the pages before it. Every record that is live and matches
    /// throughout a listing appears on exactly one of its pages. A cursor the store did not make
    /// is [`StoreError::InvalidCursor`].
    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError>;

    /// Reads the record with this id, expired or not.
    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError>;

    /// Deletes the record with this id if it is completed, failed or uncertain
    /// ([`Forget::Forgotten`]), in one atomic step that checks its state; one in flight is left
    /// alone ([`Forget::InFlight`]). The key's next request then creates a new record, with a new
    /// record id. For an uncertain record: an operator's "it did not happen".
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError>;

    /// uncertain -> completed with `response`, expiring at `expires_at`, in one atomic step that
    /// checks the state: an operator's (or a probe's) "this is what happened"; every retry then
    /// replays `response`. A record in any other state is left as it is
    /// ([`Resolve::NotUncertain`], with the record).
    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError>;

    /// Where this store announces, to every process that uses it, that a record left
    /// `in_flight` (completed, failed or uncertain): a request waiting for another process's request with
    /// its key is woken at once instead of at its next read. Default: none (waiters poll).
    /// PostgreSQL announces with LISTEN/NOTIFY.
    fn changes(&self) -> Option<std::sync::Arc<crate::RecordChanges>> {
        None
    }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Arc<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        (**self).reclaim(req).await
    }
    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        (**self).heartbeat(claim, renewal).await
    }
    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        (**self).remove(claim).await
    }
    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        (**self).complete(claim, response, expires_at).await
    }
    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        (**self).fail(claim).await
    }
    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        (**self).mark_uncertain(claim).await
    }
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        (**self).mark_stale_uncertain(req).await
    }
    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        (**self).take_over_uncertain(req).await
    }
    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        (**self).resolve(id, response, expires_at).await
    }
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        (**self).get(scope).await
    }
    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        (**self).sweep_expired(now, batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        (**self).ping().await
    }
    async fn count_records(&self, principal: &Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        (**self).count_records(principal, now).await
    }

    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        (**self).list_records(query).await
    }
    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        (**self).get_by_id(id).await
    }
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        (**self).forget(id).await
    }
    fn changes(&self) -> Option<Arc<crate::RecordChanges>> {
        (**self).changes()
    }
}
