//! The cluster connection, replaced by a fresh one when it stops answering.
//!
//! The async cluster client repairs itself after a failover: it reconnects to a lost node and
//! refreshes its slot map. In a long fault run (docs/faultline/failover-redis-long-2026-12-03.md)
//! one process's client began a slot refresh after the third failover and never answered again:
//! for six minutes every call timed out, while a restarted process's fresh client served the
//! same cluster. A connection that answers nothing for [`RedisStoreOptions::cluster_reconnect_after`]
//! while it is being called is therefore dropped and a new one built from the cluster URL's
//! nodes, as a restart would; calls already on the old connection end with it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisError, Value};

#[cfg(doc)]
use crate::options::RedisStoreOptions;

/// The client, its current connection and how well that connection answers.
pub(crate) struct Cluster {
    client: ClusterClient,
    current: RwLock<ClusterConnection>,
    health: Mutex<Health>,
    /// Whether a call went unanswered since the last answer: an answer (every call, when all is
    /// well) then takes no lock.
    unanswered: AtomicBool,
    connect_timeout: Duration,
    /// Set when a call lost its connection or the connection was replaced: the client then
    /// talks to its nodes over new connections (see [`crate::policy`]).
    lost: Arc<AtomicBool>,
}

impl Cluster {
    pub(crate) async fn connect(
        client: ClusterClient,
        reconnect_after: Duration,
        connect_timeout: Duration,
        lost: Arc<AtomicBool>,
    ) -> Result<Arc<Self>, RedisError> {
        let connection = client.get_async_connection().await?;
        Ok(Arc::new(Self {
            client,
            current: RwLock::new(connection),
            health: Mutex::new(Health::new(reconnect_after)),
            unanswered: AtomicBool::new(false),
            connect_timeout,
            lost,
        }))
    }

    /// The current connection (watch each call made on it with [`Cluster::watch`]).
    fn connection(&self) -> ClusterConnection {
        self.current.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// A watch for one call, to report how it ended ([`Watch::ended`]; dropped: no answer).
    fn watch(self: &Arc<Self>) -> Watch {
        Watch { cluster: Some(self.clone()), started: Instant::now() }
    }

    /// Sends `pipe` to the node that serves `route`, all of it on that node's one connection
    /// (a retry after a lost connection, or a redirection, sends all of it again, together);
    /// each command's reply, an error reply as [`Value::ServerError`].
    pub(crate) async fn pipeline(self: &Arc<Self>, pipe: &Pipeline, route: Route) -> Result<Vec<Value>, RedisError> {
        let (mut connection, watch) = (self.connection(), self.watch());
        let to = SingleNodeRoutingInfo::SpecificNode(route);
        let reply = connection.route_pipeline(pipe.clone(), 0, pipe.len(), to).await;
        watch.ended(&reply);
        reply
    }

    /// Sends `cmd` as `routing` says, on the current connection.
    pub(crate) async fn route(self: &Arc<Self>, cmd: &Cmd, routing: RoutingInfo) -> Result<Value, RedisError> {
        let (mut connection, watch) = (self.connection(), self.watch());
        let reply = connection.route_command(cmd.clone(), routing).await;
        watch.ended(&reply);
        reply
    }

    /// Sends `cmd` to the node its key routes to (a random node when it names none).
    pub(crate) async fn query(self: &Arc<Self>, cmd: &Cmd) -> Result<Value, RedisError> {
        use redis::aio::ConnectionLike as _;
        let (mut connection, watch) = (self.connection(), self.watch());
        let reply = connection.req_packed_command(cmd).await;
        watch.ended(&reply);
        reply.and_then(Value::extract_error)
    }

    /// How many times the connection was replaced.
    pub(crate) fn reconnects(&self) -> u64 {
        self.health.lock().unwrap_or_else(PoisonError::into_inner).reconnects
    }

    fn unanswered(self: &Arc<Self>, started: Instant) {
        let now = Instant::now();
        let rebuild = {
            let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
            // Set while the lock is held: an answer that reads it takes the lock after this.
            self.unanswered.store(true, Ordering::Relaxed);
            health.unanswered(started, now)
        };
        if !rebuild {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.health.lock().unwrap_or_else(PoisonError::into_inner).rebuilt(false, Instant::now());
            return;
        };
        let cluster = self.clone();
        runtime.spawn(async move {
            tracing::warn!("the Redis Cluster connection answered nothing for a while; opening a new one");
            let fresh = tokio::time::timeout(cluster.connect_timeout, cluster.client.get_async_connection()).await;
            let ok = match fresh {
                Ok(Ok(connection)) => {
                    *cluster.current.write().unwrap_or_else(PoisonError::into_inner) = connection;
                    cluster.lost.store(true, Ordering::Relaxed);
                    tracing::warn!("the Redis Cluster connection was replaced");
                    true
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot open a new Redis Cluster connection; keeping the old one");
                    false
                }
                Err(_) => {
                    tracing::warn!("opening a new Redis Cluster connection timed out; keeping the old one");
                    false
                }
            };
            cluster.health.lock().unwrap_or_else(PoisonError::into_inner).rebuilt(ok, Instant::now());
        });
    }

    fn answered(&self) {
        if self.unanswered.swap(false, Ordering::Relaxed) {
            self.health.lock().unwrap_or_else(PoisonError::into_inner).answered();
        }
    }
}

/// Reports one call: an answer (a reply or an error reply from a node), or none (the call was
/// dropped, timed out or lost its connection).
pub(crate) struct Watch {
    cluster: Option<Arc<Cluster>>,
    started: Instant,
}

impl Watch {
    fn ended<T>(mut self, reply: &Result<T, RedisError>) {
        let Some(cluster) = self.cluster.take() else { return };
        match reply {
            Err(e) if crate::reply::is_connection_error(e) => {
                cluster.lost.store(true, Ordering::Relaxed);
                cluster.unanswered(self.started);
            }
            _ => cluster.answered(),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(cluster) = self.cluster.take() {
            cluster.unanswered(self.started);
        }
    }
}

/// Since when calls have gone unanswered, and whether a new connection is being opened.
#[derive(Debug)]
struct Health {
    reconnect_after: Duration,
    /// The start of the oldest call left unanswered since the last answer.
    unanswered_since: Option<Instant>,
    /// When the last new connection was opened or tried: calls that started before it count
    /// from then (they ran on the old connection, or belong to the period already acted on).
    period_start: Option<Instant>,
    rebuilding: bool,
    reconnects: u64,
}

impl Health {
    fn new(reconnect_after: Duration) -> Self {
        Self { reconnect_after, unanswered_since: None, period_start: None, rebuilding: false, reconnects: 0 }
    }

    fn answered(&mut self) {
        self.unanswered_since = None;
    }

    /// A call that started at `started` ended without an answer at `now`: whether to open a new
    /// connection now (nothing answered for `reconnect_after`, and no new connection on the way).
    fn unanswered(&mut self, started: Instant, now: Instant) -> bool {
        let started = self.period_start.map_or(started, |p| started.max(p));
        let since = self.unanswered_since.map_or(started, |s| s.min(started));
        self.unanswered_since = Some(since);
        if self.rebuilding || now.saturating_duration_since(since) < self.reconnect_after {
            return false;
        }
        self.rebuilding = true;
        true
    }

    /// A new connection was opened (`ok`) or could not be: either way a new period begins, so a
    /// cluster that is down is not asked for a new connection more than once a period.
    fn rebuilt(&mut self, ok: bool, now: Instant) {
        self.rebuilding = false;
        self.unanswered_since = None;
        self.period_start = Some(now);
        if ok {
            self.reconnects += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(10);

    #[test]
    fn a_connection_is_replaced_only_after_nothing_answered_for_the_period() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut h = Health::new(AFTER);
        // Calls dropped after 3 s each, from t0 on: not yet at 3, 6, 9 s.
        assert!(!h.unanswered(at(0), at(3)));
        assert!(!h.unanswered(at(3), at(6)));
        assert!(!h.unanswered(at(6), at(9)));
        // 10 s after the first unanswered call began: open a new connection, once.
        assert!(h.unanswered(at(7), at(10)));
        assert!(!h.unanswered(at(8), at(11)), "one new connection at a time");
        h.rebuilt(true, at(11));
        assert_eq!(h.reconnects, 1);
        // Calls begun on the old connection, dropped after it was replaced, count from then.
        assert!(!h.unanswered(at(9), at(12)));
        assert!(!h.unanswered(at(12), at(15)));
        assert!(h.unanswered(at(13), at(21)));
    }

    #[test]
    fn an_answer_starts_the_period_again() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut h = Health::new(AFTER);
        assert!(!h.unanswered(at(0), at(3)));
        h.answered();
        // A failover's few seconds of timeouts between answers never add up.
        for s in (4..60).step_by(4) {
            assert!(!h.unanswered(at(s), at(s + 3)));
            h.answered();
        }
        assert_eq!(h.reconnects, 0);
    }

    #[test]
    fn a_cluster_that_cannot_be_reached_is_asked_once_a_period() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut h = Health::new(AFTER);
        assert!(h.unanswered(at(0), at(10)));
        h.rebuilt(false, at(15));
        assert!(!h.unanswered(at(15), at(20)));
        assert!(h.unanswered(at(16), at(25)));
        assert_eq!(h.reconnects, 0);
    }
}
