//! The per-principal index of records that
//! [`Store::count_records`](idempotency::Store::count_records) reads: the records that hold a
//! stored response or a live attempt. A claim, a reclaim, a renewal and a completion (re)add
//! theirs with its expiry; a failure, a remove and a forget take it out.
//!
//! The index is one key, so on a cluster it lives on one shard while the principal's records
//! live on all of them: a shard that does not answer must not hold up, nor fail, the records on
//! the others. So the index is written after a transition in a task of its own, waited for only
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
    /// Adds a record just claimed, reclaimed, renewed or completed to its principal's index (or
    /// moves it to its new expiry), and makes the index expire no earlier than that record
    /// (`PEXPIREAT ... NX`, then `GT`: Redis 7.0 or later), as one pipeline. Plain commands, no
    /// script: not atomic with the transition (the index is another key, on another slot of a
    /// cluster), so if they fail (an older Redis, a full one, a shard that does not answer) the
    /// record is not counted, and the principal's count is that much lower until the record's
    /// next transition or its expiry. Logged, never an error of the transition.
    pub(super) async fn index_record(&self, scope: &Scope, eat_ms: &str) {
        self.index_key(&scope.principal, &self.key_of(scope), eat_ms).await;
    }

    /// [`Self::index_record`] for the record at `key`.
    pub(crate) async fn index_key(&self, principal: &idempotency::Principal, key: &str, eat_ms: &str) {
        let index = principal_index(&self.prefix, principal);
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD").arg(&index).arg(eat_ms).arg(key);
        for condition in ["NX", "GT"] {
            pipe.cmd("PEXPIREAT").arg(&index).arg(eat_ms).arg(condition);
        }
        self.write_index(index, pipe, "cannot index a record under its principal; it is not counted").await;
    }

    /// Takes a record that failed or is gone out of its principal's index: it no longer counts.
    /// Best effort as [`Self::index_record`]: if it fails, the record is counted until its
    /// expiry, one too many.
    pub(crate) async fn unindex_record(&self, principal: &idempotency::Principal, key: &str) {
        let index = principal_index(&self.prefix, principal);
        let mut pipe = redis::pipe();
        pipe.cmd("ZREM").arg(&index).arg(key);
        self.write_index(
            index,
            pipe,
            "cannot take a record out of its principal's index; it is counted until it expires",
        )
        .await;
    }

    /// Sends `pipe` to the primary of `index` in a task of its own, waited for at most
    /// [`INDEX_WAIT`]; a failure is logged as `failure`.
    async fn write_index(&self, index: String, pipe: redis::Pipeline, failure: &'static str) {
        let conn = self.conn.clone();
        let write = tokio::spawn(async move {
            let failed = match conn.on_primary_of(&index, &pipe).await {
                Ok(replies) => replies.into_iter().find_map(|v| v.extract_error().err()),
                Err(e) => Some(e),
            };
            if let Some(e) = failed {
                tracing::warn!(error = %e, "{failure}");
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
