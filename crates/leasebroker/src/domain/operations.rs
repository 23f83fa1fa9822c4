//! What a create gives back, and the operations as the console and the reaper's gauges read
//! them from the effect ledger's table (`fx_operations`).

use super::*;
use crate::db::with_pool;

impl Domain {
    /// Gives back what a create took, in one transaction: its lease, and the node allocated
    /// under `alloc_id`. Idempotent (a second call releases nothing). For a boot the hypervisor
    /// definitely refused, and for the reaper's rollback of an abandoned create.
    pub async fn release(&self, alloc_id: &str, lease_id: &str) -> Result<Released> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let leases = sqlx::query("DELETE FROM lb_leases WHERE lease_id = $1")
                .bind(lease_id).execute(&mut *tx).await?.rows_affected();
            let nodes = sqlx::query("UPDATE lb_nodes SET alloc_id = NULL, principal = NULL, allocated_at = NULL WHERE alloc_id = $1")
                .bind(alloc_id).execute(&mut *tx).await?.rows_affected();
            tx.commit().await?;
            Released { leases, nodes }
        }))
    }

    /// How many operations are due for the reaper at `now` (live or being rolled back, their
    /// next look passed), counted up to `cap`.
    pub async fn operations_due_count(&self, now: i64, cap: u32) -> Result<u64> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_scalar::<_, i64>(
                "SELECT COUNT(*) FROM (SELECT 1 FROM fx_operations WHERE mark < 2 AND next_check_at <= $1 LIMIT $2) AS due")
                .bind(now).bind(i64::from(cap)).fetch_one(p).await?
        })
        .try_into()
        .unwrap_or(0))
    }

    /// Up to `limit` live operations (neither finished nor rolled back), the oldest attempt
    /// first, for the console. A create, a reboot or a delete is marked finished when it
    /// answers; one cut short stays live until the reaper's next look.
    pub async fn live_operations(&self, limit: u32) -> Result<Vec<LiveOperation>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, LiveOperation>(
                "SELECT op_id, kind, principal, endpoint, idem_key, last_attempt_at, \
                 CAST(CASE WHEN mark = 1 THEN 1 ELSE 0 END AS INTEGER) AS rolling_back FROM fx_operations \
                 WHERE mark < 2 ORDER BY last_attempt_at, op_id LIMIT $1")
                .bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Deletes tombstones older than `before` (the ledger prunes its own marks).
    pub async fn prune(&self, before: i64) -> Result<u64> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("DELETE FROM lb_tombstones WHERE deleted_at < $1").bind(before).execute(p).await?.rows_affected()
        }))
    }
}
