//! [`ReplayCache`]: completed records kept in the process, so that the retries of a completed
//! request (a retry storm after a slow answer) are answered without a round trip to the store.
//!
//! A completed record never changes until it expires or an operator forgets it, so a copy is as
//! good as the record while it is live, provided the copy goes when the record is forgotten. A
//! forget in this process drops the copy at once; one in another process (another replica) is
//! heard through the store's announcements ([`Store::changes`]: PostgreSQL's NOTIFY, Redis's
//! PUBLISH), which the stores send once the forget committed. So the cache is used only while the
//! store hears its announcements: a store without them gets no cache
//! ([`ReplayCache::over`] hands it back as it is), and while the feed is down (its connection
//! broke) every copy is dropped and none is kept until it is back.
//!
//! Only completed records are kept: never one in flight, failed or uncertain, whose next request
//! must reach the store. A copy is checked exactly as the store's record would be: the same
//! scope, and not expired at the claim's time; the caller compares the fingerprint.
//!
//! A copy read from the store just before an announcement of its record arrived would be stale:
//! each read notes how many invalidations its record's slot saw before it was sent, and its copy
//! is kept only if none came in the meantime (checked again after the copy is in).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use async_trait::async_trait;
use quick_cache::Weighter;
use quick_cache::sync::Cache;

use crate::changes::{Change, ChangeObserver, RecordChanges, change_tag};
use crate::{
    Claim, ClaimOutcome, ClaimRequest, Forget, Principal, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery,
    RecordState, Renewal, Resolve, Scope, Store, StoreError, StoredResponse, Timestamp,
};

/// The counter of the claims and reads a replay cache answered (feature `metrics`).
pub const REPLAY_CACHE_HITS_TOTAL: &str = "idempotency_replay_cache_hits_total";

/// The default size of a replay cache: 64 MiB of stored responses.
pub const DEFAULT_REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// How many slots the invalidation counts are kept in (a tag's slot is a hash of it).
const SLOTS: usize = 1024;

/// What a copy costs beyond its body and headers: its scope, ids, times and the cache's own
/// entry, roughly.
const RECORD_OVERHEAD: u64 = 256;

/// A [`Store`] that answers a claim or a read of a completed record from a bounded in-process
/// copy (see the module docs). Every other call goes to the store it wraps.
///
/// ```
/// use std::sync::Arc;
/// use idempotency::{DEFAULT_REPLAY_CACHE_BYTES, MemoryStore, ReplayCache, Store};
///
/// // A store only this process uses: every forget goes through the cache.
/// let cached = ReplayCache::local(Arc::new(MemoryStore::new()), DEFAULT_REPLAY_CACHE_BYTES);
/// let store: Arc<dyn Store> = Arc::new(cached);
/// # let _ = store;
/// ```
pub struct ReplayCache {
    inner: Arc<dyn Store>,
    shared: Arc<Shared>,
}

struct Shared {
    records: Cache<String, Arc<Record>, RecordWeight>,
    /// Per slot of tags, the invalidations seen.
    epochs: Box<[AtomicU64]>,
    /// The times the feed was lost (every copy invalidated).
    losses: AtomicU64,
    feed: Feed,
    hits: AtomicU64,
}

enum Feed {
    /// Every write to the store goes through this cache: a store only this process uses.
    Local,
    /// The store's announcements, found on first use (a store starts its listener on a runtime).
    Announced(OnceLock<Option<Arc<RecordChanges>>>),
}

#[derive(Clone)]
struct RecordWeight;

impl Weighter<String, Arc<Record>> for RecordWeight {
    fn weight(&self, key: &String, record: &Arc<Record>) -> u64 {
        let response = record.response.as_ref().map_or(0, |r| {
            r.body.stored_bytes().len() + r.headers.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>()
        });
        let scope = record.scope.principal.as_str().len()
            + record.scope.endpoint.as_str().len()
            + record.scope.key.as_str().len();
        RECORD_OVERHEAD + (key.len() + scope + response) as u64
    }
}

/// Which invalidations a read saw before it was sent: its slot's and the losses of the feed.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Seen(u64, u64);

impl ReplayCache {
    /// `store` behind a cache of at most `max_bytes`, used while `store` hears its announcements
    /// ([`Store::changes`]). For a store without them, see [`ReplayCache::over`].
    pub fn new(store: Arc<dyn Store>, max_bytes: u64) -> Self {
        Self::with_feed(store, max_bytes, Feed::Announced(OnceLock::new()))
    }

    /// `store` behind a cache of at most `max_bytes`, for a store only this process writes to
    /// (a [`MemoryStore`](crate::MemoryStore)): no announcement is needed, since every forget
    /// goes through the cache. Wrong for a store another process shares.
    pub fn local(store: Arc<dyn Store>, max_bytes: u64) -> Self {
        Self::with_feed(store, max_bytes, Feed::Local)
    }

    /// `store` behind a cache of at most `max_bytes` when it can have one: when it announces
    /// its changes and `max_bytes` is not zero. Otherwise `store` itself. Call it on a tokio
    /// runtime (a store starts its listener on one).
    pub fn over(store: Arc<dyn Store>, max_bytes: u64) -> Arc<dyn Store> {
        if max_bytes == 0 || store.changes().is_none() {
            return store;
        }
        Arc::new(Self::new(store, max_bytes))
    }

    fn with_feed(inner: Arc<dyn Store>, max_bytes: u64, feed: Feed) -> Self {
        let estimated = usize::try_from(max_bytes / 2048).unwrap_or(usize::MAX).clamp(16, 1 << 20);
        let shared = Shared {
            records: Cache::with_weighter(estimated, max_bytes.max(1), RecordWeight),
            epochs: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            losses: AtomicU64::new(0),
            feed,
            hits: AtomicU64::new(0),
        };
        Self { inner, shared: Arc::new(shared) }
    }

    /// How many claims and reads the cache answered.
    pub fn hits(&self) -> u64 {
        self.shared.hits.load(Ordering::Relaxed)
    }

    /// How many records it holds.
    pub fn len(&self) -> usize {
        self.shared.records.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.shared.records.is_empty()
    }

    /// Whether copies may be read and kept now: always for a local store, while the store hears
    /// its announcements otherwise.
    fn usable(&self) -> bool {
        match &self.shared.feed {
            Feed::Local => true,
            Feed::Announced(feed) => feed
                .get_or_init(|| {
                    let changes = self.inner.changes()?;
                    let observer: Weak<dyn ChangeObserver> = Arc::downgrade(&self.shared) as Weak<Shared>;
                    changes.observe(observer);
                    Some(changes)
                })
                .as_ref()
                .is_some_and(|c| c.is_listening()),
        }
    }

    /// The copy of `scope`'s record, live at `now`, if the cache may answer.
    fn cached(&self, tag: &str, scope: &Scope, now: Timestamp) -> Option<Record> {
        if !self.usable() {
            return None;
        }
        let record = self.shared.records.get(tag)?;
        if record.scope != *scope {
            return None;
        }
        if record.is_expired(now) {
            self.shared.records.remove(tag);
            return None;
        }
        self.shared.hits.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(REPLAY_CACHE_HITS_TOTAL).increment(1);
        Some(Record::clone(&record))
    }

    /// Keeps a copy of `record`, read after `seen`, if it is completed and no invalidation of
    /// its slot came since.
    fn keep(&self, tag: String, seen: Seen, record: &Record) {
        if record.state != RecordState::Completed || !self.usable() {
            return;
        }
        if self.shared.seen(&tag) != seen {
            return;
        }
        let slot = tag.clone();
        self.shared.records.insert(tag, Arc::new(record.clone()));
        // An invalidation between the check and the insert: its remove may have come first.
        if self.shared.seen(&slot) != seen {
            self.shared.records.remove(&slot);
        }
    }
}

impl Shared {
    fn slot(tag: &str) -> usize {
        let hash = tag.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        (hash % SLOTS as u64) as usize
    }

    fn seen(&self, tag: &str) -> Seen {
        Seen(self.epochs[Self::slot(tag)].load(Ordering::SeqCst), self.losses.load(Ordering::SeqCst))
    }

    /// Drops the copy of the record `tag` names, and any read of it under way.
    fn invalidate(&self, tag: &str) {
        self.epochs[Self::slot(tag)].fetch_add(1, Ordering::SeqCst);
        self.records.remove(tag);
    }
}

impl ChangeObserver for Shared {
    fn observe(&self, change: Change<'_>) {
        match change {
            Change::Record(tag) => self.invalidate(tag),
            Change::Lost => {
                self.losses.fetch_add(1, Ordering::SeqCst);
                self.records.clear();
            }
            _ => {}
        }
    }
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("records", &self.len())
            .field("hits", &self.hits())
            .field("local", &matches!(self.shared.feed, Feed::Local))
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Store for ReplayCache {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let tag = change_tag(&req.scope);
        if let Some(record) = self.cached(&tag, &req.scope, req.now) {
            return Ok(ClaimOutcome::Existing(record));
        }
        let seen = self.shared.seen(&tag);
        let out = self.inner.claim(req).await?;
        if let ClaimOutcome::Existing(record) = &out {
            self.keep(tag, seen, record);
        }
        Ok(out)
    }
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        let tag = change_tag(scope);
        if let Some(record) = self.cached(&tag, scope, crate::now()) {
            return Ok(Some(record));
        }
        let seen = self.shared.seen(&tag);
        let out = self.inner.get(scope).await?;
        if let Some(record) = &out {
            self.keep(tag, seen, record);
        }
        Ok(out)
    }
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        let out = self.inner.forget(id).await?;
        if let Forget::Forgotten(record) = &out {
            self.shared.invalidate(&change_tag(&record.scope));
        }
        Ok(out)
    }
    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.shared.invalidate(&change_tag(claim.scope()));
        self.inner.remove(claim).await
    }
    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        let out = self.inner.resolve(id, response, expires_at).await?;
        if let Resolve::Resolved(record) = &out {
            self.shared.invalidate(&change_tag(&record.scope));
        }
        Ok(out)
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        self.inner.reclaim(req).await
    }
    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        self.inner.heartbeat(claim, renewal).await
    }
    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        self.inner.complete(claim, response, expires_at).await
    }
    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.inner.fail(claim).await
    }
    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        self.inner.mark_uncertain(claim).await
    }
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        self.inner.mark_stale_uncertain(req).await
    }
    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        self.inner.take_over_uncertain(req).await
    }
    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let swept = self.inner.sweep_expired(now, batch).await?;
        self.shared.records.retain(|_, record| !record.is_expired(now));
        Ok(swept)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    async fn count_records(&self, principal: &Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        self.inner.count_records(principal, now).await
    }
    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.inner.list_records(query).await
    }
    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get_by_id(id).await
    }
    fn changes(&self) -> Option<Arc<RecordChanges>> {
        self.inner.changes()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use chrono::Duration as Span;

    use super::*;
    use crate::{Endpoint, Fingerprint, IdempotencyKey, MemoryStore, StoredBody, now};

    fn scope(key: &str) -> Scope {
        Scope::new(Principal::new("p"), Endpoint::new("POST", "/x"), IdempotencyKey::try_from(key).expect("key"))
    }

    fn request(scope: &Scope, at: Timestamp) -> ClaimRequest {
        ClaimRequest {
            scope: scope.clone(),
            fingerprint: Fingerprint::from_stored("sha256:a"),
            now: at,
            in_flight_ttl: Duration::from_secs(60),
            expires_at: at + Span::hours(1),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse { status: 201, headers: vec![], body: StoredBody::encode(Bytes::from_static(b"{}"), 1024) }
    }

    async fn completed(store: &dyn Store, scope: &Scope, at: Timestamp) -> Record {
        let ClaimOutcome::Owned(claim) = store.claim(request(scope, at)).await.expect("claim") else {
            panic!("the first claim owns the key")
        };
        store.complete(&claim, &response(), at + Span::hours(1)).await.expect("complete");
        claim.record().clone()
    }

    async fn existing(store: &dyn Store, scope: &Scope, at: Timestamp) -> Record {
        match store.claim(request(scope, at)).await.expect("claim") {
            ClaimOutcome::Existing(r) => r,
            ClaimOutcome::Owned(c) => panic!("expected the record, owned {c:?}"),
        }
    }

    #[tokio::test]
    async fn a_completed_record_is_answered_from_the_copy_until_it_is_forgotten() {
        let cache = ReplayCache::local(Arc::new(MemoryStore::new()), DEFAULT_REPLAY_CACHE_BYTES);
        let (s, t) = (scope("k"), now());
        let first = completed(&cache, &s, t).await;
        assert_eq!(existing(&cache, &s, t).await.state, RecordState::Completed);
        assert_eq!(cache.hits(), 0, "the first read fills the cache");
        for _ in 0..3 {
            let again = existing(&cache, &s, t).await;
            assert_eq!((again.record_id, again.response), (first.record_id, Some(response())));
        }
        assert_eq!(cache.hits(), 3);
        assert!(cache.get(&s).await.expect("get").is_some());
        assert_eq!(cache.hits(), 4);

        assert!(matches!(cache.forget(&first.record_id).await.expect("forget"), Forget::Forgotten(_)));
        assert!(cache.is_empty());
        let ClaimOutcome::Owned(again) = cache.claim(request(&s, t)).await.expect("claim") else {
            panic!("a forgotten key runs again")
        };
        assert_ne!(again.record().record_id, first.record_id);
    }

    #[tokio::test]
    async fn only_live_completed_records_are_kept() {
        let cache = ReplayCache::local(Arc::new(MemoryStore::new()), DEFAULT_REPLAY_CACHE_BYTES);
        let t = now();
        // In flight, then failed, then uncertain: each read goes to the store.
        let s = scope("in-flight");
        let ClaimOutcome::Owned(claim) = cache.claim(request(&s, t)).await.expect("claim") else { panic!("owned") };
        existing(&cache, &s, t).await;
        cache.fail(&claim).await.expect("fail");
        let u = scope("uncertain");
        let ClaimOutcome::Owned(claim) = cache.claim(request(&u, t)).await.expect("claim") else { panic!("owned") };
        cache.mark_uncertain(&claim).await.expect("mark uncertain");
        existing(&cache, &u, t).await;
        existing(&cache, &u, t).await;
        assert_eq!((cache.len(), cache.hits()), (0, 0));

        // Expired at the claim's time: the store decides (the key is free again).
        let e = scope("expiring");
        completed(&cache, &e, t).await;
        existing(&cache, &e, t).await;
        assert_eq!(cache.len(), 1);
        let later = t + Span::hours(2);
        assert!(matches!(cache.claim(request(&e, later)).await.expect("claim"), ClaimOutcome::Owned(_)));
        assert_eq!(cache.hits(), 0);
    }

    #[tokio::test]
    async fn a_sweep_drops_the_copies_it_expired() {
        let cache = ReplayCache::local(Arc::new(MemoryStore::new()), DEFAULT_REPLAY_CACHE_BYTES);
        let (s, t) = (scope("swept"), now());
        completed(&cache, &s, t).await;
        existing(&cache, &s, t).await;
        assert_eq!(cache.sweep_expired(t + Span::hours(2), 100).await.expect("sweep"), 1);
        assert!(cache.is_empty());
        assert!(cache.get(&s).await.expect("get").is_none());
    }

    #[tokio::test]
    async fn a_read_that_an_invalidation_overtook_is_not_kept() {
        let cache = ReplayCache::local(Arc::new(MemoryStore::new()), DEFAULT_REPLAY_CACHE_BYTES);
        let (s, t) = (scope("raced"), now());
        completed(&cache, &s, t).await;
        let record = cache.inner.get(&s).await.expect("get").expect("the completed record");
        assert_eq!(record.state, RecordState::Completed);
        let tag = change_tag(&s);
        let seen = cache.shared.seen(&tag);
        cache.shared.invalidate(&tag);
        cache.keep(tag.clone(), seen, &record);
        assert!(cache.is_empty(), "a copy read before the invalidation");
        cache.keep(tag, cache.shared.seen(&change_tag(&s)), &record);
        assert_eq!(cache.len(), 1);
    }

    /// A memory store whose announcements the test makes.
    struct Announcing {
        store: MemoryStore,
        changes: Arc<RecordChanges>,
    }

    #[async_trait]
    impl Store for Announcing {
        async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
            self.store.claim(req).await
        }
        async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
            self.store.reclaim(req).await
        }
        async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
            self.store.heartbeat(claim, renewal).await
        }
        async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
            self.store.remove(claim).await
        }
        async fn complete(&self, c: &Claim, r: &StoredResponse, e: Timestamp) -> Result<(), StoreError> {
            self.store.complete(c, r, e).await
        }
        async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
            self.store.fail(claim).await
        }
        async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
            self.store.mark_uncertain(claim).await
        }
        async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
            self.store.mark_stale_uncertain(req).await
        }
        async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
            self.store.take_over_uncertain(req).await
        }
        async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
            self.store.get(scope).await
        }
        async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
            self.store.sweep_expired(now, batch).await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
            self.store.list_records(query).await
        }
        async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
            self.store.get_by_id(id).await
        }
        async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
            self.store.forget(id).await
        }
        async fn resolve(&self, id: &RecordId, r: &StoredResponse, e: Timestamp) -> Result<Resolve, StoreError> {
            self.store.resolve(id, r, e).await
        }
        fn changes(&self) -> Option<Arc<RecordChanges>> {
            Some(self.changes.clone())
        }
    }

    #[tokio::test]
    async fn an_announced_store_is_cached_only_while_its_feed_listens() {
        let changes = Arc::new(RecordChanges::new());
        let inner = Arc::new(Announcing { store: MemoryStore::new(), changes: changes.clone() });
        let cache = ReplayCache::new(inner.clone(), DEFAULT_REPLAY_CACHE_BYTES);
        let (s, t) = (scope("announced"), now());
        let first = completed(&cache, &s, t).await;
        existing(&cache, &s, t).await;
        existing(&cache, &s, t).await;
        assert_eq!((cache.len(), cache.hits()), (0, 0), "not listening yet: no copy");

        changes.listening();
        existing(&cache, &s, t).await;
        existing(&cache, &s, t).await;
        assert_eq!((cache.len(), cache.hits()), (1, 1));

        // Another process forgot it: its announcement drops the copy.
        assert!(matches!(inner.forget(&first.record_id).await.expect("forget"), Forget::Forgotten(_)));
        changes.wake(&change_tag(&s));
        assert!(cache.is_empty());
        assert!(matches!(cache.claim(request(&s, t)).await.expect("claim"), ClaimOutcome::Owned(_)));

        // The feed lost: every copy goes, and none is kept or read until it is back.
        let k = scope("lost");
        completed(&cache, &k, t).await;
        existing(&cache, &k, t).await;
        assert_eq!(cache.len(), 1);
        changes.lost();
        assert!(cache.is_empty());
        existing(&cache, &k, t).await;
        assert!(cache.is_empty());
        changes.listening();
        existing(&cache, &k, t).await;
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn over_keeps_a_store_without_announcements_as_it_is() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let over = ReplayCache::over(store.clone(), DEFAULT_REPLAY_CACHE_BYTES);
        assert!(Arc::ptr_eq(&store, &over));
        let changes = Arc::new(RecordChanges::new());
        let announcing: Arc<dyn Store> = Arc::new(Announcing { store: MemoryStore::new(), changes });
        assert!(!Arc::ptr_eq(&announcing, &ReplayCache::over(announcing.clone(), DEFAULT_REPLAY_CACHE_BYTES)));
        assert!(Arc::ptr_eq(&announcing, &ReplayCache::over(announcing.clone(), 0)));
    }

    #[tokio::test]
    async fn the_cache_holds_at_most_its_size() {
        let cache = ReplayCache::local(Arc::new(MemoryStore::new()), 64 * 1024);
        let t = now();
        for i in 0..400 {
            let s = scope(&format!("k{i}"));
            completed(&cache, &s, t).await;
            existing(&cache, &s, t).await;
        }
        let held = cache.shared.records.weight();
        assert!(held <= 64 * 1024 && cache.len() < 400, "{} records, {held} bytes", cache.len());
    }
}
