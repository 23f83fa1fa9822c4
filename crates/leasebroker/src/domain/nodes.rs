//! The node pool and leases: allocation under a sub-key, within a principal's quota.

use sqlx::Row;

use super::*;
use crate::db::with_pool;

impl Domain {
    /// Adds nodes `node-0001`..`node-NNNN` that do not exist yet, in one statement. Safe to run
    /// from several replicas at once.
    pub async fn seed_nodes(&self, count: u32, cpu: u32, memory_gb: u32) -> Result<()> {
        let sql = if self.db.is_postgres() {
            "INSERT INTO lb_nodes (node_id, cpu, memory_gb) \
             SELECT 'node-' || CASE WHEN i < 10000 THEN lpad(i::text, 4, '0') ELSE i::text END, $2, $3 \
             FROM generate_series(1, $1::bigint) AS i ON CONFLICT (node_id) DO NOTHING"
        } else {
            // `WHERE true` keeps SQLite from reading ON CONFLICT as part of the SELECT.
            "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < $1) \
             INSERT INTO lb_nodes (node_id, cpu, memory_gb) \
             SELECT printf('node-%04d', i), $2, $3 FROM seq WHERE true ON CONFLICT (node_id) DO NOTHING"
        };
        with_pool!(&self.db, p => {
            sqlx::query(sql).bind(i64::from(count)).bind(i64::from(cpu)).bind(i64::from(memory_gb)).execute(p).await?;
        });
        Ok(())
    }

    /// Allocates a free node under `alloc_id` for the operation `op_id` (fenced: see
    /// [`DomainError::RolledBack`]), or returns the node already allocated under it. `None`: no
    /// node is free.
    pub async fn allocate(&self, alloc_id: &str, principal: &str, now: i64, op_id: &str) -> Result<Option<Node>> {
        if let Some(node) = self.allocation(alloc_id).await? {
            return Ok(Some(node));
        }
        // PostgreSQL replicas race for nodes: SKIP LOCKED hands each its own free row. SQLite has
        // one writer at a time, so the sub-select and update are atomic as one statement.
        let sql = if self.db.is_postgres() {
            "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 WHERE node_id = \
             (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1 FOR UPDATE SKIP LOCKED) \
             RETURNING node_id, cpu, memory_gb"
        } else {
            "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 WHERE node_id = \
             (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1) \
             RETURNING node_id, cpu, memory_gb"
        };
        let res = with_pool!(&self.db, p => {
            async {
                let mut tx = p.begin().await?;
                guard!(self, tx, op_id);
                let node = sqlx::query_as::<_, Node>(sql)
                    .bind(alloc_id).bind(principal).bind(now).fetch_optional(&mut *tx).await?;
                tx.commit().await?;
                Ok::<_, DomainError>(node)
            }.await
        });
        match res {
            Ok(node) => Ok(node),
            // A superseded attempt of the same request allocated concurrently: use its node.
            Err(DomainError::Db(e)) if is_unique_violation(&e) => self.allocation(alloc_id).await,
            Err(e) => Err(e),
        }
    }

    /// Like [`Domain::allocate`], but refuses a new allocation that would give `principal` more
    /// than `quota` nodes. The count and the allocation are one statement (SQLite's single
    /// writer) or one transaction serialized per principal by an advisory lock (PostgreSQL), so
    /// concurrent creates, on one replica or several, cannot overshoot it.
    pub async fn allocate_within(
        &self,
        alloc_id: &str,
        principal: &str,
        now: i64,
        quota: u32,
        op_id: &str,
    ) -> Result<Allocation> {
        if quota == 0 {
            return Ok(self
                .allocate(alloc_id, principal, now, op_id)
                .await?
                .map_or(Allocation::Exhausted, Allocation::Node));
        }
        if let Some(node) = self.allocation(alloc_id).await? {
            return Ok(Allocation::Node(node));
        }
        // One statement: the free node and the principal's count are read by the same write.
        const CAPPED_PG: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 WHERE node_id = \
             (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1 FOR UPDATE SKIP LOCKED) \
             AND (SELECT COUNT(*) FROM lb_nodes WHERE principal = $2) < $4 \
             RETURNING node_id, cpu, memory_gb";
        const CAPPED_SQLITE: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 WHERE node_id = \
             (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1) \
             AND (SELECT COUNT(*) FROM lb_nodes WHERE principal = $2) < $4 \
             RETURNING node_id, cpu, memory_gb";
        let quota = i64::from(quota);
        let postgres = self.db.is_postgres();
        let capped = if postgres { CAPPED_PG } else { CAPPED_SQLITE };
        let res = with_pool!(&self.db, p => {
            async {
                let mut tx = p.begin().await?;
                guard!(self, tx, op_id);
                if postgres {
                    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7541))")
                        .bind(principal).execute(&mut *tx).await?;
                }
                let node = sqlx::query_as::<_, Node>(capped)
                    .bind(alloc_id).bind(principal).bind(now).bind(quota)
                    .fetch_optional(&mut *tx).await?;
                tx.commit().await?;
                Ok::<_, DomainError>(node)
            }.await
        });
        match res {
            Ok(Some(node)) => Ok(Allocation::Node(node)),
            Ok(None) => {
                let held: i64 = with_pool!(&self.db, p => {
                    sqlx::query_scalar("SELECT COUNT(*) FROM lb_nodes WHERE principal = $1").bind(principal).fetch_one(p).await?
                });
                Ok(if held >= quota { Allocation::QuotaExceeded } else { Allocation::Exhausted })
            }
            Err(DomainError::Db(e)) if is_unique_violation(&e) => {
                Ok(self.allocation(alloc_id).await?.map_or(Allocation::Exhausted, Allocation::Node))
            }
            Err(e) => Err(e),
        }
    }

    async fn allocation(&self, alloc_id: &str) -> Result<Option<Node>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, Node>("SELECT node_id, cpu, memory_gb FROM lb_nodes WHERE alloc_id = $1")
                .bind(alloc_id)
                .fetch_optional(p)
                .await?
        }))
    }

    /// Inserts the lease `lease_id` on `node_id` for the operation `op_id` (fenced: see
    /// [`DomainError::RolledBack`]), or finds it. Returns the lease's node.
    pub async fn insert_lease(
        &self,
        lease_id: &str,
        node_id: &str,
        principal: &str,
        now: i64,
        op_id: &str,
    ) -> Result<String> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            sqlx::query("INSERT INTO lb_leases (lease_id, node_id, principal, created_at) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (lease_id) DO NOTHING")
                .bind(lease_id).bind(node_id).bind(principal).bind(now)
                .execute(&mut *tx).await?;
            let node = sqlx::query("SELECT node_id FROM lb_leases WHERE lease_id = $1")
                .bind(lease_id).fetch_one(&mut *tx).await?.try_get::<String, _>(0)?;
            tx.commit().await?;
            node
        }))
    }
}
