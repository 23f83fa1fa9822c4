//! The node pool and leases: allocation under a sub-key, within a principal's quota.

use sqlx::Row;

use super::*;
use crate::db::with_pool;

// The allocation statements (public for the tests that read their plans). The first free node
// in id order, read through the partial index `lb_nodes_free` (migration 0005): its first entry. PostgreSQL replicas race for nodes: SKIP LOCKED hands each its own free
// row. SQLite has one writer at a time, so the sub-select and update are atomic as one statement;
// `INDEXED BY` because SQLite's planner, without statistics, would rather read every free node
// through the UNIQUE index on `alloc_id` and sort them (and it errs if the index is missing).
// The `_CAPPED` forms also require the principal to hold fewer than `$4` nodes, counted by the
// same statement (`lb_nodes_by_principal`).
/// Allocates the first free node (PostgreSQL).
pub const ALLOCATE_PG: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 \
     WHERE node_id = (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1 FOR UPDATE SKIP LOCKED) \
     RETURNING node_id, cpu, memory_gb";
/// Allocates the first free node (SQLite).
pub const ALLOCATE_SQLITE: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 \
     WHERE node_id = (SELECT node_id FROM lb_nodes INDEXED BY lb_nodes_free WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1) \
     RETURNING node_id, cpu, memory_gb";
/// Allocates the first free node within a quota (PostgreSQL).
pub const ALLOCATE_CAPPED_PG: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 \
     WHERE node_id = (SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1 FOR UPDATE SKIP LOCKED) \
     AND (SELECT COUNT(*) FROM lb_nodes WHERE principal = $2) < $4 \
     RETURNING node_id, cpu, memory_gb";
/// Allocates the first free node within a quota (SQLite).
pub const ALLOCATE_CAPPED_SQLITE: &str = "UPDATE lb_nodes SET alloc_id = $1, principal = $2, allocated_at = $3 \
     WHERE node_id = (SELECT node_id FROM lb_nodes INDEXED BY lb_nodes_free WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1) \
     AND (SELECT COUNT(*) FROM lb_nodes WHERE principal = $2) < $4 \
     RETURNING node_id, cpu, memory_gb";

/// Allocates a free node under `$alloc_id` in the transaction `$tx`, within `$quota` (0: no
/// limit): `Some(node)`, or `None` when no node is free or the quota is reached. On PostgreSQL a
/// quota is serialized per principal by an advisory lock held to the end of the transaction.
macro_rules! allocate_in {
    ($tx:ident, $postgres:expr, $alloc_id:expr, $principal:expr, $now:expr, $quota:expr) => {{
        let quota = i64::from($quota);
        let sql = match ($postgres, quota > 0) {
            (true, false) => $crate::domain::ALLOCATE_PG,
            (false, false) => $crate::domain::ALLOCATE_SQLITE,
            (true, true) => $crate::domain::ALLOCATE_CAPPED_PG,
            (false, true) => $crate::domain::ALLOCATE_CAPPED_SQLITE,
        };
        if $postgres && quota > 0 {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7541))")
                .bind($principal)
                .execute(&mut *$tx)
                .await?;
        }
        let q = sqlx::query_as::<_, $crate::domain::Node>(sql).bind($alloc_id).bind($principal).bind($now);
        (if quota > 0 { q.bind(quota) } else { q }).fetch_optional(&mut *$tx).await?
    }};
}
pub(super) use allocate_in;

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
    /// [`DomainError::RolledBack`]), or returns the node already allocated under it; refuses a
    /// new allocation that would give `principal` more than `quota` nodes (0: no limit). The
    /// count and the allocation are one statement (SQLite's single writer) or one transaction
    /// serialized per principal by an advisory lock (PostgreSQL), so concurrent creates, on one
    /// replica or several, cannot overshoot it.
    pub async fn allocate_within(
        &self,
        alloc_id: &str,
        principal: &Principal,
        now: i64,
        quota: u32,
        op_id: &str,
    ) -> Result<Allocation> {
        let principal = principal.as_str();
        if let Some(node) = self.allocation(alloc_id).await? {
            return Ok(Allocation::Node(node));
        }
        let postgres = self.db.is_postgres();
        let res = with_pool!(&self.db, p => {
            async {
                let mut tx = p.begin().await?;
                guard!(self, tx, op_id);
                let node = allocate_in!(tx, postgres, alloc_id, principal, now, quota);
                tx.commit().await?;
                Ok::<_, DomainError>(node)
            }.await
        });
        match res {
            Ok(Some(node)) => Ok(Allocation::Node(node)),
            Ok(None) => self.refusal(principal, quota).await,
            // A superseded attempt of the same request allocated concurrently: use its node.
            Err(DomainError::Db(e)) if is_unique_violation(&e) => {
                Ok(self.allocation(alloc_id).await?.map_or(Allocation::Exhausted, Allocation::Node))
            }
            Err(e) => Err(e),
        }
    }

    /// Why no node was allocated to `principal`: its quota, or no free node.
    pub(super) async fn refusal(&self, principal: &str, quota: u32) -> Result<Allocation> {
        if quota == 0 {
            return Ok(Allocation::Exhausted);
        }
        let held: i64 = with_pool!(&self.db, p => {
            sqlx::query_scalar("SELECT COUNT(*) FROM lb_nodes WHERE principal = $1").bind(principal).fetch_one(p).await?
        });
        Ok(if held >= i64::from(quota) { Allocation::QuotaExceeded } else { Allocation::Exhausted })
    }

    pub(super) async fn allocation(&self, alloc_id: &str) -> Result<Option<Node>> {
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
        node_id: &NodeId,
        principal: &Principal,
        now: i64,
        op_id: &str,
    ) -> Result<NodeId> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            sqlx::query("INSERT INTO lb_leases (lease_id, node_id, principal, created_at) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (lease_id) DO NOTHING")
                .bind(lease_id).bind(node_id.as_str()).bind(principal.as_str()).bind(now)
                .execute(&mut *tx).await?;
            let node = sqlx::query("SELECT node_id FROM lb_leases WHERE lease_id = $1")
                .bind(lease_id).fetch_one(&mut *tx).await?.try_get::<String, _>(0)?;
            tx.commit().await?;
            NodeId::try_from(node).map_err(|e| sqlx::Error::Decode(Box::new(e)))?
        }))
    }
}
