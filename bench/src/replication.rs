//! Part `replication` (issue 28): what waiting for a replica costs.
//! - PostgreSQL: two Patroni clusters of three members behind HAProxy
//!   (`idempotency_sqlx::testing::ha`), one in synchronous mode (a commit returns once a
//!   synchronous standby has its WAL), one asynchronous; the store driven directly on each,
//!   first executions (claim + complete) and replays, interleaved.
//! - Redis: one cluster with a replica per primary (`idempotency_redis::testing`), the store with
//!   `replicas(1)` (`WAIT 1`, or `WAITAOF` where the server has it) and with `replicas(0)`.
//!
//! Prints one line per run in `bench/run`'s raw format (`{"part", "case", "conns", "variant",
//! "round", "m"}`), so its output is appended to the raw file as it is.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use idempotency::{ClaimOutcome, RecordState, Store, now};
use idempotency_redis::{RedisStore, RedisStoreOptions};
use idempotency_sqlx::PostgresStore;
use idempotency_sqlx::testing::ha::{self, HaPostgres, Replication};
use serde_json::json;

use crate::load;
use crate::pg::{claim_request, response};

const CONCURRENCY: usize = 16;
const KEYS: u32 = 2_000;

#[derive(Debug, Args)]
pub(crate) struct ReplicationArgs {
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Interleaved rounds.
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Which stores: `postgres`, `redis` or both (the default).
    #[arg(long, value_delimiter = ',', default_values_t = ["postgres".to_owned(), "redis".to_owned()])]
    stores: Vec<String>,
}

/// One store under test: its name in the report and how to drive it.
enum Target {
    Postgres(PostgresStore),
    Redis(RedisStore),
}

impl Target {
    async fn claim(&self, key: &str) -> anyhow::Result<ClaimOutcome> {
        let req = claim_request(key)?;
        Ok(match self {
            Self::Postgres(s) => s.claim(req).await?,
            Self::Redis(s) => s.claim(req).await?,
        })
    }

    async fn first(&self, key: &str) -> anyhow::Result<bool> {
        let ClaimOutcome::Owned(claim) = self.claim(key).await? else { return Ok(false) };
        let expires = now() + chrono::Duration::hours(24);
        match self {
            Self::Postgres(s) => s.complete(&claim, &response(), expires).await?,
            Self::Redis(s) => s.complete(&claim, &response(), expires).await?,
        }
        Ok(true)
    }

    async fn replay(&self, key: &str) -> anyhow::Result<bool> {
        Ok(matches!(self.claim(key).await?, ClaimOutcome::Existing(r) if r.state == RecordState::Completed))
    }
}

fn emit(case: &str, variant: &str, round: u32, m: serde_json::Value) {
    let line =
        json!({"part": "replication", "case": case, "conns": CONCURRENCY, "variant": variant, "round": round, "m": m});
    println!("{line}");
}

async fn prepare(target: &Target) -> anyhow::Result<()> {
    for k in 0..KEYS {
        target.first(&format!("r-{k}")).await?;
    }
    Ok(())
}

async fn measure(
    target: Arc<Target>,
    case: &'static str,
    seconds: f64,
    nonce: String,
) -> anyhow::Result<serde_json::Value> {
    let stats = load::run(CONCURRENCY, Duration::from_secs_f64(seconds), move |task, i| {
        let (target, nonce) = (target.clone(), nonce.clone());
        async move {
            if case == "first" {
                target.first(&format!("{nonce}-{task}-{i}")).await
            } else {
                target.replay(&format!("r-{}", rand::random_range(0..KEYS))).await
            }
        }
    })
    .await;
    Ok(serde_json::to_value(&stats)?)
}

async fn postgres(cluster: &HaPostgres) -> anyhow::Result<PostgresStore> {
    let pool = idempotency_sqlx::postgres_pool_options(CONCURRENCY as u32).connect(&cluster.url()).await?;
    let store = PostgresStore::from_pool(pool);
    store.migrate().await?;
    Ok(store)
}

pub(crate) async fn replication(a: ReplicationArgs) -> anyhow::Result<()> {
    let mut targets: Vec<(&'static str, Arc<Target>)> = Vec::new();
    // Kept alive for the whole run; removed (servers stopped, directories deleted) on drop.
    let mut clusters = Vec::new();
    let mut redis_cluster = None;
    if a.stores.iter().any(|s| s == "postgres") {
        let missing = ha::missing_binaries();
        anyhow::ensure!(
            missing.is_empty(),
            "the replication part needs {missing:?} (apt-get install patroni etcd-server haproxy)"
        );
        for (name, mode) in [("pg-sync", Replication::Synchronous), ("pg-async", Replication::Asynchronous)] {
            eprintln!("replication: starting a Patroni cluster ({name})");
            let cluster =
                tokio::task::spawn_blocking(move || HaPostgres::start(mode)).await?.map_err(anyhow::Error::msg)?;
            let store = postgres(&cluster).await?;
            clusters.push(cluster);
            targets.push((name, Arc::new(Target::Postgres(store))));
        }
    }
    if a.stores.iter().any(|s| s == "redis") {
        anyhow::ensure!(
            idempotency_redis::testing::have_redis_binaries(),
            "the replication part needs redis-server and redis-cli"
        );
        eprintln!("replication: starting a Redis cluster with a replica per primary");
        let cluster =
            tokio::task::spawn_blocking(|| idempotency_redis::testing::Cluster::start_with_replicas(1)).await?;
        let url = cluster.url();
        for (name, replicas) in [("redis-wait1", 1), ("redis-nowait", 0)] {
            let options = RedisStoreOptions::default().prefix(format!("{name}:")).replicas(replicas);
            targets.push((name, Arc::new(Target::Redis(RedisStore::connect_with(&url, options).await?))));
        }
        redis_cluster = Some(cluster);
    }
    for (name, target) in &targets {
        eprintln!("replication: {KEYS} completed records to replay on {name}");
        prepare(target).await?;
    }
    for round in 1..=a.rounds {
        for case in ["first", "replay"] {
            // Alternate which variant goes first from round to round.
            let mut order: Vec<_> = targets.iter().collect();
            if round % 2 == 0 {
                order.reverse();
            }
            for (name, target) in order {
                let m = measure(target.clone(), case, a.seconds, format!("{name}-{round}")).await?;
                emit(case, name, round, m);
            }
        }
        eprintln!("replication: round {round} done");
    }
    drop(redis_cluster);
    drop(clusters);
    Ok(())
}
