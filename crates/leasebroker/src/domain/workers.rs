//! Workers, and the tombstones of deleted ones.

use sqlx::Row;

use super::*;
use crate::db::with_pool;

/// Deletes the worker `$worker_id` of `$principal` in the transaction `$tx`: the worker, its
/// lease and its node's allocation, leaving the tombstone `$tombstone_id`. Evaluates to false
/// when the worker was gone already.
macro_rules! delete_worker_in {
    ($tx:ident, $principal:expr, $worker_id:expr, $tombstone_id:expr, $now:expr) => {{
        let row =
            sqlx::query("DELETE FROM lb_workers WHERE worker_id = $1 AND principal = $2 RETURNING node_id, lease_id")
                .bind($worker_id)
                .bind($principal)
                .fetch_optional(&mut *$tx)
                .await?;
        match row {
            Some(row) => {
                use sqlx::Row as _;
                let node_id: String = row.try_get(0)?;
                let lease_id: String = row.try_get(1)?;
                sqlx::query("DELETE FROM lb_leases WHERE lease_id = $1").bind(&lease_id).execute(&mut *$tx).await?;
                sqlx::query(
                    "UPDATE lb_nodes SET alloc_id = NULL, principal = NULL, allocated_at = NULL WHERE node_id = $1",
                )
                .bind(&node_id)
                .execute(&mut *$tx)
                .await?;
                sqlx::query(
                    "INSERT INTO lb_tombstones (tombstone_id, worker_id, principal, deleted_at) \
                             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                )
                .bind($tombstone_id)
                .bind($worker_id)
                .bind($principal)
                .bind($now)
                .execute(&mut *$tx)
                .await?;
                true
            }
            None => false,
        }
    }};
}
pub(super) use delete_worker_in;

impl Domain {
    /// A principal's worker.
    pub async fn worker(&self, principal: &Principal, worker_id: &WorkerId) -> Result<Option<WorkerRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, WorkerRow>("SELECT * FROM lb_workers WHERE worker_id = $1 AND principal = $2")
                .bind(worker_id.as_str()).bind(principal.as_str()).fetch_optional(p).await?
        }))
    }

    /// A principal's workers after `cursor` (exclusive), in id order.
    pub async fn list_workers(
        &self,
        principal: &Principal,
        limit: u32,
        cursor: Option<&WorkerId>,
    ) -> Result<Vec<WorkerRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, WorkerRow>(
                "SELECT * FROM lb_workers WHERE principal = $1 AND worker_id > $2 ORDER BY worker_id LIMIT $3")
                .bind(principal.as_str()).bind(cursor.map_or("", WorkerId::as_str)).bind(i64::from(limit))
                .fetch_all(p).await?
        }))
    }

    /// The `limit` latest workers of every principal, newest first, for the console (a scan of
    /// the workers table: there is no index on `created_at`).
    pub async fn latest_workers(&self, limit: u32) -> Result<Vec<WorkerRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, WorkerRow>("SELECT * FROM lb_workers ORDER BY created_at DESC, worker_id LIMIT $1")
                .bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Deletes a worker, its lease, and frees its node, and leaves the tombstone
    /// `tombstone_id`, in one transaction. False if it was already gone.
    pub async fn delete_worker(
        &self,
        principal: &Principal,
        worker_id: &WorkerId,
        tombstone_id: &str,
        now: i64,
    ) -> Result<bool> {
        let (principal, worker_id) = (principal.as_str(), worker_id.as_str());
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let deleted = delete_worker_in!(tx, principal, worker_id, tombstone_id, now);
            tx.commit().await?;
            deleted
        }))
    }

    /// The worker a delete under `tombstone_id` deleted, if one did.
    pub async fn tombstone(&self, tombstone_id: &str) -> Result<Option<WorkerId>> {
        let worker: Option<String> = with_pool!(&self.db, p => {
            sqlx::query("SELECT worker_id FROM lb_tombstones WHERE tombstone_id = $1")
                .bind(tombstone_id).fetch_optional(p).await?.map(|r| r.try_get::<String, _>(0)).transpose()?
        });
        Ok(worker.map(WorkerId::try_from).transpose().map_err(|e| sqlx::Error::Decode(Box::new(e)))?)
    }

    /// Whether the worker `worker_id` was deleted (within the tombstones' retention).
    pub async fn is_deleted(&self, worker_id: &WorkerId) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_tombstones WHERE worker_id = $1").bind(worker_id.as_str()).fetch_optional(p).await?.is_some()
        }))
    }
}
