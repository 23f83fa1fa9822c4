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
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// The operation was abandoned and the reaper took it to roll it back: an attempt that still
    /// runs (its claim went stale while it waited) must not take, call or show anything more.
    #[error("the operation was abandoned and is rolled back; this attempt stops")]
    RolledBack,
    /// The operation finished (an overlapping attempt, or the reaper, ended it): an attempt that
    /// still runs must not start it again. Its result is what the finished attempt left (the
    /// worker, its tombstone, the reboot count).
    #[error("the operation finished; this attempt stops")]
    Finished,
}

type Result<T> = std::result::Result<T, DomainError>;

/// `sqlx::FromRow` for a row struct, by column name, on SQLite and PostgreSQL rows: what
/// `#[derive(sqlx::FromRow)]` writes, without sqlx's `macros` feature (which builds both database
/// drivers a second time, for the compiler). A field left out is a compile error.
macro_rules! from_row {
    ($ty:ident { $($field:ident),+ $(,)? }) => {
        from_row!(@one $ty sqlx::sqlite::SqliteRow { $($field),+ });
        from_row!(@one $ty sqlx::postgres::PgRow { $($field),+ });
    };
    (@one $ty:ident $row:ty { $($field:ident),+ }) => {
        impl<'r> sqlx::FromRow<'r, $row> for $ty {
            fn from_row(row: &'r $row) -> std::result::Result<Self, sqlx::Error> {
                use sqlx::Row as _;
                Ok(Self { $($field: row.try_get(stringify!($field))?),+ })
            }
        }
    };
}

pub use create::{CreateStart, StartCreate};
pub use flashes::{FlashRow, FlashStart};
pub use nodes::{ALLOCATE_CAPPED_PG, ALLOCATE_CAPPED_SQLITE, ALLOCATE_PG, ALLOCATE_SQLITE};

/// A node allocated to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// `node-0001`...
    pub node_id: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory in GB.
    pub memory_gb: i64,
}

from_row!(Node { node_id, cpu, memory_gb });

/// An intent to call the hypervisor, recorded before the call.
#[derive(Debug, Clone, PartialEq, Eq)]
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

from_row!(Intent { intent_id, kind, state, vm_id, created_at, last_attempt_at });

/// A protected operation and the idempotency record it runs under, written at the start of
/// every attempt so the reaper can map the operation back to its record.
#[derive(Debug, Clone, PartialEq, Eq)]
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

from_row!(OperationRow { op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at });

/// A live operation, as the console lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveOperation {
    /// The record's derived sub-key `op`.
    pub op_id: String,
    /// `create`, `delete` or `reboot`.
    pub kind: String,
    /// The record's principal.
    pub principal: String,
    /// The record's endpoint.
    pub endpoint: String,
    /// The client's idempotency key.
    pub idem_key: String,
    /// When the last attempt started (µs since the epoch).
    pub last_attempt_at: i64,
    /// 1 when the reaper is rolling it back.
    pub rolling_back: i32,
}

from_row!(LiveOperation { op_id, kind, principal, endpoint, idem_key, last_attempt_at, rolling_back });

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
#[derive(Debug, Clone, PartialEq, Eq)]
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

from_row!(WorkerRow {
    worker_id,
    principal,
    image,
    cpu,
    memory_gb,
    labels,
    node_id,
    lease_id,
    vm_id,
    state,
    reboot_count,
    created_at
});

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
    /// Firmware flashes the BMCs took, ever.
    pub flashes_done: i64,
    /// Nodes a watcher saw bricked.
    pub nodes_bricked: i64,
}

/// The domain tables on one database.
#[derive(Debug, Clone)]
pub struct Domain {
    db: Db,
}

/// The marks of an operation's row (`lb_operations.rolled_back`): 0 live; 1 taken by the reaper
/// for a rollback; 2 rolled back; 3 finished. A rolled-back or finished row is kept, compact (its
/// intents deleted), until the retention passes, so no attempt that outlived its claim can start
/// the operation again: `BEGIN_ATTEMPT` and every step refuse it in their own transaction.
pub(crate) const LIVE: i64 = 0;
/// See [`LIVE`].
pub(crate) const FINISHED: i64 = 3;

/// The fence of an operation's steps: in the step's own transaction, first, the operation row
/// must still be there and live. On PostgreSQL the row is locked FOR SHARE, so a rollback or a
/// finish that marks it waits for the step, or the step for the mark (and then sees it); on
/// SQLite the statement is a write, so the transaction holds the one write lock from its start.
const GUARD_PG: &str = "SELECT CAST(rolled_back AS BIGINT) FROM lb_operations WHERE op_id = $1 FOR SHARE";
const GUARD_SQLITE: &str =
    "UPDATE lb_operations SET rolled_back = rolled_back WHERE op_id = $1 RETURNING CAST(rolled_back AS BIGINT)";

/// The error of a step refused by the mark `mark` (`None`: no row).
pub(crate) fn refused_by(mark: Option<i64>) -> DomainError {
    if mark == Some(FINISHED) { DomainError::Finished } else { DomainError::RolledBack }
}

/// Runs the guard for `$op_id` in the transaction `$tx`: errs with [`DomainError::RolledBack`]
/// when the operation was taken for a rollback (or is gone), [`DomainError::Finished`] when it
/// finished.
macro_rules! guard {
    ($self:ident, $tx:ident, $op_id:expr) => {{
        let sql = if $self.db.is_postgres() { GUARD_PG } else { GUARD_SQLITE };
        let mark: Option<i64> = sqlx::query_scalar(sql).bind($op_id).fetch_optional(&mut *$tx).await?;
        if mark != Some(LIVE) {
            return Err(refused_by(mark));
        }
    }};
}

/// How far ahead of the clock a call's send stamp lies: the longest the stamp's commit may take
/// for the call still to be sent (`service::stamped_in_time`).
const SEND_STAMP_AHEAD_MICROS: i64 = 1_000_000;
/// [`SEND_STAMP_AHEAD_MICROS`] as a duration.
pub(crate) const SEND_STAMP_AHEAD: std::time::Duration =
    std::time::Duration::from_micros(SEND_STAMP_AHEAD_MICROS as u64);

/// The send stamp of a call about to be sent, for an intent whose stamp was `seen`: a little
/// ahead of the clock, and always past `seen` (so the compare-and-set moves it). Taken only
/// inside the transaction that decides to send, once it holds its lock (the SQLite write lock,
/// the PostgreSQL row lock): a wait for a connection or a lock never eats into the time ahead.
pub(crate) fn send_stamp(seen: i64) -> i64 {
    crate::service::now_micros().saturating_add(SEND_STAMP_AHEAD_MICROS).max(seen + 1)
}

/// The one send-stamp compare-and-set of every fenced call (boot, reboot, flash), run in `$tx`
/// after it took its lock: `$cas` moves the stamp of row `$id` (`$1`) from `$seen` (`$2`) to a
/// new stamp (`$3`). Evaluates to the new stamp, or `None` when the stamp moved since it was
/// read (another attempt acted on the call in between: this one must not send).
macro_rules! stamp_send {
    ($tx:ident, $cas:expr, $id:expr, $seen:expr) => {{
        let seen: i64 = $seen;
        let stamp = $crate::domain::send_stamp(seen);
        let moved = sqlx::query($cas).bind($id).bind(seen).bind(stamp).execute(&mut *$tx).await?.rows_affected() == 1;
        moved.then_some(stamp)
    }};
}

/// Counts one boot, on one of the 64 rows of the boots counter (migration 0005): the one `tag`
/// falls on. Concurrent creates count on different rows, so none waits for another's commit.
const COUNT_BOOT: &str = "UPDATE lb_counters SET value = value + 1 WHERE name = $1";

fn boot_counter(tag: &str) -> String {
    let h = tag.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    format!("boots:{}", h % 64)
}

pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| d.is_unique_violation())
}

mod create;
mod flashes;
mod intents;
mod nodes;
mod operations;
mod workers;

impl Domain {
    /// The domain on `db` (migrated already).
    pub fn new(db: Db) -> Self {
        Self { db }
    }

    /// Counts for the fleet endpoint.
    pub async fn counts(&self) -> Result<Counts> {
        Ok(with_pool!(&self.db, p => {
            let row = sqlx::query(
                "SELECT (SELECT COUNT(*) FROM lb_nodes), \
                        (SELECT COUNT(*) FROM lb_nodes WHERE alloc_id IS NOT NULL), \
                        (SELECT COUNT(*) FROM lb_leases), \
                        (SELECT COUNT(*) FROM lb_workers), \
                        (SELECT CAST(SUM(value) AS BIGINT) FROM lb_counters WHERE name = 'boots' OR name LIKE 'boots:%'), \
                        (SELECT value FROM lb_counters WHERE name = 'reboots'), \
                        (SELECT value FROM lb_counters WHERE name = 'flashes'), \
                        (SELECT COUNT(*) FROM lb_bricked_nodes)")
                .fetch_one(p).await?;
            Counts {
                nodes_total: row.try_get(0)?,
                nodes_allocated: row.try_get(1)?,
                leases_active: row.try_get(2)?,
                workers_active: row.try_get(3)?,
                boots_done: row.try_get(4)?,
                reboots_done: row.try_get(5)?,
                flashes_done: row.try_get(6)?,
                nodes_bricked: row.try_get(7)?,
            }
        }))
    }

    /// Whether a worker runs on the VM `vm_id`.
    pub async fn vm_in_use(&self, vm_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_workers WHERE vm_id = $1").bind(vm_id).fetch_optional(p).await?.is_some()
        }))
    }

    /// Whether anything owns the VM `vm_id` tagged `tag`, for the inventory sweep: a worker runs
    /// on it, or the boot intent `tag` exists and its operation is live (or legacy, without an
    /// operation), or its last send is not older than `settled_before` (a call that may still
    /// be decided on). One statement, so one snapshot: a create that finishes meanwhile is seen
    /// either with its intent or with its worker.
    pub async fn vm_owned(&self, tag: &str, vm_id: &str, settled_before: i64) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_workers WHERE vm_id = $2 \
                         UNION ALL \
                         SELECT 1 FROM lb_intents i LEFT JOIN lb_operations o ON o.op_id = i.op_id \
                         WHERE i.intent_id = $1 AND (i.op_id IS NULL OR o.rolled_back < 2 OR i.last_attempt_at > $3)")
                .bind(tag).bind(vm_id).bind(settled_before).fetch_optional(p).await?.is_some()
        }))
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<()> {
        with_pool!(&self.db, p => { sqlx::query("SELECT 1").execute(p).await?; });
        Ok(())
    }
}
