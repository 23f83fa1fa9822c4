//! The per-principal record limit (`max_records_per_principal`): how many live records each
//! principal may hold. A record counts while it holds a stored response or a live attempt
//! (completed or in flight, not expired); a failed one (a `5xx`, a refusal) stored nothing and
//! does not count.
//!
//! Counting is the store's ([`Store::count_records`](idempotency::Store::count_records), a range
//! scan of an index on the principal). Each process keeps a principal's count for at most
//! [`COUNT_TTL`] and counts a place for each request that may create a record meanwhile (given
//! back when it did not, or when its attempt failed), so a busy principal costs one count a
//! second rather than one a request, and concurrent requests cannot all pass on one count. The
//! limit is therefore exact for one process and may be overshot by the records other replicas
//! create within [`COUNT_TTL`]; records that expire in the meantime are noticed at the next
//! count.
//!
//! A request marked [`PassesRecordLimit`] is never refused by the limit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idempotency::{Principal, Store, StoreError, Timestamp};
use tokio::time::Instant;

/// How long a principal's count is trusted before the store is asked again.
pub(crate) const COUNT_TTL: Duration = Duration::from_secs(1);
/// The most principals whose counts are cached; beyond it the cache starts afresh (each
/// principal then costs one count more).
const MAX_CACHED: usize = 16_384;
/// `Retry-After` for a principal at its limit: its oldest records expire one by one, and a
/// minute is a polite interval to look again.
pub(crate) const RETRY_AFTER: Duration = Duration::from_secs(60);

/// Marks a request the record limit never refuses: put it in the request's extensions, in a
/// middleware before the layer, for a request that gives back what its principal holds (a
/// delete of its own resource), which a tenant at its limit must still be able to make. Its
/// record is stored and counted as any other.
///
/// ```
/// use axum::extract::Request;
/// use axum::middleware::Next;
/// use axum::response::Response;
/// use idempotency_tower::PassesRecordLimit;
///
/// async fn deletes_pass(mut req: Request, next: Next) -> Response {
///     // A real service checks that the resource is the caller's own.
///     if req.method() == axum::http::Method::DELETE {
///         req.extensions_mut().insert(PassesRecordLimit);
///     }
///     next.run(req).await
/// }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct PassesRecordLimit;

/// The limit and the cached counts.
#[derive(Debug)]
pub(crate) struct RecordLimit {
    limit: u64,
    /// Per principal: when its count was read from the store, and the count since.
    counts: Mutex<HashMap<Principal, (Instant, u64)>>,
}

impl RecordLimit {
    pub(crate) fn new(limit: u64) -> Self {
        Self { limit, counts: Mutex::new(HashMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Principal, (Instant, u64)>> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a place for a new record of `principal`: `Ok(false)` when it already holds as many
    /// records as it may. The place is counted at once, so concurrent requests of one process
    /// cannot all pass on one stale count; [`release`](Self::release) gives it back when no
    /// record was created. A store that cannot count never refuses.
    pub(crate) async fn reserve(
        &self,
        store: &dyn Store,
        principal: &Principal,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let fresh = |counts: &HashMap<Principal, (Instant, u64)>| {
            counts.get(principal).is_some_and(|(at, _)| at.elapsed() < COUNT_TTL)
        };
        if !fresh(&self.lock()) {
            let Some(n) = store.count_records(principal, now).await? else { return Ok(true) };
            let mut counts = self.lock();
            // Another request may have counted meanwhile and taken places since: keep its count.
            if !fresh(&counts) {
                if counts.len() >= MAX_CACHED {
                    counts.clear();
                }
                counts.insert(principal.clone(), (Instant::now(), n));
            }
        }
        let mut counts = self.lock();
        let Some((_, n)) = counts.get_mut(principal) else { return Ok(true) };
        if *n >= self.limit {
            return Ok(false);
        }
        *n += 1;
        Ok(true)
    }

    /// Gives back a place: the request created no record after all, or its record failed,
    /// `since` then (when it reserved the place, or sent the failure). A count read from the
    /// store after that may already leave the record out, so only one read before is lowered.
    pub(crate) fn release(&self, principal: &Principal, since: Instant) {
        if let Some((counted, n)) = self.lock().get_mut(principal)
            && *counted <= since
        {
            *n = n.saturating_sub(1);
        }
    }
}
