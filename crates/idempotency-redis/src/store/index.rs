//! The per-principal index of records that
//! [`Store::count_records`](idempotency::Store::count_records) reads.

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
    /// Adds a record just created to its principal's index, and makes the index expire no
    /// earlier than that record (`PEXPIREAT ... NX`, then `GT`: Redis 7.0 or later). Plain
    /// commands, no script: not atomic with the claim (the index is another key, on another slot
    /// of a cluster), so if they fail (an older Redis, a full one) the record is not counted, and
    /// the principal's count is that much lower until the record expires. Logged, never an error
    /// of the claim.
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
}
