//! The per-principal index of records that
//! [`Store::count_records`](idempotency::Store::count_records) reads: the records that hold a
//! stored response or a live attempt. A claim, a reclaim, a renewal and a completion (re)add
//! theirs with its expiry; a failure, a remove and a forget take it out.

use idempotency::Scope;

use super::RedisStore;

/// The sorted set that indexes a principal's records for
/// [`Store::count_records`](idempotency::Store::count_records): each member a record's key,
/// scored by its expiry in epoch milliseconds.
pub(super) fn principal_index(prefix: &str, principal: &idempotency::Principal) -> String {
    use sha2::Digest;
    format!("{prefix}principal:{}", hex::encode(sha2::Sha256::digest(principal.as_str().as_bytes())))
}

impl RedisStore {
    /// Adds a record just claimed, reclaimed or completed to its principal's index (or moves it
    /// to its new expiry), and makes the index expire no earlier than that record
    /// (`PEXPIREAT ... NX`, then `GT`: Redis 7.0 or later). Plain commands, no script: not atomic
    /// with the transition (the index is another key, on another slot of a cluster), so if they
    /// fail (an older Redis, a full one) the record is not counted, and the principal's count is
    /// that much lower until the record's next transition or its expiry. Logged, never an error
    /// of the transition.
    pub(super) async fn index_record(&self, scope: &Scope, eat_ms: &str) {
        let index = principal_index(&self.prefix, &scope.principal);
        let mut add = redis::cmd("ZADD");
        add.arg(&index).arg(eat_ms).arg(self.key_of(scope));
        let expire = |condition: &str| redis::cmd("PEXPIREAT").arg(&index).arg(eat_ms).arg(condition).clone();
        for cmd in [add, expire("NX"), expire("GT")] {
            if let Err(e) = self.conn.query(&cmd).await {
                tracing::warn!(error = %e, "cannot index a record under its principal; it is not counted");
                return;
            }
        }
    }

    /// Takes a record that failed or is gone out of its principal's index: it no longer counts.
    /// Best effort as [`Self::index_record`]: if it fails, the record is counted until its
    /// expiry, one too many.
    pub(crate) async fn unindex_record(&self, principal: &idempotency::Principal, key: &str) {
        let index = principal_index(&self.prefix, principal);
        if let Err(e) = self.conn.query(redis::cmd("ZREM").arg(&index).arg(key)).await {
            tracing::warn!(error = %e, "cannot take a record out of its principal's index; it is counted until it expires");
        }
    }
}
