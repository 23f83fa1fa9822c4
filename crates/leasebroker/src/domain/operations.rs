//! Operations, for the reaper: attempts, the rollback mark, releases, cleanup.

use super::*;
use crate::db::with_pool;

impl Domain {
    /// Gives back what a create took (its lease, and the node allocated under `alloc_id`) and
    /// marks its boot intent failed, in one transaction: the hypervisor definitely refused.
    pub async fn release_refused(&self, alloc_id: &str, lease_id: &str, intent_id: &str) -> Result<Released> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let leases = sqlx::query("DELETE FROM lb_leases WHERE lease_id = $1")
                .bind(lease_id).execute(&mut *tx).await?.rows_affected();
            let nodes = sqlx::query("UPDATE lb_nodes SET alloc_id = NULL, principal = NULL, allocated_at = NULL WHERE alloc_id = $1")
                .bind(alloc_id).execute(&mut *tx).await?.rows_affected();
            sqlx::query("UPDATE lb_intents SET state = 'failed' WHERE intent_id = $1 AND state = 'pending'")
                .bind(intent_id).execute(&mut *tx).await?;
            tx.commit().await?;
            Released { leases, nodes, operations: 0 }
        }))
    }

    /// Rolls back an abandoned create in one transaction: deletes its lease, frees its node,
    /// deletes its intents and marks its row rolled back (pruned after the retention).
    pub async fn release_abandoned(&self, op_id: &str, alloc_id: &str, lease_id: &str) -> Result<Released> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let leases = sqlx::query("DELETE FROM lb_leases WHERE lease_id = $1")
                .bind(lease_id).execute(&mut *tx).await?.rows_affected();
            let nodes = sqlx::query("UPDATE lb_nodes SET alloc_id = NULL, principal = NULL, allocated_at = NULL WHERE alloc_id = $1")
                .bind(alloc_id).execute(&mut *tx).await?.rows_affected();
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            // The row stays, marked rolled back (pruned after the retention), so an attempt that
            // still runs can never start the operation again.
            let operations = sqlx::query("UPDATE lb_operations SET rolled_back = 2 WHERE op_id = $1 AND rolled_back < 2")
                .bind(op_id).execute(&mut *tx).await?.rows_affected();
            tx.commit().await?;
            Released { leases, nodes, operations }
        }))
    }

    /// Records that an attempt of `op` starts now (inserts the operation or moves its
    /// `last_attempt_at`). Errs with [`DomainError::RolledBack`] when the reaper took the
    /// operation for a rollback: an attempt that still runs must not start it again.
    pub async fn begin_attempt(&self, op: &OperationRow) -> Result<()> {
        let written = with_pool!(&self.db, p => {
            sqlx::query(create::BEGIN_ATTEMPT)
                .bind(&op.op_id).bind(&op.kind).bind(&op.principal).bind(&op.endpoint).bind(&op.idem_key)
                .bind(&op.record_id).bind(op.last_attempt_at)
                .execute(p).await?.rows_affected()
        });
        if written == 0 {
            return Err(DomainError::RolledBack);
        }
        Ok(())
    }

    /// Takes the abandoned create `op_id` for a rollback: from here no attempt of it can take,
    /// call or show anything (every step of a create is fenced on this mark). False when the
    /// operation row is gone: the create finished (its worker exists) or was forgotten.
    pub async fn mark_rolling_back(&self, op_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_operations SET rolled_back = 1 WHERE op_id = $1 AND rolled_back < 2")
                .bind(op_id).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Up to `limit` operations whose last attempt started at or before `before`, oldest first,
    /// after the position `after` (`(last_attempt_at, op_id)` of the previous page's last row).
    pub async fn operations_before(
        &self,
        before: i64,
        after: Option<&(i64, String)>,
        limit: u32,
    ) -> Result<Vec<OperationRow>> {
        let (at, id) = after.map_or((i64::MIN, ""), |(at, id)| (*at, id.as_str()));
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, OperationRow>(
                "SELECT op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at FROM lb_operations \
                 WHERE last_attempt_at <= $1 AND (last_attempt_at > $2 OR (last_attempt_at = $2 AND op_id > $3)) \
                 AND rolled_back < 2 \
                 ORDER BY last_attempt_at, op_id LIMIT $4")
                .bind(before).bind(at).bind(id).bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Forgets a finished operation: its intents and its row.
    pub async fn forget_operation(&self, op_id: &str) -> Result<()> {
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM lb_operations WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// Deletes tombstones, and intents that belong to no operation, older than `before`.
    pub async fn prune(&self, before: i64) -> Result<u64> {
        Ok(with_pool!(&self.db, p => {
            let t = sqlx::query("DELETE FROM lb_tombstones WHERE deleted_at < $1").bind(before).execute(p).await?;
            let i = sqlx::query("DELETE FROM lb_intents WHERE op_id IS NULL AND created_at < $1").bind(before).execute(p).await?;
            let o = sqlx::query("DELETE FROM lb_operations WHERE rolled_back = 2 AND last_attempt_at < $1")
                .bind(before).execute(p).await?;
            t.rows_affected() + i.rows_affected() + o.rows_affected()
        }))
    }
}
