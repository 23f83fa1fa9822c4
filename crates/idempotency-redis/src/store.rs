//! The store: its transitions as Lua scripts on one key each.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{Claim, ClaimOutcome, ClaimRequest, Record, Scope, Store, StoreError, StoredResponse, Timestamp};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use crate::codec::{decode_record, encode_ts, expiry_millis, hash_fields, record_key};
use crate::conn::Conn;
use crate::options::{ConnectError, RedisStoreOptions};
use crate::scripts::{Lua, Scripts};

/// An [`idempotency::Store`] in Redis: one server, or a Redis Cluster. See the crate docs for
/// the data layout and which Redis settings each guarantee needs.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    /// When a write was last refused for lack of memory (`OOM`), until a claim succeeds again.
    refused_for_memory: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.conn {
            Conn::Server(_) => "server",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("kind", &kind).field("prefix", &self.prefix).finish()
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
        conn.check_eviction_policy(options.unverified_policy).await?;
        Ok(Self {
            conn,
            prefix: options.prefix.into(),
            scripts: Arc::new(Scripts::new()),
            refused_for_memory: Arc::default(),
        })
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds `scope`'s record: the prefix and a SHA-256 of the scope.
    pub fn key_of(&self, scope: &Scope) -> String {
        record_key(&self.prefix, scope)
    }

    /// Runs one script on one key: `EVALSHA` by digest, and when the server answers `NOSCRIPT`
    /// (it restarted, failed over, or ran `SCRIPT FLUSH`) `EVAL` with the source, which also
    /// caches it again. Not `redis::Script::invoke_async`'s fallback: that sends `SCRIPT LOAD`
    /// to every node of a cluster, so one unreachable primary would fail a call for a key on a
    /// healthy one, and it costs two more round trips instead of one.
    async fn eval(&self, lua: &Lua, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        let build = |verb: &str, script: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(script).arg(1).arg(key);
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        let reply = match self.conn.query(&build("EVALSHA", lua.script.get_hash())).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.conn.query(&build("EVAL", lua.code)).await
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

    /// Runs a fenced script (`complete`, `fail`, `heartbeat`, `remove`) for `claim`.
    async fn fenced(&self, lua: &Lua, claim: &Claim, extra: &[&[u8]]) -> Result<(), StoreError> {
        let r = claim.record();
        let fence = Fence::new(claim);
        let mut args: Vec<&[u8]> = fence.args().to_vec();
        args.extend_from_slice(extra);
        match self.eval(lua, &self.key_of(&r.scope), &args).await? {
            Value::Int(1) => Ok(()),
            Value::Int(0) => Err(StoreError::Fenced { generation: r.generation }),
            other => Err(StoreError::Corrupt(format!("unexpected script reply {other:?}"))),
        }
    }
}

/// The claim script's arguments: record id, fingerprint, now, expires_at, expires_at in epoch
/// milliseconds, principal, endpoint, key (see [`crate::scripts::CLAIM`]).
struct ClaimArgs<'a> {
    req: &'a ClaimRequest,
    fresh: &'a Record,
    rid: String,
    now: String,
    eat: String,
    eat_ms: String,
}

impl<'a> ClaimArgs<'a> {
    /// The arguments that claim `req`'s key as `fresh` when it is free.
    fn new(req: &'a ClaimRequest, fresh: &'a Record) -> Self {
        Self {
            req,
            fresh,
            rid: fresh.record_id.to_hex(),
            now: encode_ts(req.now),
            eat: encode_ts(req.expires_at),
            eat_ms: expiry_millis(req.expires_at).to_string(),
        }
    }

    fn args(&self) -> [&[u8]; 8] {
        let s = &self.req.scope;
        [
            self.rid.as_bytes(),
            self.fresh.fingerprint.as_str().as_bytes(),
            self.now.as_bytes(),
            self.eat.as_bytes(),
            self.eat_ms.as_bytes(),
            s.principal.as_str().as_bytes(),
            s.endpoint.as_str().as_bytes(),
            s.key.as_str().as_bytes(),
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

fn redis_error(e: RedisError) -> StoreError {
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

fn record_reply(v: Value) -> Result<Option<Record>, StoreError> {
    hash_fields(v)?.map(decode_record).transpose()
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let fresh = req.new_record();
        let args = ClaimArgs::new(&req, &fresh);
        match self.eval(&self.scripts.claim, &self.key_of(&req.scope), &args.args()).await? {
            Value::Int(1) => {
                *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.index_record(&req.scope, &args.eat_ms).await;
                Ok(ClaimOutcome::Owned(Claim::new(fresh)))
            }
            reply => match record_reply(reply)? {
                Some(record) => Ok(ClaimOutcome::Existing(record)),
                None => Err(StoreError::Corrupt("the claim script returned neither ownership nor a record".into())),
            },
        }
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
        let reply = self.eval(&self.scripts.reclaim, &self.key_of(&record.scope), &args).await?;
        Ok(record_reply(reply)?.map(Claim::new))
    }

    async fn heartbeat(&self, claim: &Claim, now: Timestamp) -> Result<(), StoreError> {
        self.fenced(&self.scripts.heartbeat, claim, &[encode_ts(now).as_bytes()]).await
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced(&self.scripts.remove, claim, &[]).await
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let args = CompleteArgs::new(response, expires_at);
        self.fenced(&self.scripts.complete, claim, &args.args()).await
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced(&self.scripts.fail, claim, &[]).await
    }

    /// One `HGETALL`: a single command on one key is atomic already, so it needs no script.
    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        let reply = self.conn.query(redis::cmd("HGETALL").arg(self.key_of(scope))).await.map_err(redis_error)?;
        record_reply(reply)
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
