//! [`Holding`]: a store that keeps what it lives in alive as long as it is.

use std::sync::Arc;

use async_trait::async_trait;

use crate::{
    Claim, ClaimOutcome, ClaimRequest, Forget, Principal, ReclaimRequest, Record, RecordChanges, RecordId, RecordPage,
    RecordQuery, Renewal, Scope, Store, StoreError, StoredResponse, Timestamp,
};

/// A store that keeps a guard (a temp dir, a test database, a cluster, a key prefix to clean up)
/// alive as long as the store is, and forwards every call to it. Fields drop in order: the store
/// (its pool) first, then the guard. For a store crate's conformance fixtures: two handles on
/// one backend share the guard.
///
/// ```
/// use std::sync::Arc;
/// use idempotency::MemoryStore;
/// use idempotency::conformance::{Fixture, Holding};
///
/// let guard = Arc::new(()); // say, a tempfile::TempDir
/// let store = Arc::new(MemoryStore::new());
/// let fixture = Fixture {
///     store: Arc::new(Holding::new(store.clone(), guard.clone())),
///     peer: Arc::new(Holding::new(store, guard)),
/// };
/// # let _ = fixture;
/// ```
pub struct Holding<S, G> {
    store: S,
    _guard: Arc<G>,
}

impl<S, G> Holding<S, G> {
    /// `store`, keeping `guard` alive while it lives.
    pub fn new(store: S, guard: Arc<G>) -> Self {
        Self { store, _guard: guard }
    }

    /// The store.
    pub fn inner(&self) -> &S {
        &self.store
    }
}

impl<S: std::fmt::Debug, G> std::fmt::Debug for Holding<S, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holding").field("store", &self.store).finish_non_exhaustive()
    }
}

#[async_trait]
impl<S: Store, G: Send + Sync + 'static> Store for Holding<S, G> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.store.claim(req).await
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
    async fn resolve(
        &self,
        id: &crate::RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<crate::Resolve, StoreError> {
        self.store.resolve(id, response, expires_at).await
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
    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        self.store.complete(claim, response, expires_at).await
    }
    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.store.fail(claim).await
    }
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        self.store.get(scope).await
    }
    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        self.store.sweep_expired(now, batch).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }
    async fn count_records(&self, principal: &Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        self.store.count_records(principal, now).await
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
    fn changes(&self) -> Option<Arc<RecordChanges>> {
        self.store.changes()
    }
}
