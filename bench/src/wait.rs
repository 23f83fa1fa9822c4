//! `Prefer: wait` (docs/protocol.md#records): how long after the first request's answer a retry that waits for
//! the same key gets its own. The first request's handler works for `--handler-ms`; the retry
//! arrives while it works, with `Prefer: wait=10`, and is answered the stored response once the
//! record completes. The latency is the retry's answer minus the first request's answer, both
//! as the client sees them. Three pairs first warm the connections up and are not counted.
//!
//! - `memory`: both requests to one server; the retry is woken in process when the owner
//!   completes the record.
//! - `postgres`: the retry to a second layer (another replica) on the same database; it is woken
//!   by the store's announcement (`LISTEN`/`NOTIFY`).
//! - `postgres-polling`: the same with the announcements off, so the retry finds the record by
//!   polling the store (10 ms, doubling to 500 ms): what the announcements save.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use clap::{Args, ValueEnum};
use idempotency::{MemoryStore, Principal, Store};
use idempotency_sqlx::PostgresStore;
use idempotency_tower::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer, PREFER};
use serde_json::json;

/// The goal: the waiting retry answered within this long of the first request's answer, p99.
const GOAL_MS: f64 = 10.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum WaitStore {
    Memory,
    Postgres,
    PostgresPolling,
}

#[derive(Debug, Args)]
pub(crate) struct WaitArgs {
    #[arg(long, value_enum)]
    store: WaitStore,
    /// PostgreSQL URL for the `postgres` stores (its migrations are run).
    #[arg(long)]
    database: Option<String>,
    /// Pairs of requests (one after another).
    #[arg(long, default_value_t = 100)]
    requests: u32,
    /// How long the first request's handler works, in milliseconds.
    #[arg(long, default_value_t = 100)]
    handler_ms: u64,
}

/// One server: the layer on `store` around a handler that works for `work`.
async fn server(store: Arc<dyn Store>, work: Duration) -> anyhow::Result<String> {
    let layer = IdempotencyLayer::builder(store).allow_anonymous(Principal::new("bench")).build();
    let app = Router::new()
        .route(
            "/v1/flashes",
            post(move || async move {
                tokio::time::sleep(work).await;
                (StatusCode::CREATED, [("content-type", "application/json")], r#"{"id":"op-1"}"#)
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/flashes", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

async fn postgres(url: Option<&str>, announce: bool) -> anyhow::Result<Arc<dyn Store>> {
    let url = url.ok_or_else(|| anyhow::anyhow!("the postgres stores need --database"))?;
    let store = PostgresStore::connect(url).await?;
    store.migrate().await?;
    Ok(Arc::new(if announce { store } else { store.without_announcements() }))
}

/// Sends one create with `key` and `Prefer: wait=10`; answers when its body is read, with whether
/// it was a replay.
async fn create(client: &reqwest::Client, url: &str, key: &str) -> anyhow::Result<(Instant, bool)> {
    let res = client
        .post(url)
        .header(IDEMPOTENCY_KEY, format!("\"{key}\""))
        .header(PREFER, "wait=10")
        .body("{}")
        .send()
        .await?;
    let status = res.status();
    let replayed = res.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
    res.bytes().await?;
    anyhow::ensure!(status == StatusCode::CREATED, "{key}: answered {status}");
    Ok((Instant::now(), replayed))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(crate) async fn wait(args: WaitArgs) -> anyhow::Result<()> {
    let work = Duration::from_millis(args.handler_ms);
    let (first, second) = match args.store {
        WaitStore::Memory => {
            let url = server(Arc::new(MemoryStore::new()), work).await?;
            (url.clone(), url)
        }
        WaitStore::Postgres | WaitStore::PostgresPolling => {
            let announce = args.store == WaitStore::Postgres;
            let a = server(postgres(args.database.as_deref(), announce).await?, work).await?;
            let b = server(postgres(args.database.as_deref(), announce).await?, work).await?;
            (a, b)
        }
    };
    let client = reqwest::Client::builder().pool_max_idle_per_host(4).build()?;
    let nonce = rand::random::<u64>();
    let mut latencies = Vec::with_capacity(args.requests as usize);
    // The first pairs open the connections (and the store's announcement listener): not counted.
    const WARM_UP: u32 = 3;
    for i in 0..args.requests + WARM_UP {
        let key = format!("wait-{nonce:x}-{i}");
        let first = {
            let (client, url, key) = (client.clone(), first.clone(), key.clone());
            tokio::spawn(async move { create(&client, &url, &key).await })
        };
        // The first request has claimed the key by then, and its handler works on. Under load it
        // may not have: then the second one runs the handler and the first one waits. Both say
        // `Prefer: wait`, so either way one is executed and the other answered from the record.
        tokio::time::sleep(work / 5).await;
        let second = create(&client, &second, &key).await?;
        let first = first.await??;
        let (executed, replayed) = match (first, second) {
            ((at, false), (replayed_at, true)) | ((replayed_at, true), (at, false)) => (at, replayed_at),
            _ => anyhow::bail!("{key}: not one execution and one replay"),
        };
        if i >= WARM_UP {
            latencies.push(replayed.saturating_duration_since(executed).as_secs_f64() * 1000.0);
        }
    }
    latencies.sort_by(f64::total_cmp);
    let out = json!({
        "requests": latencies.len(),
        "p50_ms": percentile(&latencies, 0.5),
        "p99_ms": percentile(&latencies, 0.99),
        "max_ms": latencies.last().copied().unwrap_or(0.0),
        "handler_ms": args.handler_ms,
        // The goal (p99 at most this), for the report's row.
        "goal_ms": GOAL_MS,
    });
    println!("{out}");
    Ok(())
}
