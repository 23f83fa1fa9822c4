//! The store: connecting, the eviction-policy check, and the transitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{Claim, ClaimOutcome, ClaimRequest, Record, Scope, Store, StoreError, StoredResponse, Timestamp};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use crate::codec::{decode_record, encode_ts, expiry_millis, hash_fields, record_key};
use crate::scripts::{Lua, Scripts};

/// The key prefix used unless [`RedisStoreOptions::prefix`] says otherwise.
pub const DEFAULT_PREFIX: &str = "idempotency:";

/// The URL scheme for a Redis Cluster: `redis+cluster://HOST:PORT[,HOST:PORT]...`.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

/// The multiplexed connections to a single server unless [`RedisStoreOptions::connections`]
/// says otherwise. With one, a replay's reply (the whole record) is parsed in the connection's
/// one task, which capped replays at about half of what `redis-benchmark` gets from the same
/// server on 2 cores (`bench/run redis`); two reached it, four did no better.
pub const DEFAULT_CONNECTIONS: usize = 2;

/// What [`RedisStore::connect`] does when it cannot read a node's `maxmemory-policy`: both
/// `CONFIG GET` and `INFO` refused (as some managed services and ACLs do), or a primary of a
/// cluster unreachable while the others answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UnverifiedPolicy {
    /// Refuse to connect: an evicting policy cannot be ruled out. The default.
    #[default]
    Refuse,
    /// Connect, and log a warning naming the node. For a service whose operator has checked the
    /// policy by other means.
    Warn,
}

/// Settings for [`RedisStore::connect`].
#[derive(Debug, Clone)]
pub struct RedisStoreOptions {
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    cluster_retries: u32,
    connections: usize,
    unverified_policy: UnverifiedPolicy,
}

impl Default for RedisStoreOptions {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            cluster_retries: 3,
            connections: DEFAULT_CONNECTIONS,
            unverified_policy: UnverifiedPolicy::Refuse,
        }
    }
}

impl RedisStoreOptions {
    /// Prefixes every record's key (default [`DEFAULT_PREFIX`]), so several services, or tests,
    /// can share one server. It must not contain `{` or `}`: a hash tag in it would put every
    /// record in one cluster slot, on one primary.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long to wait for a connection to open (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long to wait for a reply before the operation fails as unavailable (default 5 s).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How often the cluster client retries a command after a connection error or a
    /// redirection (default 3; `MOVED` and `ASK` during a resharding need a few).
    pub fn cluster_retries(mut self, retries: u32) -> Self {
        self.cluster_retries = retries;
        self
    }

    /// How many multiplexed connections to a single server the store spreads its calls over
    /// (default [`DEFAULT_CONNECTIONS`]; at least 1). Each connection reads and parses its
    /// replies in one task, so one connection caps the replays a process can receive; a
    /// cluster has one connection per primary already and ignores this.
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// What to do when a node's `maxmemory-policy` cannot be read (default: refuse).
    pub fn on_unverified_policy(mut self, what: UnverifiedPolicy) -> Self {
        self.unverified_policy = what;
        self
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }
}

/// Why [`RedisStore::connect`] refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL is not a Redis URL this store understands.
    #[error("invalid Redis URL ({0})")]
    InvalidUrl(String),
    /// The key prefix contains a hash tag brace.
    #[error("invalid key prefix {0:?}: it must not contain '{{' or '}}'")]
    InvalidPrefix(String),
    /// The server or cluster could not be reached, or refused the connection.
    #[error("cannot connect to Redis")]
    Unreachable(#[source] RedisError),
    /// A node may evict keys under memory pressure; an evicted record is a duplicate waiting to
    /// happen, so the store refuses it.
    #[error(
        "Redis node {node} has maxmemory-policy {policy}, which evicts keys under memory pressure: an evicted \
         idempotency record lets a retry run its request twice. Set maxmemory-policy to noeviction"
    )]
    EvictingPolicy {
        /// The node (`host:port`, or `server` for a single server).
        node: String,
        /// Its policy, as Redis names it.
        policy: String,
    },
    /// A node's `maxmemory-policy` could not be read: `CONFIG GET` and `INFO` were both refused,
    /// or a cluster's primary did not answer (see [`UnverifiedPolicy`]).
    #[error(
        "cannot verify that Redis node {node} never evicts keys: CONFIG GET maxmemory-policy failed ({config}) \
         and so did INFO memory ({info}); allow one of them for this user, or connect with \
         UnverifiedPolicy::Warn after checking that the policy is noeviction"
    )]
    UnverifiedPolicy {
        /// The node.
        node: String,
        /// Why `CONFIG GET` failed.
        config: String,
        /// Why `INFO` failed.
        info: String,
    },
}

impl From<ConnectError> for StoreError {
    fn from(e: ConnectError) -> Self {
        StoreError::unavailable(e)
    }
}

/// One server (reconnecting connection managers, taken in turn) or a cluster (the cluster
/// client, which follows slot moves). Both multiplex their callers over their connections.
#[derive(Clone)]
enum Conn {
    Server(Arc<Managers>),
    Cluster(ClusterConnection),
}

/// A single server's connections, never empty, and the turn.
struct Managers {
    all: Vec<ConnectionManager>,
    next: AtomicUsize,
}

impl Managers {
    fn pick(&self) -> ConnectionManager {
        self.all[self.next.fetch_add(1, Ordering::Relaxed) % self.all.len()].clone()
    }
}

impl Conn {
    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Server(c) => cmd.query_async(&mut c.pick()).await,
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Runs `cmd` on every primary, each on its own connection; each node's reply or error.
    /// `Err` only when the server, or every node of a cluster, is unreachable.
    ///
    /// On a cluster the primaries are those that serve slots in `CLUSTER SLOTS`, each asked by
    /// address: the client's own fan-out silently skips a node it has no connection to, and a
    /// command routed by slot falls back to another node when the slot's node has none.
    async fn on_every_primary(&self, cmd: &Cmd) -> Result<Vec<(String, Result<Value, RedisError>)>, RedisError> {
        match self {
            Conn::Server(c) => match cmd.query_async::<Value>(&mut c.pick()).await {
                Err(e) if e.kind() == ErrorKind::Io || e.is_timeout() => Err(e),
                reply => Ok(vec![("server".to_owned(), reply)]),
            },
            Conn::Cluster(c) => {
                let random = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                let slots = c.clone().route_command(redis::cmd("CLUSTER").arg("SLOTS").clone(), random).await?;
                let mut replies = vec![];
                for (host, port) in primaries(slots)? {
                    let node = format!("{host}:{port}");
                    let by_address = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                    replies.push((node, c.clone().route_command(cmd.clone(), by_address).await));
                }
                Ok(replies)
            }
        }
    }
}

/// The address (host, port) of each primary in a `CLUSTER SLOTS` reply, once each.
fn primaries(reply: Value) -> Result<Vec<(String, u16)>, RedisError> {
    let bad = || RedisError::from((ErrorKind::UnexpectedReturnType, "an unexpected CLUSTER SLOTS reply"));
    let Value::Array(ranges) = reply else { return Err(bad()) };
    let mut primaries = vec![];
    for range in ranges {
        let Value::Array(range) = range else { return Err(bad()) };
        let Some(Value::Array(primary)) = range.get(2) else { return Err(bad()) };
        let (Some(Value::BulkString(host)), Some(Value::Int(port))) = (primary.first(), primary.get(1)) else {
            return Err(bad());
        };
        let address = (String::from_utf8_lossy(host).into_owned(), u16::try_from(*port).map_err(|_| bad())?);
        if !primaries.contains(&address) {
            primaries.push(address);
        }
    }
    Ok(primaries)
}

/// An [`idempotency::Store`] in Redis: one server, or a Redis Cluster. See the crate docs for
/// the data layout and which Redis settings each guarantee needs.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
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

/// The nodes of a `redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]...` URL as
/// `redis://` URLs, each with the credentials.
fn cluster_nodes(rest: &str) -> Result<Vec<String>, ConnectError> {
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let hosts = hosts.trim_end_matches('/');
    let nodes: Vec<String> =
        hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("redis://{auth}{h}")).collect();
    if nodes.is_empty() {
        return Err(ConnectError::InvalidUrl("a redis+cluster:// URL names no node".to_owned()));
    }
    Ok(nodes)
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
        let conn = if let Some(rest) = url.strip_prefix(CLUSTER_SCHEME) {
            let nodes = cluster_nodes(rest)?;
            let client = ClusterClient::builder(nodes)
                .connection_timeout(options.connect_timeout)
                .response_timeout(options.response_timeout)
                .retries(options.cluster_retries)
                .min_retry_wait(10)
                .max_retry_wait(500)
                .build()
                .map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
            Conn::Cluster(client.get_async_connection().await.map_err(ConnectError::Unreachable)?)
        } else {
            let client = redis::Client::open(url).map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(options.connect_timeout))
                .set_response_timeout(Some(options.response_timeout))
                .set_number_of_retries(2);
            let mut all = Vec::with_capacity(options.connections);
            for _ in 0..options.connections.max(1) {
                let manager = client.get_connection_manager_with_config(config.clone()).await;
                all.push(manager.map_err(ConnectError::Unreachable)?);
            }
            Conn::Server(Arc::new(Managers { all, next: AtomicUsize::new(0) }))
        };
        let store = Self { conn, prefix: options.prefix.into(), scripts: Arc::new(Scripts::new()) };
        store.check_eviction_policy(options.unverified_policy).await?;
        Ok(store)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds `scope`'s record: the prefix and a SHA-256 of the scope.
    pub fn key_of(&self, scope: &Scope) -> String {
        record_key(&self.prefix, scope)
    }

    async fn check_eviction_policy(&self, unverified: UnverifiedPolicy) -> Result<(), ConnectError> {
        let config = self
            .conn
            .on_every_primary(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"))
            .await
            .map_err(ConnectError::Unreachable)?;
        let mut unread = vec![];
        for (node, reply) in config {
            match reply.map(config_policy) {
                Ok(Some(policy)) => refuse_evicting(node, policy)?,
                Ok(None) => unread.push((node, "no maxmemory-policy in the reply".to_owned())),
                Err(e) => unread.push((node, e.to_string())),
            }
        }
        if unread.is_empty() {
            return Ok(());
        }
        // CONFIG is refused somewhere: INFO memory carries the policy too, and is allowed more
        // often (managed services that rename CONFIG keep INFO).
        let mut info =
            self.conn.on_every_primary(redis::cmd("INFO").arg("memory")).await.map_err(ConnectError::Unreachable)?;
        for (node, config_error) in unread {
            let reply = match info.iter().position(|(n, _)| *n == node) {
                Some(i) => info.swap_remove(i).1.map_err(|e| e.to_string()),
                None => Err("the node did not answer".to_owned()),
            };
            match reply.map(info_policy) {
                Ok(Some(policy)) => {
                    tracing::info!(node, %config_error, "CONFIG GET refused; read maxmemory-policy from INFO");
                    refuse_evicting(node, policy)?
                }
                Ok(None) | Err(_) if unverified == UnverifiedPolicy::Warn => {
                    tracing::warn!(
                        node,
                        %config_error,
                        "cannot read maxmemory-policy (CONFIG GET and INFO refused, or the node is unreachable): \
                         cannot verify that this Redis node never evicts idempotency records"
                    );
                }
                Ok(None) => {
                    return Err(ConnectError::UnverifiedPolicy {
                        node,
                        config: config_error,
                        info: "no maxmemory_policy in the reply".to_owned(),
                    });
                }
                Err(info) => return Err(ConnectError::UnverifiedPolicy { node, config: config_error, info }),
            }
        }
        Ok(())
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
        match self.conn.query(&build("EVALSHA", lua.script.get_hash())).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.conn.query(&build("EVAL", lua.code)).await.map_err(redis_error)
            }
            reply => reply.map_err(redis_error),
        }
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

fn config_policy(v: Value) -> Option<String> {
    let items = match v {
        Value::Array(items) => items,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => return None,
    };
    match items.as_slice() {
        [_, Value::BulkString(p)] => Some(String::from_utf8_lossy(p).into_owned()),
        _ => None,
    }
}

fn info_policy(v: Value) -> Option<String> {
    let text = match v {
        Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        Value::VerbatimString { text, .. } => text,
        _ => return None,
    };
    text.lines().find_map(|l| l.trim().strip_prefix("maxmemory_policy:").map(|p| p.trim().to_owned()))
}

fn refuse_evicting(node: String, policy: String) -> Result<(), ConnectError> {
    if policy == "noeviction" { Ok(()) } else { Err(ConnectError::EvictingPolicy { node, policy }) }
}

/// A Redis error as a store error: a value of the wrong type at a record's key, or a record the
/// claim script found damaged, is corruption; everything else means the store is unavailable.
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
            Value::Int(1) => Ok(ClaimOutcome::Owned(Claim::new(fresh))),
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
    async fn ping(&self) -> Result<(), StoreError> {
        for (_, reply) in self.conn.on_every_primary(&redis::cmd("PING")).await.map_err(redis_error)? {
            reply.map_err(redis_error)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_name_every_node_with_the_credentials() {
        assert_eq!(
            cluster_nodes("10.0.0.1:6379,10.0.0.2:6380/").unwrap(),
            ["redis://10.0.0.1:6379", "redis://10.0.0.2:6380"]
        );
        assert_eq!(cluster_nodes("u:p@a@h1:1, h2:2").unwrap(), ["redis://u:p@a@h1:1", "redis://u:p@a@h2:2"]);
        assert!(matches!(cluster_nodes(" , "), Err(ConnectError::InvalidUrl(_))));
    }

    #[test]
    fn policies_are_read_from_config_and_info_replies() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(
            config_policy(Value::Array(vec![bulk("maxmemory-policy"), bulk("noeviction")])).as_deref(),
            Some("noeviction")
        );
        assert_eq!(config_policy(Value::Array(vec![])), None);
        let info = bulk("# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\n");
        assert_eq!(info_policy(info).as_deref(), Some("allkeys-lru"));
        assert!(refuse_evicting("n".into(), "noeviction".into()).is_ok());
        assert!(matches!(refuse_evicting("n".into(), "volatile-lfu".into()), Err(ConnectError::EvictingPolicy { .. })));
    }

    #[test]
    fn a_single_server_gets_at_least_one_connection() {
        assert_eq!(RedisStoreOptions::default().connections, DEFAULT_CONNECTIONS);
        assert_eq!(RedisStoreOptions::default().connections(0).connections, 1);
        assert_eq!(RedisStoreOptions::default().connections(4).connections, 4);
    }

    #[test]
    fn stale_cutoff_is_empty_when_no_claim_can_be_that_old() {
        let now = idempotency::now();
        assert_eq!(stale_cutoff(now, Duration::from_secs(300)), encode_ts(now - chrono::Duration::seconds(300)));
        assert_eq!(stale_cutoff(now, Duration::MAX), "");
    }
}
