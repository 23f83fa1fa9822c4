//! The [`Store`] transitions: each one script on the record's key, then the replicas' wait.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery, RecordState,
    Renewal, Resolve, Scope, Store, StoreError, StoredResponse, Timestamp,
};
use redis::Value;

use super::args::{ClaimArgs, CompleteArgs, stale_cutoff};
use super::errors::{ChangedBeforeWait, OOM_REMEMBERED, OutOfMemory};
use super::{Leaves, RedisStore, redis_error};
use crate::codec::{decode_record, encode_ts, expiry_millis, hash_fields};

/// How long `ping` waits for each primary.
const PING_EACH: Duration = Duration::from_secs(1);

impl RedisStore {
    /// Claims `req`'s key with `fresh` as the record to insert when the key is free.
    ///
    /// The script may run twice for one call: the Cluster client sends it again after an I/O
    /// error, and the first run may have inserted `fresh` before its answer was lost. The second
    /// run then finds this very call's record; it is owned, not an existing record (which would
    /// answer `409` to the request that made it, for a whole TTL): same record id (random, made
    /// by this call) and first generation, in flight.
    pub async fn claim_as(&self, req: &ClaimRequest, fresh: Record) -> Result<ClaimOutcome, StoreError> {
        let args = ClaimArgs::new(req, &fresh);
        let eat_ms = args.eat_ms.clone();
        let key = self.key_of(&req.scope);
        let index = self.inline_index(&req.scope);
        let sent = match self.run(&self.scripts.claim, &key, index.as_deref(), &args.args(), true).await {
            Ok(sent) => sent,
            Err(e) => {
                // Its reply lost or late (a timeout): the script may have run, or run yet.
                drop(self.take_back(Undo::Remove, Claim::new(fresh)));
                return Err(e);
            }
        };
        let ack = match sent.reply {
            Value::Int(1) => sent.ack,
            reply => match record_reply(reply)? {
                // The second run wrote nothing, so the `WAIT` after it (over a new connection,
                // when the first was lost) counted nothing: wait again after a write of it.
                Some(record) if is_own(&record, &fresh) && self.ack.is_some() => {
                    let leaves = Leaves { state: RecordState::InFlight, fields: &[] };
                    let again = self.again(&key, &fresh, leaves, sent.ack).await?;
                    again.ok_or_else(|| StoreError::unavailable(ChangedBeforeWait))?
                }
                Some(record) if is_own(&record, &fresh) => None,
                Some(record) => return Ok(ClaimOutcome::Existing(of_scope(record, &req.scope))),
                None => {
                    return Err(StoreError::Corrupt("the claim script returned neither ownership nor a record".into()));
                }
            },
        };
        let claim = Claim::new(fresh);
        if let Err(e) = self.acknowledged("claim", ack) {
            let _ = self.take_back(Undo::Remove, claim).await;
            return Err(e);
        }
        *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if index.is_none() {
            self.index_record(&req.scope, &eat_ms).await;
        }
        Ok(ClaimOutcome::Owned(claim))
    }
}

/// How a claim that is not to be taken is taken back.
#[derive(Debug, Clone, Copy)]
enum Undo {
    /// A new claim is removed: a retry finds the key free rather than in flight.
    Remove,
    /// A reclaim is marked failed under its new generation, so the next retry reclaims it at
    /// once rather than after the in-flight TTL.
    Fail,
    /// A take-over of an uncertain record is marked uncertain again under its new generation:
    /// nothing ran under it, and the outcome of the attempt before is as unknown as it was.
    Uncertain,
}

impl RedisStore {
    /// Takes back `claim`, written (or maybe written: its reply was lost) by a call that fails:
    /// fenced on its record id and generation, so only this call's own record is touched, and
    /// without waiting for the replicas. In a task of its own, which a caller that stops waiting
    /// (the layer bounds every store call) does not cut short; sent after the call's own script
    /// on a connection that is still up, so it runs after it.
    fn take_back(&self, how: Undo, claim: Claim) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let (what, lua) = match how {
                Undo::Remove => ("remove", &store.scripts.remove),
                Undo::Fail => ("fail", &store.scripts.fail),
                Undo::Uncertain => ("mark_uncertain", &store.scripts.mark_uncertain),
            };
            match store.fenced(what, lua, &claim, &[], None, false).await {
                Ok(()) => {
                    // On a single server the claim's own script indexed the record: it goes too.
                    if matches!(how, Undo::Remove) && store.indexes_inline() {
                        store.unindex_record(&claim.scope().principal, &store.key_of(claim.scope())).await;
                    }
                    tracing::info!(?how, "a claim that was not taken is taken back");
                }
                Err(StoreError::Fenced { .. }) => {}
                Err(e) => tracing::warn!(error = %idempotency::ErrorChain(&e), ?how,
                    "a claim that was not taken could not be taken back; it holds its key until it goes stale"),
            }
        })
    }
}

/// The two transitions that take a record over under its next generation.
#[derive(Clone, Copy)]
enum TakeOver {
    /// A failed record or a stale claim ([`Store::reclaim`]).
    Reclaim,
    /// An uncertain record ([`Store::take_over_uncertain`]).
    Uncertain,
}

impl RedisStore {
    /// Runs the script of `how` on `record` with `args`: the claim it made under generation
    /// `taken`, or `None` when another request took the record first. When the call fails (the
    /// script may have run) or the replicas do not acknowledge it, the record taken is given back
    /// ([`Undo::Fail`] after a reclaim, [`Undo::Uncertain`] after a take-over) and the call fails.
    async fn take_over(
        &self,
        how: TakeOver,
        record: &Record,
        taken: i64,
        args: &[&[u8]],
        eat_ms: &str,
    ) -> Result<Option<Claim>, StoreError> {
        let (what, lua, undo) = match how {
            TakeOver::Reclaim => ("reclaim", &self.scripts.reclaim, Undo::Fail),
            TakeOver::Uncertain => ("take_over_uncertain", &self.scripts.take_over_uncertain, Undo::Uncertain),
        };
        let key = self.key_of(&record.scope);
        let sent = match self.run(lua, &key, None, args, true).await {
            Ok(sent) => sent,
            Err(e) => {
                // The script may have run: the record, taken over by this call, under `taken`.
                let mut taken_over = record.clone();
                taken_over.generation = taken;
                drop(self.take_back(undo, Claim::new(taken_over)));
                return Err(e);
            }
        };
        let Some(claim) = record_reply(sent.reply)?.map(|r| Claim::new(of_scope(r, &record.scope))) else {
            return Ok(None);
        };
        if let Err(e) = self.acknowledged(what, sent.ack) {
            let _ = self.take_back(undo, claim.clone()).await;
            return Err(e);
        }
        self.index_record(&record.scope, eat_ms).await;
        Ok(Some(claim))
    }
}

/// The generation a reclaim or a take-over gives `record`.
fn next_generation(record: &Record) -> Result<i64, StoreError> {
    record
        .generation
        .checked_add(1)
        .ok_or_else(|| StoreError::Corrupt(format!("generation {} cannot grow", record.generation)))
}

/// Whether `found` is the record `fresh` as this call's claim script inserted it (and nobody
/// took over since): the same record id, generated by this call, still in flight at its first
/// generation.
fn is_own(found: &Record, fresh: &Record) -> bool {
    found.record_id == fresh.record_id
        && found.generation == fresh.generation
        && found.state == idempotency::RecordState::InFlight
}

/// `record`, read at the key of `scope`, with that scope whole: its fields may hold a long part
/// shortened ([`idempotency::stored_component`]), the caller's scope is the record's own.
fn of_scope(mut record: Record, scope: &Scope) -> Record {
    record.scope = scope.clone();
    record
}

pub(crate) fn record_reply(v: Value) -> Result<Option<Record>, StoreError> {
    hash_fields(v)?.map(decode_record).transpose()
}

#[async_trait]
impl Store for RedisStore {
    /// With [`RedisStoreOptions::replicas`], a new claim the replicas do not acknowledge is
    /// removed again (fenced on its record id, best effort) and fails as unavailable: no
    /// handler runs for it, and a retry finds the key free rather than in flight.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let fresh = req.new_record();
        self.claim_as(&req, fresh).await
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let expires_at = req.record_expires_at();
        let taken = next_generation(record)?;
        let (rid, generation, next) = (record.record_id.to_hex(), record.generation.to_string(), taken.to_string());
        let (at, cutoff, eat) = (encode_ts(now), stale_cutoff(now, in_flight_ttl), encode_ts(expires_at));
        let eat_ms = expiry_millis(expires_at).to_string();
        let args: [&[u8]; 7] = [
            rid.as_bytes(),
            generation.as_bytes(),
            at.as_bytes(),
            cutoff.as_bytes(),
            eat.as_bytes(),
            eat_ms.as_bytes(),
            next.as_bytes(),
        ];
        self.take_over(TakeOver::Reclaim, record, taken, &args, &eat_ms).await
    }

    /// Kept in the principal's index: an uncertain record counts as live. A run sent again after
    /// its reply was lost finds the record uncertain already and is fenced, as a second call is:
    /// the record is uncertain either way.
    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced("mark_uncertain", &self.scripts.mark_uncertain, claim, &[], None, true).await?;
        self.announce(claim);
        Ok(())
    }

    /// A run sent again after its reply was lost finds the record uncertain already and returns
    /// `None`, as for a caller that lost the race: the record is uncertain either way.
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let expires_at = req.record_expires_at();
        let (rid, generation) = (record.record_id.to_hex(), record.generation.to_string());
        let (cutoff, eat) = (stale_cutoff(now, in_flight_ttl), encode_ts(expires_at));
        let eat_ms = expiry_millis(expires_at).to_string();
        let args: [&[u8]; 5] =
            [rid.as_bytes(), generation.as_bytes(), cutoff.as_bytes(), eat.as_bytes(), eat_ms.as_bytes()];
        let key = self.key_of(&record.scope);
        let sent = self.run(&self.scripts.mark_stale_uncertain, &key, None, &args, true).await?;
        let Some(marked) = record_reply(sent.reply)?.map(|r| of_scope(r, &record.scope)) else {
            return Ok(None);
        };
        self.acknowledged("mark_stale_uncertain", sent.ack)?;
        self.index_record(&record.scope, &eat_ms).await;
        self.announce(&Claim::new(marked.clone()));
        Ok(Some(marked))
    }

    /// A take-over the replicas do not acknowledge is marked uncertain again (fenced on its new
    /// generation, best effort) and fails as unavailable.
    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, .. } = req;
        let expires_at = req.record_expires_at();
        let taken = next_generation(record)?;
        let (rid, generation, next) = (record.record_id.to_hex(), record.generation.to_string(), taken.to_string());
        let (at, eat, eat_ms) = (encode_ts(now), encode_ts(expires_at), expiry_millis(expires_at).to_string());
        let args: [&[u8]; 6] =
            [rid.as_bytes(), generation.as_bytes(), at.as_bytes(), eat.as_bytes(), eat_ms.as_bytes(), next.as_bytes()];
        self.take_over(TakeOver::Uncertain, record, taken, &args, &eat_ms).await
    }

    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        let expires_at = renewal.record_expires_at();
        let (at, eat, eat_ms) = (encode_ts(renewal.now), encode_ts(expires_at), expiry_millis(expires_at).to_string());
        let args = [at.as_bytes(), eat.as_bytes(), eat_ms.as_bytes()];
        self.fenced("heartbeat", &self.scripts.heartbeat, claim, &args, None, true).await?;
        // The index follows the record's new expiry, so an attempt that outlives its claim-time
        // expiry is still counted.
        self.index_record(claim.scope(), &eat_ms).await;
        Ok(())
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced("remove", &self.scripts.remove, claim, &[], None, true).await?;
        self.unindex_record(&claim.scope().principal, &self.key_of(claim.scope())).await;
        Ok(())
    }

    /// A completion whose script ran twice for this call (its reply was lost and it was sent
    /// again) finds the record completed by this very claim with this very response: that is
    /// this call's own, and waits for the replicas as the first run would have, instead of being
    /// fenced. Another response for a completed record is fenced: a completed record is final.
    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let args = CompleteArgs::new(response, expires_at);
        let args = args.args();
        let [status, headers, body, encoding, ..] = args;
        let fields = [("rs", status), ("rh", headers), ("rb", body), ("re", encoding)];
        let completed = Leaves { state: RecordState::Completed, fields: &fields };
        // On a single server the script indexed the record ([`Self::inline_index`]).
        self.fenced("complete", &self.scripts.complete, claim, &args, Some(completed), true).await?;
        if !self.indexes_inline() {
            self.index_record(claim.scope(), &expiry_millis(expires_at).to_string()).await;
        }
        self.announce(claim);
        Ok(())
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        let failed = Leaves { state: RecordState::Failed, fields: &[] };
        self.fenced("fail", &self.scripts.fail, claim, &[], Some(failed), true).await?;
        self.unindex_record(&claim.scope().principal, &self.key_of(claim.scope())).await;
        self.announce(claim);
        Ok(())
    }

    /// One `HGETALL`: a single command on one key is atomic already, so it needs no script.
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        let reply = self.conn.query(redis::cmd("HGETALL").arg(self.key_of(scope))).await.map_err(redis_error)?;
        Ok(record_reply(reply)?.map(|r| of_scope(r, scope)))
    }

    /// Deletes nothing and returns 0: every record's key expires by itself at its
    /// `expires_at` (`PEXPIREAT`, moved by `complete` and by a `reclaim` that extends it), and
    /// Redis removes expired keys on its own. There is no index to sweep, and none is needed.
    async fn sweep_expired(&self, _now: Timestamp, _batch: u32) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// Whether the store answers: every primary is asked at once (`PING`, then `INFO memory`
    /// where allowed), each within a second. Ready while at least one primary answers and
    /// takes writes (not over its `maxmemory`), and no write was refused with `OOM` since the
    /// last claim that succeeded (within [`OOM_REMEMBERED`]); a full server still answers reads,
    /// but is not ready for requests that create records.
    ///
    /// On a cluster a primary that does not answer, or is full, fails the calls for its own keys
    /// and the other primaries serve theirs: the store answers for most keys, and a probe that
    /// took every replica of a service out of its load balancer for it would stop those keys
    /// too. Such a primary is logged by address at each ping; the store is not ready when none
    /// is left.
    async fn ping(&self) -> Result<(), StoreError> {
        let refused = *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner());
        if refused.is_some_and(|at| at.elapsed() < OOM_REMEMBERED) {
            return Err(StoreError::unavailable(OutOfMemory { node: "a primary".to_owned() }));
        }
        let pings = self.conn.on_every_primary(&redis::cmd("PING"), Some(PING_EACH)).await.map_err(redis_error)?;
        let info = redis::cmd("INFO").arg("memory").clone();
        let info = self.conn.on_every_primary(&info, Some(PING_EACH)).await.map_err(redis_error)?;
        let (mut ready, mut failed) = (0, None);
        for (node, reply) in pings {
            let full = info.iter().any(|(n, r)| *n == node && r.as_ref().is_ok_and(crate::conn::info_out_of_memory));
            let failure = match reply.and_then(Value::extract_error) {
                Err(e) => redis_error(e),
                Ok(_) if full => StoreError::unavailable(OutOfMemory { node: node.clone() }),
                Ok(_) => {
                    ready += 1;
                    continue;
                }
            };
            tracing::warn!(node, error = %idempotency::ErrorChain(&failure), "a Redis primary fails its keys");
            failed.get_or_insert(failure);
        }
        match failed {
            Some(e) if ready == 0 => Err(e),
            _ => Ok(()),
        }
    }

    /// From the principal's index (see `index_record`: the records that were claimed, reclaimed
    /// or completed, less those that failed or are gone since), on the index's primary. `None` when that
    /// primary does not answer within a second: the index is on one shard and the
    /// principal's keys on all of them, so the record limit is not enforced for the call rather
    /// than every key of the principal refused for one shard's outage.
    async fn count_records(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.count_indexed(principal, now).await
    }

    /// `SCAN` over the prefix on each node in turn (see [`crate::admin`]).
    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.admin_list(query).await
    }

    /// A scan of every record under the prefix: a record's key is a digest of its scope, so
    /// there is no key to find it by its id alone.
    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.admin_find(id).await?.map(|(_, r)| r))
    }

    /// Found like `get_by_id`, then one script on the record's key deletes it if it still has
    /// this id and is not in flight.
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        self.admin_forget(id).await
    }

    /// Found like `get_by_id`, then one script on the record's key completes it if it still has
    /// this id and is uncertain.
    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        self.admin_resolve(id, response, expires_at).await
    }

    /// Subscribes to the prefix's announcements ([`crate::changes_channel`]) on a connection of
    /// its own, from the first call on (it needs a tokio runtime; without one: none, and waiters
    /// poll).
    fn changes(&self) -> Option<Arc<idempotency::RecordChanges>> {
        self.changes
            .get_or_init(|| {
                let runtime = tokio::runtime::Handle::try_current().ok()?;
                let changes = Arc::new(idempotency::RecordChanges::new());
                let channel = crate::changes::channel(&self.prefix);
                runtime.spawn(crate::changes::listen(self.subscribers.clone(), channel, Arc::downgrade(&changes)));
                Some(changes)
            })
            .clone()
    }
}
