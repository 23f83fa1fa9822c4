//! The per-principal index of records that
//! [`Store::count_records`](idempotency::Store::count_records) reads.
//!
//! The index is one key, so on a cluster it lives on one shard while the principal's records
//! live on all of them: a shard that does not answer must not hold up, nor fail, the records on
//! the others. So the index is written after a claim in a task of its own, waited for only
//! [`INDEX_WAIT`], and a count the index's primary does not answer within [`COUNT_TIMEOUT`] is
//! no count (`None`: the limit is not enforced for that call).

use std::time::Duration;

use idempotency::{Scope, StoreError, Timestamp};
use redis::Value;

use super::{RedisStore, redis_error};
use crate::codec::expiry_millis;

/// How long a claim waits for its record to be added to the principal's index before it answers
/// (the write goes on after it): long enough that a count right after a claim sees it.
const INDEX_WAIT: Duration = Duration::from_millis(500);
/// How long a count waits for the index's primary.
const COUNT_TIMEOUT: Duration = Duration::from_secs(1);

/// The sorted set that indexes a principal's records for
/// [`Store::count_records`](idempotency::Store::count_records): each member a record's key,
/// scored by its expiry in epoch milliseconds.
pub(super) fn principal_index(prefix: &str, principal: &idempotency::Principal) -> String {
    use sha2::Digest;
    format!("{prefix}principal:{}", hex::encode(sha2::Sha256::digest(principal.as_str().as_bytes())))
}

impl RedisStore {
    /// Adds a record just created to its principal's index, and makes the index expire no
    /// earlier than that record (`PEXPIREAT ... NX`, then `GT`: Redis 7.0 or later), as one
    /// pipeline. Plain commands, no script: not atomic with the claim (the index is another key,
    /// on another slot of a cluster), so if they fail (an older Redis, a full one, a shard that
    /// does not answer) the record is not counted, and the principal's count is that much lower
    /// until the record expires. Logged, never an error of the claim.
    pub(super) async fn index_record(&self, scope: &Scope, eat_ms: &str) {
        let index = principal_index(&self.prefix, &scope.principal);
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD").arg(&index).arg(eat_ms).arg(self.key_of(scope));
        for condition in ["NX", "GT"] {
            pipe.cmd("PEXPIREAT").arg(&index).arg(eat_ms).arg(condition);
        }
        let conn = self.conn.clone();
        let write = tokio::spawn(async move {
            let failed = match conn.on_primary_of(&index, &pipe).await {
                Ok(replies) => replies.into_iter().find_map(|v| v.extract_error().err()),
                Err(e) => Some(e),
            };
            if let Some(e) = failed {
                tracing::warn!(error = %e, "cannot index a record under its principal; it is not counted");
            }
        });
        let _ = tokio::time::timeout(INDEX_WAIT, write).await;
    }

    /// The principal's live records: expired members trimmed, then counted, as one pipeline on
    /// the index's primary; `None` when it does not answer within [`COUNT_TIMEOUT`] or fails as
    /// unavailable.
    pub(super) async fn count_indexed(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let index = principal_index(&self.prefix, principal);
        let mut pipe = redis::pipe();
        pipe.cmd("ZREMRANGEBYSCORE").arg(&index).arg("-inf").arg(expiry_millis(now).to_string());
        pipe.cmd("ZCARD").arg(&index);
        let counted = match tokio::time::timeout(COUNT_TIMEOUT, self.conn.on_primary_of(&index, &pipe)).await {
            Ok(Ok(replies)) => replies.into_iter().nth(1).map(Value::extract_error),
            Ok(Err(e)) => Some(Err(e)),
            Err(_) => {
                tracing::warn!(timeout = ?COUNT_TIMEOUT, "the principal's record index did not answer; not counted");
                return Ok(None);
            }
        };
        match counted {
            Some(Ok(Value::Int(n))) => Ok(Some(u64::try_from(n).unwrap_or(0))),
            Some(Err(e)) => match redis_error(e) {
                StoreError::Unavailable(e) => {
                    tracing::warn!(error = %e, "the principal's record index does not answer; not counted");
                    Ok(None)
                }
                corrupt => Err(corrupt),
            },
            other => Err(StoreError::Corrupt(format!("unexpected ZCARD reply {other:?}"))),
        }
    }
}
