//! The in-memory store: for tests and single-process services that need no durability.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;
use foldhash::quality::RandomState;

use crate::record::stale_after;
use crate::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery, RecordState,
    Renewal, Resolve, Scope, Store, StoreError, StoredResponse, Timestamp,
};

const SHARDS: usize = 64;

/// An in-memory [`Store`], sharded so that unrelated keys do not contend on one lock.
///
/// Nothing survives the process; use the SQLite store for that.
///
/// Keys are hashed with foldhash, seeded at random per store (and separately for picking a shard
/// and for each shard's map), so clients cannot aim their keys at one shard or one bucket.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    route: RandomState,
}

type Shard = HashMap<Scope, Record, RandomState>;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::with_hasher(RandomState::default()))).collect(),
            route: RandomState::default(),
        }
    }

    /// How many records the store holds, expired or not.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// True when the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, scope: &Scope) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(self.route.hash_one(scope) as usize) % self.shards.len()])
    }
}

// A poisoned shard only means another thread panicked while holding it; every update below is
// a single assignment, so the map is still consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut shard = self.shard(&req.scope);
        // Looked up by reference first: a replay (the key exists) copies nothing but the record.
        if let Some(current) = shard.get_mut(&req.scope) {
            if !current.is_free(req.now, req.in_flight_ttl) {
                return Ok(ClaimOutcome::Existing(current.clone()));
            }
            let record = req.new_record();
            *current = record.clone();
            return Ok(ClaimOutcome::Owned(Claim::new(record)));
        }
        let record = req.new_record();
        shard.insert(req.scope, record.clone());
        Ok(ClaimOutcome::Owned(Claim::new(record)))
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let mut shard = self.shard(&record.scope);
        let Some(current) = shard.get_mut(&record.scope) else { return Ok(None) };
        let reclaimable = current.record_id == record.record_id
            && current.generation == record.generation
            && match current.state {
                RecordState::Failed => true,
                RecordState::InFlight => now >= stale_after(current.started_at, in_flight_ttl),
                RecordState::Completed | RecordState::Uncertain => false,
            };
        if !reclaimable {
            return Ok(None);
        }
        current.state = RecordState::InFlight;
        current.generation += 1;
        current.started_at = now;
        current.expires_at = current.expires_at.max(req.record_expires_at());
        Ok(Some(Claim::new(current.clone())))
    }

    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        let mut shard = self.shard(claim.scope());
        let current = current_claim(&mut shard, claim)?;
        current.started_at = current.started_at.max(renewal.now);
        current.expires_at = current.expires_at.max(renewal.record_expires_at());
        Ok(())
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        let mut shard = self.shard(claim.scope());
        current_claim(&mut shard, claim)?;
        shard.remove(claim.scope());
        Ok(())
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let mut shard = self.shard(claim.scope());
        let current = current_claim(&mut shard, claim)?;
        current.state = RecordState::Completed;
        current.response = Some(response.clone());
        current.expires_at = expires_at;
        Ok(())
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        let mut shard = self.shard(claim.scope());
        current_claim(&mut shard, claim)?.state = RecordState::Failed;
        Ok(())
    }

    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        let mut shard = self.shard(claim.scope());
        current_claim(&mut shard, claim)?.state = RecordState::Uncertain;
        Ok(())
    }

    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        let mut shard = self.shard(&req.record.scope);
        let Some(current) = as_read(&mut shard, req.record) else { return Ok(None) };
        if !current.is_stale(req.now, req.in_flight_ttl) {
            return Ok(None);
        }
        current.state = RecordState::Uncertain;
        current.expires_at = current.expires_at.max(req.record_expires_at());
        Ok(Some(current.clone()))
    }

    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let mut shard = self.shard(&req.record.scope);
        let Some(current) = as_read(&mut shard, req.record) else { return Ok(None) };
        if current.state != RecordState::Uncertain {
            return Ok(None);
        }
        current.state = RecordState::InFlight;
        current.generation += 1;
        current.started_at = req.now;
        current.expires_at = current.expires_at.max(req.record_expires_at());
        Ok(Some(Claim::new(current.clone())))
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        Ok(self.shard(scope).get(scope).cloned())
    }

    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let mut left = batch as usize;
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            if left == 0 {
                break;
            }
            let mut shard = lock(shard);
            let expired: Vec<Scope> =
                shard.iter().filter(|(_, r)| r.is_expired(now)).map(|(s, _)| s.clone()).take(left).collect();
            for scope in expired {
                shard.remove(&scope);
                removed += 1;
                left -= 1;
            }
        }
        Ok(removed)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Walks every shard: the in-memory store is for tests and small services.
    async fn count_records(&self, principal: &crate::Principal, now: Timestamp) -> Result<Option<u64>, StoreError> {
        let n: usize = self
            .shards
            .iter()
            .map(|s| {
                lock(s)
                    .values()
                    .filter(|r| r.scope.principal == *principal && r.state != RecordState::Failed && !r.is_expired(now))
                    .count()
            })
            .sum();
        Ok(Some(n as u64))
    }

    // A scan of every shard: this store is for tests and small single-process services.
    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        let after = query.cursor_record_id()?;
        let mut found: Vec<Record> = Vec::new();
        for shard in self.shards.iter() {
            let shard = lock(shard);
            found.extend(
                shard
                    .values()
                    .filter(|r| after.is_none_or(|a| r.record_id.as_bytes() > a.as_bytes()) && query.matches(r))
                    .cloned(),
            );
        }
        found.sort_unstable_by(|a, b| a.record_id.as_bytes().cmp(b.record_id.as_bytes()));
        found.truncate(query.page_size() + 1);
        Ok(RecordPage::from_sorted(found, query.page_size()))
    }

    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.shards.iter().find_map(|s| lock(s).values().find(|r| r.record_id == *id).cloned()))
    }

    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let Some(record) = shard.values().find(|r| r.record_id == *id).cloned() else { continue };
            if record.state == RecordState::InFlight {
                return Ok(Forget::InFlight(record));
            }
            shard.remove(&record.scope);
            return Ok(Forget::Forgotten(record));
        }
        Ok(Forget::Absent)
    }

    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let Some(record) = shard.values_mut().find(|r| r.record_id == *id) else { continue };
            if record.state != RecordState::Uncertain {
                return Ok(Resolve::NotUncertain(record.clone()));
            }
            record.state = RecordState::Completed;
            record.response = Some(response.clone());
            record.expires_at = expires_at;
            return Ok(Resolve::Resolved(record.clone()));
        }
        Ok(Resolve::Absent)
    }
}

/// The record `read` as it still stands: the same record id and generation.
fn as_read<'a>(shard: &'a mut Shard, read: &Record) -> Option<&'a mut Record> {
    shard.get_mut(&read.scope).filter(|r| r.record_id == read.record_id && r.generation == read.generation)
}

fn current_claim<'a>(shard: &'a mut Shard, claim: &Claim) -> Result<&'a mut Record, StoreError> {
    match shard.get_mut(claim.scope()) {
        Some(r)
            if r.record_id == claim.record().record_id
                && r.generation == claim.generation()
                && r.state == RecordState::InFlight =>
        {
            Ok(r)
        }
        _ => Err(StoreError::Fenced { generation: claim.generation() }),
    }
}
