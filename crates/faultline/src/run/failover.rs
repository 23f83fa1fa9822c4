//! Failovers mid-run (docs/protocol.md#proving-it, round 2): the PostgreSQL primary of a Patroni cluster killed or
//! switched over, and a Redis Cluster primary killed with its replica promoted. Each failover
//! blocks on the cluster's own helper (`idempotency_sqlx::testing::ha`,
//! `idempotency_redis::testing::Cluster::fail_over`), so it runs on a blocking thread.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, anyhow};
use idempotency_redis::testing::Cluster;
use idempotency_sqlx::testing::ha::HaPostgres;

use crate::workload::Workload;

/// The operation count at which failover `k` of `n` (from 1) is made: spread over the run, off
/// the replica kills' points.
fn milestone(ops: u64, k: u64, n: u64) -> u64 {
    (ops * (2 * k - 1) / (2 * n)).max(1)
}

async fn wait_for(workload: &Workload, ops_done: u64) {
    while workload.counters.ops_done.load(Ordering::Relaxed) < ops_done {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fails the PostgreSQL primary over `n` times: odd ones kill it (Patroni and PostgreSQL,
/// SIGKILL; once a replica is promoted the member is started again and rejoins as a replica),
/// even ones are switchovers. Returns the failovers made.
pub(super) async fn fail_over_postgres(
    n: u32,
    ops: u64,
    workload: Arc<Workload>,
    ha: Arc<Mutex<HaPostgres>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(n) {
        wait_for(&workload, milestone(ops, k, u64::from(n))).await;
        let ha = ha.clone();
        tokio::task::spawn_blocking(move || {
            let mut pg = ha.lock().map_err(|_| anyhow!("the HA cluster's lock is poisoned"))?;
            if k % 2 == 1 {
                let killed = pg.kill_primary().map_err(|e| anyhow!(e))?;
                let promoted = pg.wait_until_new_primary(killed).map_err(|e| anyhow!(e))?;
                pg.restart(killed).map_err(|e| anyhow!(e))?;
                eprintln!("faultline: PostgreSQL failover {k}: member {killed} killed, member {promoted} promoted");
            } else {
                let old = pg.primary().map_or_else(|| "none (no primary)".to_owned(), |m| format!("member {m}"));
                let new = pg.switchover().map_err(|e| anyhow!(e))?;
                eprintln!("faultline: PostgreSQL failover {k}: switchover from {old} to member {new}");
            }
            anyhow::Ok(())
        })
        .await
        .context("the failover task panicked")?
        .with_context(|| format!("PostgreSQL failover {k}"))?;
        done += 1;
    }
    Ok(done)
}

/// Fails a Redis primary over `n` times, each time the next of the three: killed (SIGKILL),
/// its replica promoted, the killed node restarted as a replica. Returns the failovers made.
pub(super) async fn fail_over_redis(
    n: u32,
    ops: u64,
    workload: Arc<Workload>,
    cluster: Arc<Mutex<Cluster>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(n) {
        wait_for(&workload, milestone(ops, k, u64::from(n))).await;
        let cluster = cluster.clone();
        let victim = usize::try_from((k - 1) % 3).unwrap_or(0);
        tokio::task::spawn_blocking(move || {
            let mut cluster = cluster.lock().map_err(|_| anyhow!("the Redis cluster's lock is poisoned"))?;
            let old = cluster.nodes[victim].port;
            cluster.fail_over(victim);
            eprintln!(
                "faultline: Redis failover {k}: primary :{old} killed, replica :{} promoted",
                cluster.nodes[victim].port
            );
            anyhow::Ok(())
        })
        .await
        .map_err(|e| anyhow!("Redis failover {k} failed: {e}"))??;
        done += 1;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    #[test]
    fn failovers_are_spread_over_the_run() {
        assert_eq!((1..=2).map(|k| super::milestone(400, k, 2)).collect::<Vec<_>>(), [100, 300]);
        assert_eq!(super::milestone(400, 1, 1), 200);
        assert_eq!(super::milestone(1, 1, 4), 1);
    }
}
