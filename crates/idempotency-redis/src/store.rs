//! The store: its transitions as Lua scripts on one key each.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Forget, NotAcknowledged, Record, RecordId, RecordPage, RecordQuery, Scope,
    Store, StoreError, StoredResponse, Timestamp,
};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use crate::codec::{decode_record, encode_ts, expiry_millis, hash_fields, record_key};
use crate::conn::{Conn, Pinned};
use crate::options::{ConnectError, RedisStoreOptions};
use crate::scripts::{Lua, Scripts};

/// An [`idempotency::Store`] in Redis: one server, or a Redis Cluster. See the crate docs for
/// the data layout and which Redis settings each guarantee needs.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) conn: Conn,
    prefix: Arc<str>,
    pub(crate) scripts: Arc<Scripts>,
    ack: Option<Ack>,
    /// When a write was last refused for lack of memory (`OOM`), until a claim succeeds again.
    refused_for_memory: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// Where to subscribe to record changes, and the waiters it wakes (from the first call of
    /// `changes`).
    subscribers: Arc<Vec<redis::Client>>,
    changes: Arc<std::sync::OnceLock<Option<Arc<idempotency::RecordChanges>>>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.conn {
            Conn::Server(_) => "server",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("kind", &kind).field("prefix", &self.prefix).field("ack", &self.ack).finish()
    }
}

impl RedisStore {
    /// Connects to `url` with the default [`RedisStoreOptions`]; see
    /// [`RedisStore::connect_with`].
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::connect_with(url, RedisStoreOptions::default()).await
    }

    /// Connects to one server (`redis://[USER:PASSWORD@]HOST:PORT[/DB]`) or a cluster
    /// (`redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]...`: any reachable node serves
    /// to discover the rest), then reads every primary's `maxmemory-policy` and refuses any
    /// policy but `noeviction` ([`ConnectError::EvictingPolicy`]).
    ///
    /// The policy is read with `CONFIG GET maxmemory-policy`; where `CONFIG` is refused (renamed
    /// or denied by an ACL, as on several managed services) with `INFO memory`; where both are
    /// refused, [`RedisStoreOptions::on_unverified_policy`] decides.
    pub async fn connect_with(url: &str, options: RedisStoreOptions) -> Result<Self, ConnectError> {
        if options.prefix.contains(['{', '}']) {
            return Err(ConnectError::InvalidPrefix(options.prefix));
        }
        let conn = Conn::open(url, &options).await?;
        let subscribers = Arc::new(Conn::subscribers(url, &options)?);
        conn.check_eviction_policy(options.unverified_policy).await?;
        let ack = match options.replicas {
            0 => None,
            replicas => {
                let aof = conn.every_primary_has_waitaof().await.map_err(ConnectError::Unreachable)?;
                Some(Ack { replicas, timeout: options.replica_timeout, aof })
            }
        };
        if let Some(ack) = &ack {
            tracing::info!(command = ack.command_name(), replicas = ack.replicas, timeout = ?ack.timeout,
                "each transition waits for its replicas");
        }
        Ok(Self {
            conn,
            prefix: options.prefix.into(),
            scripts: Arc::new(Scripts::new()),
            ack,
            refused_for_memory: Arc::default(),
            subscribers,
            changes: Arc::default(),
        })
    }

    /// The replica acknowledgement each write waits for: `None` without
    /// [`RedisStoreOptions::replicas`]; otherwise the number of replicas, and whether it is
    /// `WAITAOF` (true) or `WAIT`.
    pub fn replica_ack(&self) -> Option<(u32, bool)> {
        self.ack.as_ref().map(|a| (a.replicas, a.aof))
    }

    /// How many times the cluster connection was replaced for answering nothing
    /// ([`RedisStoreOptions::cluster_reconnect_after`]); 0 on a single server.
    pub fn cluster_reconnects(&self) -> u64 {
        match &self.conn {
            Conn::Server(_) => 0,
            Conn::Cluster(c) => c.reconnects(),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds `scope`'s record: the prefix and a SHA-256 of the scope.
    pub fn key_of(&self, scope: &Scope) -> String {
        record_key(&self.prefix, scope)
    }

    /// [`Self::eval_on`] on a connection of its own, for a call that waits for no replica
    /// (the admin routes).
    pub(crate) async fn eval(&self, lua: &Lua, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        let mut conn = self.conn.pin(key);
        self.eval_on(&mut conn, lua, key, args).await
    }

    /// Runs one script on one key: `EVALSHA` by digest, and when the server answers `NOSCRIPT`
    /// (it restarted, failed over, or ran `SCRIPT FLUSH`) `EVAL` with the source, which also
    /// caches it again. Not `redis::Script::invoke_async`'s fallback: that sends `SCRIPT LOAD`
    /// to every node of a cluster, so one unreachable primary would fail a call for a key on a
    /// healthy one, and it costs two more round trips instead of one.
    ///
    /// On a connection pinned to the key's primary, so a `WAIT` can follow on the same one.
    async fn eval_on(&self, conn: &mut Pinned, lua: &Lua, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        let build = |verb: &str, script: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(script).arg(1).arg(key);
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        let reply = match conn.query(&build("EVALSHA", lua.script.get_hash())).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                conn.query(&build("EVAL", lua.code)).await
            }
            reply => reply,
        };
        if let Err(e) = &reply
            && e.code() == Some("OOM")
        {
            *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        }
        reply.map_err(redis_error)
    }

    /// Runs a fenced script (`complete`, `fail`, `heartbeat`, `remove`) for `claim`, then waits
    /// for the replicas when told to ([`RedisStoreOptions::replicas`]).
    async fn fenced(&self, what: &'static str, lua: &Lua, claim: &Claim, extra: &[&[u8]]) -> Result<(), StoreError> {
        self.fenced_then(what, lua, claim, extra, true).await
    }

    async fn fenced_then(
        &self,
        what: &'static str,
        lua: &Lua,
        claim: &Claim,
        extra: &[&[u8]],
        wait: bool,
    ) -> Result<(), StoreError> {
        let r = claim.record();
        let fence = Fence::new(claim);
        let mut args: Vec<&[u8]> = fence.args().to_vec();
        args.extend_from_slice(extra);
        let key = self.key_of(&r.scope);
        let mut conn = self.conn.pin(&key);
        match self.eval_on(&mut conn, lua, &key, &args).await? {
            Value::Int(1) if wait => self.acknowledged(&mut conn, what).await,
            Value::Int(1) => Ok(()),
            Value::Int(0) => Err(StoreError::Fenced { generation: r.generation }),
            other => Err(StoreError::Corrupt(format!("unexpected script reply {other:?}"))),
        }
    }

    /// Announces that `claim`'s record left `in_flight` (see [`crate::changes_channel`]).
    async fn announce(&self, claim: &Claim) {
        let tag = idempotency::change_tag(&claim.record().scope);
        crate::changes::announce(&self.conn, &crate::changes::channel(&self.prefix), &tag).await;
    }

    /// After a write on `conn`: `WAIT` (or `WAITAOF`) for the configured replicas; fewer in
    /// time is [`StoreError::Unavailable`] caused by [`NotAcknowledged`]. Without
    /// [`RedisStoreOptions::replicas`], nothing.
    async fn acknowledged(&self, conn: &mut Pinned, what: &'static str) -> Result<(), StoreError> {
        let Some(ack) = &self.ack else { return Ok(()) };
        let reply = conn.query(&ack.command()).await.map_err(redis_error)?;
        let acknowledged = ack.replicas_in(&reply)?;
        if acknowledged >= i64::from(ack.replicas) {
            return Ok(());
        }
        tracing::warn!(what, acknowledged, wanted = ack.replicas, "a write was not acknowledged by enough replicas");
        Err(StoreError::unavailable(NotAcknowledged { what, acknowledged, wanted: ack.replicas, timeout: ack.timeout }))
    }
}

/// What each write waits for: `WAIT replicas timeout`, or `WAITAOF 1 replicas timeout` (the
/// primary's and the replicas' append-only files synced) where every primary has it.
#[derive(Debug, Clone)]
struct Ack {
    replicas: u32,
    timeout: Duration,
    aof: bool,
}

impl Ack {
    fn command_name(&self) -> &'static str {
        if self.aof { "WAITAOF" } else { "WAIT" }
    }

    fn command(&self) -> redis::Cmd {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd(self.command_name());
        if self.aof {
            cmd.arg(1);
        }
        cmd.arg(self.replicas).arg(ms);
        cmd
    }

    /// How many replicas acknowledged, from the reply: `WAIT`'s integer, or `WAITAOF`'s pair
    /// (local, replicas), where a local file not synced counts as no replica at all.
    fn replicas_in(&self, reply: &Value) -> Result<i64, StoreError> {
        match (self.aof, reply) {
            (false, Value::Int(n)) => Ok(*n),
            (true, Value::Array(pair)) => match pair.as_slice() {
                [Value::Int(local), Value::Int(replicas)] => Ok(if *local >= 1 { *replicas } else { 0 }),
                _ => Err(StoreError::Corrupt(format!("unexpected WAITAOF reply {reply:?}"))),
            },
            _ => Err(StoreError::Corrupt(format!("unexpected {} reply {reply:?}", self.command_name()))),
        }
    }
}

/// The claim script's arguments: record id, fingerprint, now, expires_at, expires_at in epoch
/// milliseconds, principal, endpoint, key (see [`crate::scripts::CLAIM`]).
struct ClaimArgs<'a> {
    fresh: &'a Record,
    /// The scope as the record's fields keep it ([`idempotency::stored_component`]): its key is
    /// a digest of the whole scope already, and its fields need not hold a long part whole.
    stored: [std::borrow::Cow<'a, str>; 3],
    rid: String,
    now: String,
    eat: String,
    eat_ms: String,
}

impl<'a> ClaimArgs<'a> {
    /// The arguments that claim `req`'s key as `fresh` when it is free.
    fn new(req: &'a ClaimRequest, fresh: &'a Record) -> Self {
        let s = &req.scope;
        Self {
            fresh,
            stored: [s.principal.as_str(), s.endpoint.as_str(), s.key.as_str()].map(idempotency::stored_component),
            rid: fresh.record_id.to_hex(),
            now: encode_ts(req.now),
            eat: encode_ts(req.expires_at),
            eat_ms: expiry_millis(req.expires_at).to_string(),
        }
    }

    fn args(&self) -> [&[u8]; 8] {
        let [principal, endpoint, key] = &self.stored;
        [
            self.rid.as_bytes(),
            self.fresh.fingerprint.as_str().as_bytes(),
            self.now.as_bytes(),
            self.eat.as_bytes(),
            self.eat_ms.as_bytes(),
            principal.as_bytes(),
            endpoint.as_bytes(),
            key.as_bytes(),
        ]
    }
}

/// The fence's arguments, first in every fenced script: the claim's record id and generation.
struct Fence {
    rid: String,
    generation: String,
}

impl Fence {
    fn new(claim: &Claim) -> Self {
        let r = claim.record();
        Self { rid: r.record_id.to_hex(), generation: r.generation.to_string() }
    }

    fn args(&self) -> [&[u8]; 2] {
        [self.rid.as_bytes(), self.generation.as_bytes()]
    }
}

/// The complete script's arguments after the fence's: status, headers, body, body encoding,
/// expires_at, expires_at in epoch milliseconds.
struct CompleteArgs<'a> {
    response: &'a StoredResponse,
    status: String,
    headers: String,
    eat: String,
    eat_ms: String,
}

impl<'a> CompleteArgs<'a> {
    fn new(response: &'a StoredResponse, expires_at: Timestamp) -> Self {
        Self {
            response,
            status: response.status.to_string(),
            headers: response.headers_json(),
            eat: encode_ts(expires_at),
            eat_ms: expiry_millis(expires_at).to_string(),
        }
    }

    fn args(&self) -> [&[u8]; 6] {
        [
            self.status.as_bytes(),
            self.headers.as_bytes(),
            self.response.body.stored_bytes(),
            self.response.body.encoding().as_str().as_bytes(),
            self.eat.as_bytes(),
            self.eat_ms.as_bytes(),
        ]
    }
}

/// The store's script calls as data, for running its own scripts outside it: the benchmark's
/// floor sends them with `redis-benchmark`.
#[cfg(feature = "testing")]
impl RedisStore {
    /// The call [`Store::claim`] sends for `req` when the record it would insert is `fresh`.
    pub fn claim_call(&self, req: &ClaimRequest, fresh: &Record) -> crate::testing::ScriptCall {
        let args = ClaimArgs::new(req, fresh);
        crate::testing::ScriptCall::new(&self.scripts.claim, self.key_of(&req.scope), &args.args())
    }

    /// The call [`Store::complete`] sends for `claim`.
    pub fn complete_call(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> crate::testing::ScriptCall {
        let (fence, rest) = (Fence::new(claim), CompleteArgs::new(response, expires_at));
        let args: Vec<&[u8]> = fence.args().into_iter().chain(rest.args()).collect();
        crate::testing::ScriptCall::new(&self.scripts.complete, self.key_of(claim.scope()), &args)
    }
}

/// A Redis error as a store error: a value of the wrong type at a record's key, or a record the
/// claim script found damaged, is corruption; everything else means the store is unavailable.
/// How long a write refused with `OOM` keeps the store not ready when no claim succeeds after
/// it: near `maxmemory` a server refuses some writes and takes others, as its buffers come and go.
const OOM_REMEMBERED: Duration = Duration::from_secs(30);

/// A primary that refuses writes for lack of memory.
#[derive(Debug, thiserror::Error)]
#[error("Redis node {node} is out of memory: it refuses writes (maxmemory reached under noeviction)")]
struct OutOfMemory {
    node: String,
}

/// The sorted set that indexes a principal's records for [`Store::count_records`]: each member
/// a record's key, scored by its expiry in epoch milliseconds.
fn principal_index(prefix: &str, principal: &idempotency::Principal) -> String {
    use sha2::Digest;
    format!("{prefix}principal:{}", hex::encode(sha2::Sha256::digest(principal.as_str().as_bytes())))
}

impl RedisStore {
    /// Adds a record just created to its principal's index, and makes the index expire no
    /// earlier than that record (`PEXPIREAT ... NX`, then `GT`: Redis 7.0 or later). Plain
    /// commands, no script: not atomic with the claim (the index is another key, on another slot
    /// of a cluster), so if they fail (an older Redis, a full one) the record is not counted, and
    /// the principal's count is that much lower until the record expires. Logged, never an error
    /// of the claim.
    async fn index_record(&self, scope: &Scope, eat_ms: &str) {
        let index = principal_index(&self.prefix, &scope.principal);
        let mut add = redis::cmd("ZADD");
        add.arg(&index).arg(eat_ms).arg(self.key_of(scope));
        let expire = |condition: &str| redis::cmd("PEXPIREAT").arg(&index).arg(eat_ms).arg(condition).clone();
        for cmd in [add, expire("NX"), expire("GT")] {
            if let Err(e) = self.conn.query(&cmd).await {
                tracing::warn!(error = %e, "cannot index a record under its principal; it is not counted");
                return;
            }
        }
    }
}

pub(crate) fn redis_error(e: RedisError) -> StoreError {
    match e.code() {
        Some("WRONGTYPE" | "CORRUPT") => StoreError::Corrupt(e.to_string()),
        _ => StoreError::unavailable(e),
    }
}

/// The latest `started_at` at which a claim is stale at `now` (`started_at + ttl <= now`),
/// floored to the microsecond, in stored form; empty when no claim can be that old, which
/// compares as never stale in the script.
fn stale_cutoff(now: Timestamp, ttl: Duration) -> String {
    use chrono::SubsecRound;
    chrono::Duration::from_std(ttl)
        .ok()
        .and_then(|ttl| now.checked_sub_signed(ttl))
        .map(|c| encode_ts(c.trunc_subsecs(6)))
        .unwrap_or_default()
}

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
        let mut conn = self.conn.pin(&key);
        match self.eval_on(&mut conn, &self.scripts.claim, &key, &args.args()).await? {
            Value::Int(1) => {}
            reply => match record_reply(reply)? {
                Some(record) if is_own(&record, &fresh) => {}
                Some(record) => return Ok(ClaimOutcome::Existing(of_scope(record, &req.scope))),
                None => {
                    return Err(StoreError::Corrupt("the claim script returned neither ownership nor a record".into()));
                }
            },
        }
        let claim = Claim::new(fresh);
        if let Err(e) = self.acknowledged(&mut conn, "claim").await {
            if let Err(undo) = self.fenced_then("remove", &self.scripts.remove, &claim, &[], false).await {
                tracing::warn!(error = %idempotency::ErrorChain(&undo),
                    "an unacknowledged claim could not be removed; it holds its key until its claim goes stale");
            }
            return Err(e);
        }
        *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.index_record(&req.scope, &eat_ms).await;
        Ok(ClaimOutcome::Owned(claim))
    }
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

    async fn reclaim(
        &self,
        record: &Record,
        now: Timestamp,
        in_flight_ttl: Duration,
        expires_at: Timestamp,
    ) -> Result<Option<Claim>, StoreError> {
        let next = record
            .generation
            .checked_add(1)
            .ok_or_else(|| StoreError::Corrupt(format!("generation {} cannot grow", record.generation)))?;
        let (rid, generation, next) = (record.record_id.to_hex(), record.generation.to_string(), next.to_string());
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
        let key = self.key_of(&record.scope);
        let mut conn = self.conn.pin(&key);
        let reply = self.eval_on(&mut conn, &self.scripts.reclaim, &key, &args).await?;
        let Some(claim) = record_reply(reply)?.map(|r| Claim::new(of_scope(r, &record.scope))) else {
            return Ok(None);
        };
        if let Err(e) = self.acknowledged(&mut conn, "reclaim").await {
            // Not taken: marked failed under the new generation, so the next retry reclaims it
            // at once rather than after the in-flight TTL.
            if let Err(undo) = self.fenced_then("fail", &self.scripts.fail, &claim, &[], false).await {
                tracing::warn!(error = %idempotency::ErrorChain(&undo),
                    "an unacknowledged reclaim could not be undone; it holds its key until its claim goes stale");
            }
            return Err(e);
        }
        Ok(Some(claim))
    }

    async fn heartbeat(&self, claim: &Claim, now: Timestamp) -> Result<(), StoreError> {
        self.fenced("heartbeat", &self.scripts.heartbeat, claim, &[encode_ts(now).as_bytes()]).await
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced("remove", &self.scripts.remove, claim, &[]).await
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let args = CompleteArgs::new(response, expires_at);
        self.fenced("complete", &self.scripts.complete, claim, &args.args()).await?;
        self.announce(claim).await;
        Ok(())
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced("fail", &self.scripts.fail, claim, &[]).await?;
        self.announce(claim).await;
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

    /// `PING`; on a cluster every primary that serves slots must answer on its own
    /// connection, so a cluster with an unreachable primary is reported unavailable.
    /// Every primary answers `PING`, and none refuses writes for lack of memory: none is over
    /// its `maxmemory` (`INFO memory`, where allowed), and no write was refused with `OOM` since
    /// the last claim that succeeded (within [`OOM_REMEMBERED`]). A full server still answers
    /// reads, but is not ready for requests that create records.
    async fn ping(&self) -> Result<(), StoreError> {
        let refused = *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner());
        if refused.is_some_and(|at| at.elapsed() < OOM_REMEMBERED) {
            return Err(StoreError::unavailable(OutOfMemory { node: "a primary".to_owned() }));
        }
        for (_, reply) in self.conn.on_every_primary(&redis::cmd("PING")).await.map_err(redis_error)? {
            reply.map_err(redis_error)?;
        }
        let info = redis::cmd("INFO").arg("memory").clone();
        for (node, reply) in self.conn.on_every_primary(&info).await.map_err(redis_error)? {
            if reply.is_ok_and(|v| crate::conn::info_out_of_memory(&v)) {
                return Err(StoreError::unavailable(OutOfMemory { node }));
            }
        }
        Ok(())
    }

    async fn count_records(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let index = principal_index(&self.prefix, principal);
        let now_ms = expiry_millis(now).to_string();
        let mut trim = redis::cmd("ZREMRANGEBYSCORE");
        trim.arg(&index).arg("-inf").arg(&now_ms);
        self.conn.query(&trim).await.map_err(redis_error)?;
        let mut count = redis::cmd("ZCARD");
        count.arg(&index);
        match self.conn.query(&count).await.map_err(redis_error)? {
            Value::Int(n) => Ok(Some(u64::try_from(n).unwrap_or(0))),
            other => Err(StoreError::Corrupt(format!("unexpected ZCARD reply {other:?}"))),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_cutoff_is_empty_when_no_claim_can_be_that_old() {
        let now = idempotency::now();
        assert_eq!(stale_cutoff(now, Duration::from_secs(300)), encode_ts(now - chrono::Duration::seconds(300)));
        assert_eq!(stale_cutoff(now, Duration::MAX), "");
    }
}
