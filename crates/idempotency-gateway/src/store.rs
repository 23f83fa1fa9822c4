//! The record store named by `--record-store`, built by [`idempotency_stores::connect`], as
//! leasebroker builds its own.

use std::sync::Arc;

use idempotency::Store;
use idempotency_stores::{Options, StoreUrl};

/// Connects to the record store at `url` and creates or upgrades its schema.
pub async fn connect(url: &StoreUrl) -> anyhow::Result<Arc<dyn Store>> {
    Ok(idempotency_stores::connect(url, &Options::default()).await?)
}
