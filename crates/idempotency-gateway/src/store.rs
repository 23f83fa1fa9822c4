//! The record store named by `--record-store`.

use std::sync::Arc;

use anyhow::Context;
use idempotency::{MemoryStore, Store};
use idempotency_sqlx::{PostgresStore, SqliteStore};

/// Connects to the record store at `url` (`memory`, `sqlite://PATH`, `postgres://...`,
/// `redis://...`, `rediss://...`, `redis+cluster://...`) and creates or upgrades its schema.
pub async fn connect(url: &str) -> anyhow::Result<Arc<dyn Store>> {
    let shown = redact(url);
    let (scheme, _) = url.split_once(':').unwrap_or((url, ""));
    let store: Arc<dyn Store> = match scheme {
        "memory" => Arc::new(MemoryStore::new()),
        "sqlite" => {
            let store = SqliteStore::connect(url).await.with_context(|| format!("record store {shown}"))?;
            store.migrate().await.with_context(|| format!("record store {shown}: migrations"))?;
            Arc::new(store)
        }
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(url).await.with_context(|| format!("record store {shown}"))?;
            store.migrate().await.with_context(|| format!("record store {shown}: migrations"))?;
            Arc::new(store)
        }
        "redis" | "rediss" | "redis+cluster" => Arc::new(
            idempotency_redis::RedisStore::connect(url).await.with_context(|| format!("record store {shown}"))?,
        ),
        _ => anyhow::bail!(
            "--record-store {shown}: unsupported; use memory, sqlite://PATH, postgres://..., redis://... or \
             redis+cluster://..."
        ),
    };
    Ok(store)
}

/// `url` without a password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => match url[start + 3..at].split_once(':') {
            Some((user, _)) => format!("{}://{user}:***{}", &url[..start], &url[at..]),
            None => url.to_owned(),
        },
        _ => url.to_owned(),
    }
}
