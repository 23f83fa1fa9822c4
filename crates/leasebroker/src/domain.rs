//! leasebroker's tables: the node pool, leases, hypervisor intents, workers, and what the
//! reaper needs (operations, tombstones of deleted workers, counters).
//!
//! Every write that a retry could repeat is keyed by a sub-key derived from the request's
//! idempotency record and lands on a UNIQUE column, so a second attempt finds the first one's
//! row instead of writing another.

use serde::Serialize;
use sqlx::Row;

use crate::db::{Db, with_pool};

/// An error of the domain tables.
#[derive(Debug, thiserror::Error)]
pub enum DomainError {
    /// The database failed.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// The operation was abandoned and the reaper took it to roll it back: an attempt that still
    /// runs (its claim went stale while it waited) must not take, call or show anything more.
    #[error("the operation was abandoned and is rolled back; this attempt stops")]
    RolledBack,
}

type Result<T> = std::result::Result<T, DomainError>;

/// A node allocated to a worker.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Node {
    /// `node-0001`...
    pub node_id: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory in GB.
    pub memory_gb: i64,
}

/// An intent to call the hypervisor, recorded before the call.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Intent {
    /// The derived sub-key; also the tag sent to the hypervisor.
    pub intent_id: String,
    /// `boot` or `reboot`.
    pub kind: String,
    /// `pending`, `done` or `failed`.
    pub state: String,
    /// The VM, once known.
    pub vm_id: Option<String>,
    /// When the intent was first recorded (µs since the epoch).
    pub created_at: i64,
    /// When the hypervisor was last called for it (µs since the epoch).
    pub last_attempt_at: i64,
}

/// A protected operation and the idempotency record it runs under, written at the start of
/// every attempt so the reaper can map the operation back to its record.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct OperationRow {
    /// The record's derived sub-key `op`.
    pub op_id: String,
    /// `create`, `delete` or `reboot`.
    pub kind: String,
    /// The record's principal.
    pub principal: String,
    /// The record's endpoint (`POST /v1/workers`).
    pub endpoint: String,
    /// The client's idempotency key.
    pub idem_key: String,
    /// The record's id, hex.
    pub record_id: String,
    /// When the last attempt started (µs since the epoch).
    pub last_attempt_at: i64,
}

/// What the reaper freed when it rolled back a create.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    /// Leases deleted (0 or 1).
    pub leases: u64,
    /// Nodes freed (0 or 1).
    pub nodes: u64,
    /// Operation rows deleted (0 when another replica's reaper got there first).
    pub operations: u64,
}

/// A worker row.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct WorkerRow {
    /// `wkr-...`.
    pub worker_id: String,
    /// Its owner.
    pub principal: String,
    /// The image.
    pub image: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory.
    pub memory_gb: i64,
    /// Labels as a JSON object.
    pub labels: String,
    /// Its node.
    pub node_id: String,
    /// Its lease.
    pub lease_id: String,
    /// Its VM.
    pub vm_id: String,
    /// `booting` or `running`.
    pub state: String,
    /// Reboots done, one per reboot key.
    pub reboot_count: i64,
    /// Creation time (µs since the epoch).
    pub created_at: i64,
}

/// The outcome of [`Domain::allocate_within`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocation {
    /// The node allocated under the id (now, or by an earlier attempt).
    Node(Node),
    /// No node is free.
    Exhausted,
    /// The principal holds its quota of nodes already.
    QuotaExceeded,
}

/// Counts for the fleet endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Nodes in the pool.
    pub nodes_total: i64,
    /// Nodes allocated.
    pub nodes_allocated: i64,
    /// Leases held.
    pub leases_active: i64,
    /// Workers that exist.
    pub workers_active: i64,
    /// Boot intents that completed, ever.
    pub boots_done: i64,
    /// Reboot intents that completed, ever.
    pub reboots_done: i64,
}

/// The domain tables on one database.
#[derive(Debug, Clone)]
pub struct Domain {
    db: Db,
}

/// The fence of a create's steps against the reaper: in the step's own transaction, first, the
/// operation row must still be there and not taken for a rollback. On PostgreSQL the row is
/// locked FOR SHARE, so a rollback that marks it waits for the step, or the step for the mark
/// (and then sees it); on SQLite the statement is a write, so the transaction holds the one
/// write lock from its start.
const GUARD_PG: &str = "SELECT 1 FROM lb_operations WHERE op_id = $1 AND rolled_back = 0 FOR SHARE";
const GUARD_SQLITE: &str = "UPDATE lb_operations SET rolled_back = 0 WHERE op_id = $1 AND rolled_back = 0 RETURNING 1";

/// Runs the guard for `$op_id` in the transaction `$tx`: errs with [`DomainError::RolledBack`]
/// when the operation was taken for a rollback (or finished and forgotten).
macro_rules! guard {
    ($self:ident, $tx:ident, $op_id:expr) => {{
        let sql = if $self.db.is_postgres() { GUARD_PG } else { GUARD_SQLITE };
        if sqlx::query(sql).bind($op_id).fetch_optional(&mut *$tx).await?.is_none() {
            return Err(DomainError::RolledBack);
        }
    }};
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| d.is_unique_violation())
}

impl Domain {
    /// The domain on `db` (migrated already).
    pub fn new(db: Db) -> Self {
        Self { db }
    }

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
        let res = match &self.db {
            Db::Postgres(p) => {
                async {
                    let mut tx = p.begin().await?;
                    guard!(self, tx, op_id);
                    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 7541))")
                        .bind(principal)
                        .execute(&mut *tx)
                        .await?;
                    let node = sqlx::query_as::<_, Node>(CAPPED_PG)
                        .bind(alloc_id)
                        .bind(principal)
                        .bind(now)
                        .bind(quota)
                        .fetch_optional(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok::<_, DomainError>(node)
                }
                .await
            }
            Db::Sqlite(p) => {
                async {
                    let mut tx = p.begin().await?;
                    guard!(self, tx, op_id);
                    let node = sqlx::query_as::<_, Node>(CAPPED_SQLITE)
                        .bind(alloc_id)
                        .bind(principal)
                        .bind(now)
                        .bind(quota)
                        .fetch_optional(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok::<_, DomainError>(node)
                }
                .await
            }
        };
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

    /// Records the intent `intent_id` of the operation `op_id` as pending if it is new (fenced:
    /// see [`DomainError::RolledBack`]); returns it as stored and whether this call created it.
    pub async fn begin_intent(&self, intent_id: &str, kind: &str, op_id: &str, now: i64) -> Result<(Intent, bool)> {
        let inserted = with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            let inserted = sqlx::query("INSERT INTO lb_intents (intent_id, kind, state, created_at, last_attempt_at, op_id) \
                         VALUES ($1, $2, 'pending', $3, $3, $4) ON CONFLICT (intent_id) DO NOTHING")
                .bind(intent_id).bind(kind).bind(now).bind(op_id)
                .execute(&mut *tx).await?.rows_affected() == 1;
            tx.commit().await?;
            inserted
        });
        let intent = self.intent(intent_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))?;
        Ok((intent, inserted))
    }

    /// Reads an intent.
    pub async fn intent(&self, intent_id: &str) -> Result<Option<Intent>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, Intent>(
                "SELECT intent_id, kind, state, vm_id, created_at, last_attempt_at FROM lb_intents WHERE intent_id = $1")
                .bind(intent_id).fetch_optional(p).await?
        }))
    }

    /// Takes the right to send the hypervisor call of a pending or failed intent of the
    /// operation `op_id` (fenced: see [`DomainError::RolledBack`]): moves its send stamp from
    /// `seen` (the stamp the caller read, and decided from) to `stamp`, by compare-and-set. False
    /// when the stamp moved since it was read: another attempt (one whose stale claim was taken
    /// over while it still ran) acted on the intent in between, so this one must not send.
    /// Called right before every send, the first one included; the settle window runs from the
    /// new stamp.
    pub async fn stamp_intent(&self, intent_id: &str, op_id: &str, seen: i64, stamp: i64) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            let stamped = sqlx::query("UPDATE lb_intents SET state = 'pending', last_attempt_at = $3 \
                         WHERE intent_id = $1 AND state <> 'done' AND last_attempt_at = $2")
                .bind(intent_id).bind(seen).bind(stamp).execute(&mut *tx).await?.rows_affected() == 1;
            tx.commit().await?;
            stamped
        }))
    }

    /// Marks an intent failed: the hypervisor definitely did not act on it.
    pub async fn fail_intent(&self, intent_id: &str) -> Result<()> {
        with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_intents SET state = 'failed' WHERE intent_id = $1 AND state = 'pending'")
                .bind(intent_id).execute(p).await?;
        });
        Ok(())
    }

    /// Marks a boot intent done with its VM; returns the VM recorded (the first one wins).
    pub async fn finish_boot(&self, intent_id: &str, vm_id: &str) -> Result<String> {
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let changed = sqlx::query("UPDATE lb_intents SET state = 'done', vm_id = $2 WHERE intent_id = $1 AND state <> 'done'")
                .bind(intent_id).bind(vm_id).execute(&mut *tx).await?.rows_affected();
            if changed == 1 {
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'boots'").execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        let intent = self.intent(intent_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))?;
        Ok(intent.vm_id.unwrap_or_else(|| vm_id.to_owned()))
    }

    /// Marks a reboot intent done and, if this call is the one that did, counts the reboot on
    /// the worker, in one transaction. Returns the worker's reboot count.
    pub async fn finish_reboot(&self, intent_id: &str, vm_id: &str, worker_id: &str) -> Result<i64> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let changed = sqlx::query("UPDATE lb_intents SET state = 'done', vm_id = $2 WHERE intent_id = $1 AND state <> 'done'")
                .bind(intent_id).bind(vm_id).execute(&mut *tx).await?.rows_affected();
            if changed == 1 {
                sqlx::query("UPDATE lb_workers SET reboot_count = reboot_count + 1 WHERE worker_id = $1")
                    .bind(worker_id).execute(&mut *tx).await?;
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'reboots'").execute(&mut *tx).await?;
            }
            let count: i64 = sqlx::query("SELECT reboot_count FROM lb_workers WHERE worker_id = $1")
                .bind(worker_id).fetch_optional(&mut *tx).await?
                .map(|r| r.try_get(0)).transpose()?.unwrap_or(0);
            tx.commit().await?;
            count
        }))
    }

    /// Inserts a worker, or finds the one a previous attempt inserted under the same id. The
    /// create `op_id` is finished with it: its intents and its row are deleted in the same
    /// transaction (a retry answers from the worker row).
    pub async fn insert_worker(&self, w: &WorkerRow, op_id: &str) -> Result<WorkerRow> {
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            sqlx::query("INSERT INTO lb_workers (worker_id, principal, image, cpu, memory_gb, labels, node_id, lease_id, \
                         vm_id, state, reboot_count, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                         ON CONFLICT (worker_id) DO NOTHING")
                .bind(&w.worker_id).bind(&w.principal).bind(&w.image).bind(w.cpu).bind(w.memory_gb)
                .bind(&w.labels).bind(&w.node_id).bind(&w.lease_id).bind(&w.vm_id).bind(&w.state)
                .bind(w.reboot_count).bind(w.created_at)
                .execute(&mut *tx).await?;
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM lb_operations WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        self.worker(&w.principal, &w.worker_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))
    }

    /// A principal's worker.
    pub async fn worker(&self, principal: &str, worker_id: &str) -> Result<Option<WorkerRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, WorkerRow>("SELECT * FROM lb_workers WHERE worker_id = $1 AND principal = $2")
                .bind(worker_id).bind(principal).fetch_optional(p).await?
        }))
    }

    /// A principal's workers after `cursor` (exclusive), in id order.
    pub async fn list_workers(&self, principal: &str, limit: u32, cursor: Option<&str>) -> Result<Vec<WorkerRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, WorkerRow>(
                "SELECT * FROM lb_workers WHERE principal = $1 AND worker_id > $2 ORDER BY worker_id LIMIT $3")
                .bind(principal).bind(cursor.unwrap_or("")).bind(i64::from(limit))
                .fetch_all(p).await?
        }))
    }

    /// Deletes a worker, its lease, and frees its node, and leaves the tombstone
    /// `tombstone_id`, in one transaction. False if it was already gone.
    pub async fn delete_worker(&self, principal: &str, worker_id: &str, tombstone_id: &str, now: i64) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let row = sqlx::query("DELETE FROM lb_workers WHERE worker_id = $1 AND principal = $2 RETURNING node_id, lease_id")
                .bind(worker_id).bind(principal).fetch_optional(&mut *tx).await?;
            let deleted = match row {
                Some(row) => {
                    let node_id: String = row.try_get(0)?;
                    let lease_id: String = row.try_get(1)?;
                    sqlx::query("DELETE FROM lb_leases WHERE lease_id = $1").bind(&lease_id).execute(&mut *tx).await?;
                    sqlx::query("UPDATE lb_nodes SET alloc_id = NULL, principal = NULL, allocated_at = NULL WHERE node_id = $1")
                        .bind(&node_id).execute(&mut *tx).await?;
                    sqlx::query("INSERT INTO lb_tombstones (tombstone_id, worker_id, principal, deleted_at) \
                                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING")
                        .bind(tombstone_id).bind(worker_id).bind(principal).bind(now).execute(&mut *tx).await?;
                    true
                }
                None => false,
            };
            tx.commit().await?;
            deleted
        }))
    }

    /// Counts for the fleet endpoint.
    pub async fn counts(&self) -> Result<Counts> {
        Ok(with_pool!(&self.db, p => {
            let row = sqlx::query(
                "SELECT (SELECT COUNT(*) FROM lb_nodes), \
                        (SELECT COUNT(*) FROM lb_nodes WHERE alloc_id IS NOT NULL), \
                        (SELECT COUNT(*) FROM lb_leases), \
                        (SELECT COUNT(*) FROM lb_workers), \
                        (SELECT value FROM lb_counters WHERE name = 'boots'), \
                        (SELECT value FROM lb_counters WHERE name = 'reboots')")
                .fetch_one(p).await?;
            Counts {
                nodes_total: row.try_get(0)?,
                nodes_allocated: row.try_get(1)?,
                leases_active: row.try_get(2)?,
                workers_active: row.try_get(3)?,
                boots_done: row.try_get(4)?,
                reboots_done: row.try_get(5)?,
            }
        }))
    }

    /// The worker a delete under `tombstone_id` deleted, if one did.
    pub async fn tombstone(&self, tombstone_id: &str) -> Result<Option<String>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT worker_id FROM lb_tombstones WHERE tombstone_id = $1")
                .bind(tombstone_id).fetch_optional(p).await?.map(|r| r.try_get::<String, _>(0)).transpose()?
        }))
    }

    /// Whether the worker `worker_id` was deleted (within the tombstones' retention).
    pub async fn is_deleted(&self, worker_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_tombstones WHERE worker_id = $1").bind(worker_id).fetch_optional(p).await?.is_some()
        }))
    }

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
            sqlx::query("INSERT INTO lb_operations (op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7) \
                         ON CONFLICT (op_id) DO UPDATE SET last_attempt_at = EXCLUDED.last_attempt_at \
                         WHERE lb_operations.rolled_back = 0")
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

    /// Whether a worker runs on the VM `vm_id`.
    pub async fn vm_in_use(&self, vm_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_workers WHERE vm_id = $1").bind(vm_id).fetch_optional(p).await?.is_some()
        }))
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<()> {
        with_pool!(&self.db, p => { sqlx::query("SELECT 1").execute(p).await?; });
        Ok(())
    }
}
