//! The store: its transitions as Lua scripts on one key each.

mod ack;
mod args;
mod errors;
mod index;
mod transitions;

use std::sync::Arc;

use idempotency::{Claim, Scope, StoreError};
use redis::{ErrorKind, ServerErrorKind, Value};

use self::ack::Ack;
use self::args::Fence;
pub(crate) use self::errors::redis_error;
pub(crate) use self::transitions::record_reply;
use crate::codec::record_key;
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
        let ack = Ack::for_options(&conn, &options).await?;
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
}
