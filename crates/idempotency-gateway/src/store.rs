//! The record store named by `--record-store`, built by [`idempotency_stores::connect`], as
//! leasebroker builds its own.

use std::sync::Arc;

use idempotency::{ReplayCache, Store};
use idempotency_stores::{Options, StoreUrl};

/// Connects to the record store at `url` and creates or upgrades its schema; behind a replay
/// cache of `replay_cache` bytes when the store announces its changes (see
/// [`ReplayCache::over`]).
pub async fn connect(url: &StoreUrl, replay_cache: usize) -> anyhow::Result<Arc<dyn Store>> {
    let store = idempotency_stores::connect(url, &Options::default()).await?;
    Ok(ReplayCache::over(store, replay_cache as u64))
}
