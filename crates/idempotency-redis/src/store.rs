//! The store: its transitions as Lua scripts on one key each.

mod ack;
mod args;
mod errors;
mod index;
mod transitions;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use idempotency::{Claim, Record, RecordState, Scope, StoreError};
use redis::{ErrorKind, ServerErrorKind, Value};

use self::ack::Ack;
use self::args::Fence;
pub(crate) use self::errors::redis_error;
pub(crate) use self::transitions::record_reply;
use crate::codec::record_key;
use crate::conn::Conn;
use crate::options::{ConnectError, RedisStoreOptions};
use crate::policy::Policy;
use crate::scripts::{Lua, Scripts};

/// An [`idempotency::Store`] in Redis: one server, or a Redis Cluster. See the crate docs for
/// the data layout and which Redis settings each guarantee needs.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    /// Reads, the per-principal index and count, announcements, `ping` and the admin scans.
    pub(crate) conn: Conn,
    /// The transitions, when they wait for replicas: `WAIT` blocks the connection that sends it
    /// until the replicas answer or the timeout passes, so a shard whose replica does not
    /// answer must hold up nothing but its own transitions. `None`: they share `conn`.
    writes: Option<Conn>,
    policy: Arc<Policy>,
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
        let lost = Arc::new(AtomicBool::new(false));
        let conn = Conn::open(url, &options, lost.clone()).await?;
        let subscribers = Arc::new(Conn::subscribers(url, &options)?);
        conn.check_eviction_policy(options.unverified_policy).await?;
        let ack = Ack::for_options(&conn, &options).await?;
        let writes = match ack {
            Some(_) => Some(Conn::open(url, &options, lost.clone()).await?),
            None => None,
        };
        Ok(Self {
            conn,
            writes,
            policy: Arc::new(Policy::new(options.unverified_policy, lost)),
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
        [Some(&self.conn), self.writes.as_ref()]
            .into_iter()
            .flatten()
            .map(|c| match c {
                Conn::Server(_) => 0,
                Conn::Cluster(c) => c.reconnects(),
            })
            .sum()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds `scope`'s record: the prefix and a SHA-256 of the scope.
    pub fn key_of(&self, scope: &Scope) -> String {
        record_key(&self.prefix, scope)
    }

    /// [`Self::run`] without a wait, for the admin routes.
    pub(crate) async fn eval(&self, lua: &Lua, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
        Ok(self.run(lua, key, None, args, false).await?.reply)
    }

    /// The principal's index for a script that can write it itself (`claim`, `complete`: see
    /// [`crate::scripts`]): on a single server, where it is on the record's server; `None` on a
    /// cluster, where it is written after the transition ([`Self::index_record`]).
    pub(crate) fn inline_index(&self, scope: &Scope) -> Option<String> {
        self.indexes_inline().then(|| index::principal_index(&self.prefix, &scope.principal))
    }

    /// Whether `claim` and `complete` index their record themselves: on a single server.
    pub(crate) fn indexes_inline(&self) -> bool {
        matches!(self.conn, Conn::Server(_))
    }

    /// Runs one script on one key (and the principal's index `index`, for a script that takes it
    /// as `KEYS[2]`), and when `wait` says so and the store waits for replicas
    /// ([`RedisStoreOptions::replicas`]) the `WAIT` after it: both as one pipeline over one
    /// connection to the key's primary, since `WAIT` counts the writes of its own connection.
    ///
    /// The script goes by digest (`EVALSHA`); when the server answers `NOSCRIPT` (it restarted,
    /// failed over, or ran `SCRIPT FLUSH`) the pipeline goes again with `EVAL` and the source,
    /// which also caches it again. Not `redis::Script::invoke_async`'s fallback: that sends
    /// `SCRIPT LOAD` to every node of a cluster, so one unreachable primary would fail a call for
    /// a key on a healthy one, and it costs two more round trips instead of one.
    ///
    /// Before it, the eviction policy is read again if a connection was lost since it was last
    /// read ([`crate::policy`]).
    async fn run(
        &self,
        lua: &Lua,
        key: &str,
        index: Option<&str>,
        args: &[&[u8]],
        wait: bool,
    ) -> Result<Sent, StoreError> {
        self.policy.verified(&self.conn).await?;
        let wait = self.ack.as_ref().filter(|_| wait).map(Ack::command);
        let build = |verb: &str, script: &str| {
            let mut pipe = redis::pipe();
            pipe.cmd(verb).arg(script);
            match index {
                Some(index) => pipe.arg(2).arg(key).arg(index),
                None => pipe.arg(1).arg(key),
            };
            for a in args {
                pipe.arg(*a);
            }
            if let Some(wait) = &wait {
                pipe.add_command(wait.clone());
            }
            pipe
        };
        let conn = self.writes.as_ref().unwrap_or(&self.conn);
        let mut replies = conn.on_primary_of(key, &build("EVALSHA", lua.script.get_hash())).await;
        if replies.as_ref().is_ok_and(|r| r.first().is_some_and(is_noscript)) {
            replies = conn.on_primary_of(key, &build("EVAL", lua.code)).await;
        }
        let mut replies = replies.map_err(redis_error)?.into_iter();
        let reply = replies.next().map_or_else(|| Err(no_reply("the script")), Value::extract_error);
        if let Err(e) = &reply
            && e.code() == Some("OOM")
        {
            *self.refused_for_memory.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        }
        Ok(Sent { reply: reply.map_err(redis_error)?, ack: wait.and_then(|_| replies.next()) })
    }

    /// Runs a fenced script (`complete`, `fail`, `heartbeat`, `remove`) for `claim`, then, when
    /// `wait`, waits for the replicas ([`RedisStoreOptions::replicas`]). `leaves`: how the script
    /// leaves the record, by which a run sent again after its reply was lost (the cluster client
    /// does that after an I/O error; the layer retries a completion) is known for this claim's
    /// own, not a newer attempt's or another call's.
    async fn fenced(
        &self,
        what: &'static str,
        lua: &Lua,
        claim: &Claim,
        extra: &[&[u8]],
        leaves: Option<Leaves<'_>>,
        wait: bool,
    ) -> Result<(), StoreError> {
        let r = claim.record();
        let fence = Fence::new(claim);
        let mut args: Vec<&[u8]> = fence.args().to_vec();
        args.extend_from_slice(extra);
        let key = self.key_of(&r.scope);
        // A completion on a single server indexes its record in its own script.
        let index = std::ptr::eq(lua, &self.scripts.complete).then(|| self.inline_index(&r.scope)).flatten();
        let ack = match self.run(lua, &key, index.as_deref(), &args, wait).await? {
            Sent { reply: Value::Int(1), ack } => ack,
            Sent { reply: Value::Int(0), ack } => match leaves {
                Some(leaves) => match self.again(&key, r, leaves, ack.filter(|_| wait)).await? {
                    Some(ack) => ack,
                    None => return Err(StoreError::Fenced { generation: r.generation }),
                },
                None => return Err(StoreError::Fenced { generation: r.generation }),
            },
            Sent { reply, .. } => return Err(StoreError::Corrupt(format!("unexpected script reply {reply:?}"))),
        };
        if wait { self.acknowledged(what, ack) } else { Ok(()) }
    }

    /// For a write whose script ran again and found the record at `key` as this call's first run
    /// left it (`record`, as `leaves` says), and so wrote nothing: the reply of a `WAIT` that
    /// counts the replicas that have it. That is `ack`, the reply of the `WAIT` sent with the
    /// script (`None`: none was), when it found too few replicas (a `WAIT` over a connection
    /// that wrote nothing counts at least as many as one that did) or none was sent; otherwise
    /// that of a `WAIT` after a write of the record ([`Self::touch`]). `None` when the record is
    /// not as this call left it.
    async fn again(
        &self,
        key: &str,
        record: &Record,
        leaves: Leaves<'_>,
        ack: Option<Value>,
    ) -> Result<Option<Option<Value>>, StoreError> {
        let settled = ack.is_none() || self.too_few(ack.as_ref());
        Ok(self.touch(key, record, leaves, !settled).await?.map(|again| if settled { ack } else { again }))
    }

    /// When the record at `key` is `record` (its record id and generation) as `leaves` says, as
    /// this call left it: writes it again ([`crate::scripts::TOUCH`]), with the `WAIT` after it
    /// when `wait`, and returns that `WAIT`'s reply. `None` when the record is not so.
    async fn touch(
        &self,
        key: &str,
        record: &Record,
        leaves: Leaves<'_>,
        wait: bool,
    ) -> Result<Option<Option<Value>>, StoreError> {
        let fence = Fence::of(record);
        let [rid, generation] = fence.args();
        let mut args = vec![rid, generation, leaves.state.as_str().as_bytes()];
        for (field, value) in leaves.fields {
            args.extend([field.as_bytes(), *value]);
        }
        match self.run(&self.scripts.touch, key, None, &args, wait).await? {
            Sent { reply: Value::Int(1), ack } => Ok(Some(ack)),
            Sent { reply: Value::Int(0), .. } => Ok(None),
            Sent { reply, .. } => Err(StoreError::Corrupt(format!("unexpected script reply {reply:?}"))),
        }
    }

    /// Announces that `claim`'s record left `in_flight` (see [`crate::changes_channel`]), in a
    /// task of its own: the channel's node may be another shard, one that does not answer.
    fn announce(&self, claim: &Claim) {
        self.announce_change(&claim.record().scope);
    }

    /// [`Self::announce`] for the record of `scope`.
    pub(crate) fn announce_change(&self, scope: &Scope) {
        let tag = idempotency::change_tag(scope);
        let (conn, channel) = (self.conn.clone(), crate::changes::channel(&self.prefix));
        tokio::spawn(async move { crate::changes::announce(&conn, &channel, &tag).await });
    }
}

/// How a transition leaves its record: its state, and fields with the values it wrote.
#[derive(Debug, Clone, Copy)]
struct Leaves<'a> {
    state: RecordState,
    fields: &'a [(&'static str, &'a [u8])],
}

/// A script's reply and, when it was sent with one, the reply of the `WAIT` after it.
struct Sent {
    reply: Value,
    ack: Option<Value>,
}

fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(_))
        && matches!(v.clone().extract_error(), Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript))
}

fn no_reply(of: &str) -> redis::RedisError {
    redis::RedisError::from((ErrorKind::UnexpectedReturnType, "a pipeline reply is missing", of.to_owned()))
}
