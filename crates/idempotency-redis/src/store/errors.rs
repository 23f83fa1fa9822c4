//! How a Redis error becomes a store error, and the error of a primary out of memory.

use std::time::Duration;

use idempotency::StoreError;
use redis::RedisError;

/// How long a write refused with `OOM` keeps the store not ready when no claim succeeds after
/// it: near `maxmemory` a server refuses some writes and takes others, as its buffers come and go.
pub(super) const OOM_REMEMBERED: Duration = Duration::from_secs(30);

/// A primary that refuses writes for lack of memory.
#[derive(Debug, thiserror::Error)]
#[error("Redis node {node} is out of memory: it refuses writes (maxmemory reached under noeviction)")]
pub(super) struct OutOfMemory {
    pub(super) node: String,
}

/// A record this call wrote changed before the call could wait for its replicas (it expired,
/// or another attempt took it over).
#[derive(Debug, thiserror::Error)]
#[error("the record this call wrote changed before its replicas were asked for it")]
pub(super) struct ChangedBeforeWait;

/// A Redis error as a store error: a value of the wrong type at a record's key, or a record the
/// claim script found damaged, is corruption; everything else means the store is unavailable.
pub(crate) fn redis_error(e: RedisError) -> StoreError {
    match e.code() {
        Some("WRONGTYPE" | "CORRUPT") => StoreError::Corrupt(e.to_string()),
        _ => StoreError::unavailable(e),
    }
}
