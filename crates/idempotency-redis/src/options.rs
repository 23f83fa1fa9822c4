//! The store's settings and why connecting can fail.

use std::time::Duration;

use idempotency::StoreError;
use redis::RedisError;

/// The key prefix used unless [`RedisStoreOptions::prefix`] says otherwise.
pub const DEFAULT_PREFIX: &str = "idempotency:";

/// The URL scheme for a Redis Cluster: `redis+cluster://HOST:PORT[,HOST:PORT]...`.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

/// How long a transition waits for its replicas unless [`RedisStoreOptions::replica_timeout`]
/// says otherwise.
pub const DEFAULT_REPLICA_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a cluster connection may answer nothing while it is called before it is replaced,
/// unless [`RedisStoreOptions::cluster_reconnect_after`] says otherwise.
pub const DEFAULT_CLUSTER_RECONNECT_AFTER: Duration = Duration::from_secs(15);

/// The multiplexed connections to a single server unless [`RedisStoreOptions::connections`]
/// says otherwise. With one, a replay's reply (the whole record) is parsed in the connection's
/// one task, which capped replays at about half of what `redis-benchmark` gets from the same
/// server on 2 cores (`bench/run redis`); two reached it, four did no better.
pub const DEFAULT_CONNECTIONS: usize = 2;

/// What [`RedisStore::connect`](crate::RedisStore::connect) does when it cannot read a node's `maxmemory-policy`: both
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

/// Settings for [`RedisStore::connect`](crate::RedisStore::connect).
#[derive(Debug, Clone)]
pub struct RedisStoreOptions {
    pub(crate) prefix: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) cluster_retries: u32,
    pub(crate) cluster_reconnect_after: Duration,
    pub(crate) connections: usize,
    pub(crate) unverified_policy: UnverifiedPolicy,
    pub(crate) replicas: u32,
    pub(crate) replica_timeout: Duration,
    pub(crate) root_certificates: Option<Vec<u8>>,
}

impl Default for RedisStoreOptions {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            cluster_retries: 3,
            cluster_reconnect_after: DEFAULT_CLUSTER_RECONNECT_AFTER,
            connections: DEFAULT_CONNECTIONS,
            unverified_policy: UnverifiedPolicy::Refuse,
            replicas: 0,
            replica_timeout: DEFAULT_REPLICA_TIMEOUT,
            root_certificates: None,
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

    /// For `rediss://` (TLS): trust only the CA certificates in `pem` (PEM text), for a server
    /// whose certificate a private CA issued. Default: the system's roots.
    pub fn root_certificates_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_certificates = Some(pem.into());
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

    /// On a cluster: how long the cluster connection may leave every call unanswered (timed
    /// out, dropped by the caller, or its node connection lost) before the store drops it and
    /// opens a new one from the URL's nodes, as a restart would (default
    /// [`DEFAULT_CLUSTER_RECONNECT_AFTER`]). The client repairs itself after a failover within
    /// seconds; this is for the client that does not (see the crate docs, Failover).
    pub fn cluster_reconnect_after(mut self, after: Duration) -> Self {
        self.cluster_reconnect_after = after;
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

    /// After each transition that writes, wait until this many replicas of the record's primary
    /// have it (`WAIT N T`, or `WAITAOF 1 N T` on Redis 7.2 and later when the primary runs
    /// with `appendonly yes`), for at most [`RedisStoreOptions::replica_timeout`]. Default 0: no
    /// wait, as Redis does by itself. A write that fewer replicas acknowledge in time fails as
    /// [`StoreError::Unavailable`] caused by [`idempotency::NotAcknowledged`]; see the crate
    /// docs (Replica acknowledgement) for what each transition then does.
    pub fn replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// How long a transition waits for [`RedisStoreOptions::replicas`] replicas (default
    /// [`DEFAULT_REPLICA_TIMEOUT`], at least 1 ms: `WAIT` with 0 would wait forever). The reply
    /// timeout is raised to at least this plus a second, so the wait is never cut short by it.
    pub fn replica_timeout(mut self, timeout: Duration) -> Self {
        self.replica_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long a reply may take: [`RedisStoreOptions::response_timeout`], raised to the replica
    /// timeout plus a second when the store waits for replicas.
    pub(crate) fn effective_response_timeout(&self) -> Duration {
        if self.replicas == 0 {
            self.response_timeout
        } else {
            self.response_timeout.max(self.replica_timeout + Duration::from_secs(1))
        }
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }
}

/// Why [`RedisStore::connect`](crate::RedisStore::connect) refused.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_server_gets_at_least_one_connection() {
        assert_eq!(RedisStoreOptions::default().connections, DEFAULT_CONNECTIONS);
        assert_eq!(RedisStoreOptions::default().connections(0).connections, 1);
        assert_eq!(RedisStoreOptions::default().connections(4).connections, 4);
    }

    #[test]
    fn the_reply_timeout_outlasts_the_replica_wait() {
        let o = RedisStoreOptions::default();
        assert_eq!((o.replicas, o.replica_timeout), (0, DEFAULT_REPLICA_TIMEOUT));
        assert_eq!(o.effective_response_timeout(), Duration::from_secs(5));
        let o = o.replicas(1).replica_timeout(Duration::from_secs(9));
        assert_eq!(o.effective_response_timeout(), Duration::from_secs(10));
        assert_eq!(o.replica_timeout(Duration::ZERO).replica_timeout, Duration::from_millis(1));
    }
}
