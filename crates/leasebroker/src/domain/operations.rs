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
    /// `last_attempt_at`; the reaper looks at it from `check_at`). Errs with
    /// [`DomainError::RolledBack`] when the reaper took the operation for a rollback, and
    /// [`DomainError::Finished`] when it finished: an attempt that still runs must not start it
    /// again.
    pub async fn begin_attempt(&self, op: &OperationRow, check_at: i64) -> Result<()> {
        with_pool!(&self.db, p => {
            let written = sqlx::query(create::BEGIN_ATTEMPT)
                .bind(&op.op_id).bind(&op.kind).bind(&op.principal).bind(&op.endpoint).bind(&op.idem_key)
                .bind(&op.record_id).bind(op.last_attempt_at).bind(check_at)
                .execute(p).await?.rows_affected();
            if written == 0 {
                let mark: Option<i64> = sqlx::query_scalar("SELECT CAST(rolled_back AS BIGINT) FROM lb_operations WHERE op_id = $1")
                    .bind(&op.op_id).fetch_optional(p).await?;
                return Err(refused_by(mark));
            }
        });
        Ok(())
    }

    /// Takes the abandoned create `op_id` for a rollback: from here no attempt of it can take,
    /// call or show anything (every step of a create is fenced on this mark). False when the
    /// operation finished (its worker exists) or is rolled back already.
    pub async fn mark_rolling_back(&self, op_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_operations SET rolled_back = 1 WHERE op_id = $1 AND rolled_back < 2")
                .bind(op_id).execute(p).await?.rows_affected() == 1
        }))
    }

    /// How many operations are due at `now` (what [`Domain::operations_due`] would choose
    /// from), counted up to `cap`.
    pub async fn operations_due_count(&self, now: i64, cap: u32) -> Result<u64> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_scalar::<_, i64>(
                "SELECT COUNT(*) FROM (SELECT 1 FROM lb_operations WHERE rolled_back < 2 AND next_check_at <= $1 LIMIT $2) AS due")
                .bind(now).bind(i64::from(cap)).fetch_one(p).await?
        })
        .try_into()
        .unwrap_or(0))
    }

    /// Up to `limit` live operations due for the reaper's look (`next_check_at <= now`): the
    /// `limit / 2` that waited longest, and the `limit / 2` that fell due last. A row the reaper
    /// waits on is put off ([`Domain::put_off`]), so it never comes up again before its time;
    /// and a backlog of due rows (say, after an outage) never delays a row that just fell due,
    /// while the backlog drains from its oldest end.
    pub async fn operations_due(&self, now: i64, limit: u32) -> Result<Vec<OperationRow>> {
        let half = i64::from(limit.div_ceil(2));
        let mut rows = with_pool!(&self.db, p => {
            let oldest = sqlx::query_as::<_, OperationRow>(
                "SELECT op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at FROM lb_operations \
                 WHERE rolled_back < 2 AND next_check_at <= $1 ORDER BY next_check_at, op_id LIMIT $2")
                .bind(now).bind(half).fetch_all(p).await?;
            let newest = sqlx::query_as::<_, OperationRow>(
                "SELECT op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at FROM lb_operations \
                 WHERE rolled_back < 2 AND next_check_at <= $1 ORDER BY next_check_at DESC, op_id DESC LIMIT $2")
                .bind(now).bind(half).fetch_all(p).await?;
            let mut rows = oldest;
            rows.extend(newest);
            rows
        });
        rows.sort_by(|a, b| a.op_id.cmp(&b.op_id));
        rows.dedup_by(|a, b| a.op_id == b.op_id);
        Ok(rows)
    }

    /// Up to `limit` live operations (neither finished nor rolled back), the oldest attempt
    /// first, for the console. A create is marked finished when it makes its worker; a delete or a
    /// reboot stays live until the reaper's next look finds its record completed.
    pub async fn live_operations(&self, limit: u32) -> Result<Vec<LiveOperation>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, LiveOperation>(
                "SELECT op_id, kind, principal, endpoint, idem_key, last_attempt_at, \
                 CASE WHEN rolled_back = 1 THEN 1 ELSE 0 END AS rolling_back FROM lb_operations \
                 WHERE rolled_back < 2 ORDER BY last_attempt_at, op_id LIMIT $1")
                .bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Puts off the reaper's next look at the operation `op_id` until `at`.
    pub async fn put_off(&self, op_id: &str, at: i64) -> Result<()> {
        with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_operations SET next_check_at = $2 WHERE op_id = $1").bind(op_id).bind(at).execute(p).await?;
        });
        Ok(())
    }

    /// Forgets a finished operation: its intents go, and its row keeps the finished mark until
    /// the retention passes (so no attempt that outlived its claim starts it again).
    pub async fn forget_operation(&self, op_id: &str) -> Result<()> {
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            sqlx::query("UPDATE lb_operations SET rolled_back = 3, last_attempt_at = $2 WHERE op_id = $1 AND rolled_back < 2")
                .bind(op_id).bind(crate::service::now_micros()).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// Deletes tombstones, intents that belong to no operation, and rolled-back or finished
    /// operations (with their intents), older than `before`.
    pub async fn prune(&self, before: i64) -> Result<u64> {
        Ok(with_pool!(&self.db, p => {
            let t = sqlx::query("DELETE FROM lb_tombstones WHERE deleted_at < $1").bind(before).execute(p).await?;
            let i = sqlx::query("DELETE FROM lb_intents WHERE op_id IS NULL AND created_at < $1").bind(before).execute(p).await?;
            let mut tx = p.begin().await?;
            let oi = sqlx::query("DELETE FROM lb_intents WHERE op_id IN \
                                  (SELECT op_id FROM lb_operations WHERE rolled_back >= 2 AND last_attempt_at < $1)")
                .bind(before).execute(&mut *tx).await?;
            let o = sqlx::query("DELETE FROM lb_operations WHERE rolled_back >= 2 AND last_attempt_at < $1")
                .bind(before).execute(&mut *tx).await?;
            tx.commit().await?;
            t.rows_affected() + i.rows_affected() + oi.rows_affected() + o.rows_affected()
        }))
    }
}
