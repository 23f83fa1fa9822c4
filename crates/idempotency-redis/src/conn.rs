//! Connecting to one server or a cluster, and sending commands: to the primary of a key (a
//! transition and its `WAIT` as one pipeline), to a node, or to every primary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike as _, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, Value};

use crate::cluster::Cluster;
use crate::options::{CLUSTER_SCHEME, ConnectError, RedisStoreOptions};
use crate::reply::is_connection_error;

/// One server (reconnecting connection managers, taken in turn) or a cluster (the cluster
/// client, which follows slot moves, replaced when it stops answering). Both multiplex their
/// callers over their connections.
#[derive(Clone)]
pub(crate) enum Conn {
    Server(Arc<Managers>),
    Cluster(Arc<Cluster>),
}

/// A single server's connections, never empty, and the turn.
pub(crate) struct Managers {
    all: Vec<ConnectionManager>,
    next: AtomicUsize,
    /// Set when a call lost its connection: its manager then makes a new one.
    lost: Arc<AtomicBool>,
}

impl Managers {
    fn pick(&self) -> ConnectionManager {
        self.all[self.next.fetch_add(1, Ordering::Relaxed) % self.all.len()].clone()
    }

    /// Notes a reply: a lost connection sets [`Managers::lost`].
    fn seen<T>(&self, reply: Result<T, RedisError>) -> Result<T, RedisError> {
        if let Err(e) = &reply
            && is_connection_error(e)
        {
            self.lost.store(true, Ordering::Relaxed);
        }
        reply
    }
}

impl Conn {
    /// Connects to one server (`redis://`) or a cluster ([`CLUSTER_SCHEME`]) as `options` say;
    /// `lost` is set whenever a call loses its connection or the cluster connection is replaced.
    pub(crate) async fn open(
        url: &str,
        options: &RedisStoreOptions,
        lost: Arc<AtomicBool>,
    ) -> Result<Self, ConnectError> {
        Ok(if let Some(rest) = url.strip_prefix(CLUSTER_SCHEME) {
            let nodes = cluster_nodes(rest)?;
            let mut builder = ClusterClient::builder(nodes);
            if let Some(pem) = &options.root_certificates {
                builder = builder.certs(tls_certificates(pem));
            }
            let client = builder
                .connection_timeout(options.connect_timeout)
                .response_timeout(options.effective_response_timeout())
                .retries(options.cluster_retries)
                .min_retry_wait(10)
                .max_retry_wait(500)
                .build()
                .map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
            let cluster =
                Cluster::connect(client, options.cluster_reconnect_after, options.connect_timeout, lost).await;
            Conn::Cluster(cluster.map_err(ConnectError::Unreachable)?)
        } else {
            let client = match &options.root_certificates {
                Some(pem) => redis::Client::build_with_tls(url, tls_certificates(pem)),
                None => redis::Client::open(url),
            }
            .map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(options.connect_timeout))
                .set_response_timeout(Some(options.effective_response_timeout()))
                .set_number_of_retries(2);
            let mut all = Vec::with_capacity(options.connections);
            for _ in 0..options.connections.max(1) {
                let manager = client.get_connection_manager_with_config(config.clone()).await;
                all.push(manager.map_err(ConnectError::Unreachable)?);
            }
            Conn::Server(Arc::new(Managers { all, next: AtomicUsize::new(0), lost }))
        })
    }

    /// Clients for a subscription (pub/sub needs a connection of its own): the server, or each
    /// node the cluster URL names.
    pub(crate) fn subscribers(url: &str, options: &RedisStoreOptions) -> Result<Vec<redis::Client>, ConnectError> {
        let urls = match url.strip_prefix(CLUSTER_SCHEME) {
            Some(rest) => cluster_nodes(rest)?,
            None => vec![url.to_owned()],
        };
        urls.iter()
            .map(|u| match &options.root_certificates {
                Some(pem) => redis::Client::build_with_tls(u.as_str(), tls_certificates(pem)),
                None => redis::Client::open(u.as_str()),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ConnectError::InvalidUrl(e.to_string()))
    }

    /// Sends `pipe` to the primary of `key`, all of it over one connection, and returns each
    /// command's reply (an error reply as [`Value::ServerError`]): a transition's script and the
    /// `WAIT` after it, which counts the writes of the connection that sends it. On a cluster,
    /// a retry after a lost connection or a redirection sends the whole pipeline again, together.
    pub(crate) async fn on_primary_of(&self, key: &str, pipe: &Pipeline) -> Result<Vec<Value>, RedisError> {
        match self {
            Conn::Server(c) => c.seen(c.pick().req_packed_commands(pipe, 0, pipe.len()).await),
            Conn::Cluster(c) => c.pipeline(pipe, Route::with_key(key.as_bytes(), SlotAddr::Master)).await,
        }
    }

    pub(crate) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        match self {
            Conn::Server(c) => c.seen(cmd.query_async(&mut c.pick()).await),
            Conn::Cluster(c) => c.query(cmd).await,
        }
    }

    /// Runs `cmd` on every primary, each on its own connection, all at once, each bounded by
    /// `each` when given; each node's reply or error. `Err` only when the server, or every node
    /// of a cluster, is unreachable.
    ///
    /// On a cluster the primaries are those that serve slots in `CLUSTER SLOTS` (asked of a
    /// primary: a replica that does not answer must not hold it up), each asked by address: the
    /// client's own fan-out silently skips a node it has no connection to, and a command routed
    /// by slot falls back to another node when the slot's node has none.
    pub(crate) async fn on_every_primary(
        &self,
        cmd: &Cmd,
        each: Option<Duration>,
    ) -> Result<Vec<(String, Result<Value, RedisError>)>, RedisError> {
        match self {
            Conn::Server(c) => {
                let ask = || bounded(each, async { c.seen(cmd.query_async::<Value>(&mut c.pick()).await) });
                let mut reply = ask().await;
                // A manager whose connection was lost makes a new one after the error: ask again,
                // each manager once, so that a lost connection is not taken for a server down.
                for _ in 0..c.all.len() {
                    match &reply {
                        Err(e) if is_connection_error(e) && !e.is_timeout() => reply = ask().await,
                        _ => break,
                    }
                }
                match reply {
                    Err(e) if is_connection_error(&e) => Err(e),
                    reply => Ok(vec![("server".to_owned(), reply)]),
                }
            }
            Conn::Cluster(c) => {
                let slots = c.route(&redis::cmd("CLUSTER").arg("SLOTS").clone(), random_primary()).await?;
                let asked = primaries(slots)?.into_iter().map(|(host, port)| async move {
                    let node = format!("{host}:{port}");
                    let by_address = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                    (node, bounded(each, c.route(cmd, by_address)).await)
                });
                Ok(futures::future::join_all(asked).await)
            }
        }
    }
}

/// `call`'s reply, or a timeout error after `each` when given.
async fn bounded(
    each: Option<Duration>,
    call: impl Future<Output = Result<Value, RedisError>>,
) -> Result<Value, RedisError> {
    match each {
        None => call.await,
        Some(limit) => tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
            Err(RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "the node did not answer in time")))
        }),
    }
}

fn random_primary() -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary)
}

/// A node to send a command to: the one server, or a cluster primary by address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Node {
    Server,
    Primary(String, u16),
}

impl Conn {
    /// The nodes that hold records, in a stable order: the server, or the cluster's primaries
    /// sorted by address.
    pub(crate) async fn nodes(&self) -> Result<Vec<Node>, RedisError> {
        match self {
            Conn::Server(_) => Ok(vec![Node::Server]),
            Conn::Cluster(c) => {
                let slots = c.route(&redis::cmd("CLUSTER").arg("SLOTS").clone(), random_primary()).await?;
                let mut all = primaries(slots)?;
                all.sort();
                Ok(all.into_iter().map(|(h, p)| Node::Primary(h, p)).collect())
            }
        }
    }

    /// Runs `cmd` on `node` (a command such as `SCAN` that names no key).
    pub(crate) async fn query_on(&self, node: &Node, cmd: &Cmd) -> Result<Value, RedisError> {
        match (self, node) {
            (Conn::Cluster(c), Node::Primary(host, port)) => {
                let by_address =
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port });
                c.route(cmd, by_address).await
            }
            _ => self.query(cmd).await,
        }
    }
}

/// A private CA's certificates (PEM) as the only roots trusted for `rediss://`.
fn tls_certificates(pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates { client_tls: None, root_cert: Some(pem.to_vec()) }
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

impl Conn {
    /// Whether every primary has `WAITAOF` (Redis 7.2 or later) and runs with `appendonly yes`,
    /// read from `INFO`: then a write can wait for the append-only files too. Where `INFO` does
    /// not say, `WAIT` it is.
    pub(crate) async fn every_primary_has_waitaof(&self) -> Result<bool, RedisError> {
        let replies = self.on_every_primary(redis::cmd("INFO").arg("server").arg("persistence"), None).await?;
        Ok(!replies.is_empty()
            && replies.into_iter().all(|(_, reply)| reply.ok().and_then(info_text).is_some_and(|t| has_waitaof(&t))))
    }
}

pub(crate) fn info_text(v: Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

/// From an `INFO server persistence` text: version 7.2 or later and `aof_enabled:1`.
fn has_waitaof(info: &str) -> bool {
    let field = |name: &str| info.lines().find_map(|l| l.trim().strip_prefix(name).map(str::trim));
    let version: Vec<u32> = field("redis_version:").unwrap_or("").split('.').map(|p| p.parse().unwrap_or(0)).collect();
    let at_least_7_2 = match version.as_slice() {
        [major, minor, ..] => (*major, *minor) >= (7, 2),
        [major] => *major > 7,
        [] => false,
    };
    at_least_7_2 && field("aof_enabled:") == Some("1")
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

/// Whether an `INFO memory` reply says the server refuses writes for lack of memory: with
/// `maxmemory` set, Redis refuses a write (`OOM`, under `noeviction`) when `used_memory` less
/// the buffers it does not count (`mem_not_counted_for_evict`) exceeds it. `false` when the
/// reply lacks the fields.
pub(crate) fn info_out_of_memory(v: &Value) -> bool {
    let text = match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::VerbatimString { text, .. } => text.clone(),
        _ => return false,
    };
    let field = |name: &str| -> Option<u64> {
        text.lines().find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
    };
    match (field("maxmemory"), field("used_memory")) {
        (Some(max), Some(used)) if max > 0 => {
            used.saturating_sub(field("mem_not_counted_for_evict").unwrap_or(0)) > max
        }
        _ => false,
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
    fn waitaof_needs_redis_7_2_and_an_append_only_file() {
        assert!(has_waitaof("# Server\r\nredis_version:7.2.4\r\n# Persistence\r\naof_enabled:1\r\n"));
        assert!(has_waitaof("redis_version:8.0.0\naof_enabled:1"));
        assert!(!has_waitaof("redis_version:7.2.4\naof_enabled:0"));
        assert!(!has_waitaof("redis_version:7.0.15\naof_enabled:1"));
        assert!(!has_waitaof("aof_enabled:1"));
    }
}
