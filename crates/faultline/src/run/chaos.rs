//! The faults a run makes on the server side: replicas killed mid-request and restarted, replicas
//! paused past their claims, the database stopped and started again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::Rng;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::cluster::{Replica, Started};
use crate::pg::LocalCluster;
use crate::proxy::Proxy;
use crate::timeline::Happening;
use crate::workload::Workload;

/// Kills a random replica `kills` times, at evenly spread points of the workload, each time while
/// it has a request open, and after `down` restarts it on the same port. Each kill and each
/// restart goes on the workload's timeline. Returns the kills made.
pub(super) async fn kill_replicas(
    kills: u32,
    down: Duration,
    ops: u64,
    workload: Arc<Workload>,
    replicas: Arc<Mutex<Vec<Replica>>>,
    proxies: Arc<Vec<Proxy>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(kills) {
        let milestone = ops * k / (u64::from(kills) + 1);
        while workload.counters.ops_done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = rand::rng().random_range(0..proxies.len());
        // Mid-request: wait (briefly) until the victim has a connection open.
        let wait_until = Instant::now() + Duration::from_secs(2);
        while proxies[victim].stats.active_upstream.load(Ordering::Relaxed) == 0 && Instant::now() < wait_until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let mut replicas = replicas.lock().await;
        replicas[victim].kill().await?;
        workload.timeline.note(Happening::Killed(victim));
        tokio::time::sleep(down).await;
        let Started { failed_starts, last_failure } = replicas[victim].start_again().await?;
        workload.timeline.note(Happening::Ready { replica: victim, failed_starts, last_failure });
        done += 1;
    }
    Ok(done)
}

/// Stops the database `restarts` times, at evenly spread points of the workload (offset from the
/// replica kills), keeps it down for `down`, and starts it again. Returns the restarts made.
pub(super) async fn restart_database(
    restarts: u32,
    down: Duration,
    ops: u64,
    workload: Arc<Workload>,
    cluster: Arc<Mutex<LocalCluster>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(restarts) {
        let milestone = (ops * (2 * k - 1) / (2 * u64::from(restarts) + 1)).max(1);
        while workload.counters.ops_done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut cluster = cluster.lock().await;
        cluster.stop().await?;
        workload.timeline.note(Happening::DatabaseStopped);
        tokio::time::sleep(down).await;
        cluster.start_again().await?;
        workload.timeline.note(Happening::DatabaseStarted);
        cluster.restarts += 1;
        done += 1;
    }
    Ok(done)
}

/// Pauses a random replica `pauses` times, at evenly spread points of the workload (off the
/// kills' points), each time while it has a request open: SIGSTOP, `pause`, SIGCONT. The
/// replicas' lock is held through the pause, so a kill never hits a stopped process. Returns the
/// pauses made.
pub(super) async fn pause_replicas(
    pauses: u32,
    pause: Duration,
    ops: u64,
    workload: Arc<Workload>,
    replicas: Arc<Mutex<Vec<Replica>>>,
    proxies: Arc<Vec<Proxy>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(pauses) {
        let milestone = (ops * (3 * k - 1) / (3 * u64::from(pauses) + 1)).max(1);
        while workload.counters.ops_done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = rand::rng().random_range(0..proxies.len());
        // Mid-request: wait (briefly) until the victim has a connection open, so that a claim is
        // held when it stops.
        let wait_until = Instant::now() + Duration::from_secs(2);
        while proxies[victim].stats.active_upstream.load(Ordering::Relaxed) == 0 && Instant::now() < wait_until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let timeline = &workload.timeline;
        if replicas.lock().await[victim].pause_for(pause, || timeline.note(Happening::Paused(victim))).await? {
            timeline.note(Happening::Resumed(victim));
            done += 1;
        }
    }
    Ok(done)
}
