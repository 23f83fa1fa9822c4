//! leasebroker's tables: the node pool, leases, hypervisor intents, workers, and what the
//! reaper needs (operations, tombstones of deleted workers, counters).
//!
//! Every write that a retry could repeat is keyed by a sub-key derived from the request's
//! idempotency record and lands on a UNIQUE column, so a second attempt finds the first one's
//! row instead of writing another.

use serde::Serialize;
use sqlx::Row;

use crate::db::{Db, with_pool};
pub use idempotency::Principal;
pub use leasebroker_api::{NodeId, OperationId, WorkerId};

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
    /// The effect ledger failed otherwise (a row it cannot read back).
    #[error("effect ledger error")]
    Ledger(#[source] idempotency_effects::LedgerError),
    /// A row holds what the service never writes (an id that is not path-safe, an unknown
    /// worker state), so it cannot be shown.
    #[error("a row the service cannot show: {0}")]
    BadRow(String),
}

impl From<idempotency_effects::LedgerError> for DomainError {
    fn from(e: idempotency_effects::LedgerError) -> Self {
        use idempotency_effects::LedgerError;
        match e {
            LedgerError::Finished => Self::Finished,
            LedgerError::RolledBack => Self::RolledBack,
            // The ledger is on the same database: its outage is the database's.
            LedgerError::Unavailable(source) => match source.downcast::<sqlx::Error>() {
                Ok(e) => Self::Db(*e),
                Err(source) => Self::Ledger(LedgerError::Unavailable(source)),
            },
            e => Self::Ledger(e),
        }
    }
}

impl From<idempotency_effects::EffectError> for DomainError {
    fn from(e: idempotency_effects::EffectError) -> Self {
        use idempotency_effects::EffectError;
        match e {
            EffectError::Finished => Self::Finished,
            EffectError::RolledBack => Self::RolledBack,
            EffectError::Ledger(e) => e.into(),
            e => Self::Ledger(idempotency_effects::LedgerError::Unavailable(Box::new(e))),
        }
    }
}

type Result<T> = std::result::Result<T, DomainError>;

/// `sqlx::FromRow` for a row struct, by column name, on SQLite and PostgreSQL rows: what
/// `#[derive(sqlx::FromRow)]` writes, without sqlx's `macros` feature (which builds both database
/// drivers a second time, for the compiler). A field left out is a compile error. `field as
/// String` reads the column as a `String` and converts it into the field's type (a closed set
/// such as [`OperationState`](leasebroker_api::OperationState), stored as its wire name, or an id
/// such as [`WorkerId`]); a stored value the type refuses is a decode error.
macro_rules! from_row {
    ($ty:ident { $($field:ident $(as $raw:ty)?),+ $(,)? }) => {
        from_row!(@one $ty sqlx::sqlite::SqliteRow { $($field $(as $raw)?),+ });
        from_row!(@one $ty sqlx::postgres::PgRow { $($field $(as $raw)?),+ });
    };
    (@one $ty:ident $row:ty { $($field:ident $(as $raw:ty)?),+ }) => {
        impl<'r> sqlx::FromRow<'r, $row> for $ty {
            fn from_row(row: &'r $row) -> std::result::Result<Self, sqlx::Error> {
                use sqlx::Row as _;
                Ok(Self { $($field: from_row!(@get row $field $($raw)?)),+ })
            }
        }
    };
    (@get $row:ident $field:ident) => {
        $row.try_get(stringify!($field))?
    };
    (@get $row:ident $field:ident $raw:ty) => {
        TryFrom::try_from($row.try_get::<$raw, _>(stringify!($field))?)
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))?
    };
}

pub use create::{CreateStart, StartCreate};
pub use flashes::{FlashEnd, FlashRow, FlashStart, Resolved};
pub use nodes::{ALLOCATE_CAPPED_PG, ALLOCATE_CAPPED_SQLITE, ALLOCATE_PG, ALLOCATE_SQLITE};

/// A node allocated to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// `node-0001`...
    pub node_id: NodeId,
    /// CPUs.
    pub cpu: i64,
    /// Memory in GB.
    pub memory_gb: i64,
}

from_row!(Node { node_id as String, cpu, memory_gb });

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

/// What a create gave back (a refusal, or the reaper's rollback).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    /// Leases deleted (0 or 1).
    pub leases: u64,
    /// Nodes freed (0 or 1).
    pub nodes: u64,
}

/// A worker row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRow {
    /// `wkr-...`.
    pub worker_id: WorkerId,
    /// Its owner.
    pub principal: Principal,
    /// The image.
    pub image: String,
    /// CPUs.
    pub cpu: i64,
    /// Memory.
    pub memory_gb: i64,
    /// Labels as a JSON object.
    pub labels: String,
    /// Its node.
    pub node_id: NodeId,
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
    worker_id as String,
    principal as String,
    image,
    cpu,
    memory_gb,
    labels,
    node_id as String,
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
    ledger: std::sync::Arc<idempotency_effects::SqlLedger>,
}

/// The fence of a step of leasebroker's own tables taken outside the effect ledger (the
/// allocation and the lease of a create that overlapped another attempt): in the step's own
/// transaction, first, the operation's row in the ledger (`fx_operations`) must be there and
/// live (mark 0; 1 rolling back, 2 rolled back, 3 finished). On PostgreSQL the row is locked FOR
/// SHARE, so a rollback or a finish that marks it waits for the step, or the step for the mark
/// (and then sees it); on SQLite the statement is a write, so the transaction holds the one
/// write lock from its start.
const GUARD_PG: &str = "SELECT CAST(mark AS BIGINT) FROM fx_operations WHERE op_id = $1 FOR SHARE";
const GUARD_SQLITE: &str = "UPDATE fx_operations SET mark = mark WHERE op_id = $1 RETURNING CAST(mark AS BIGINT)";

/// The error of a step refused by the mark `mark` (`None`: no row).
pub(crate) fn refused_by(mark: Option<i64>) -> DomainError {
    idempotency_effects::LedgerError::refused_by(mark.and_then(idempotency_effects::Mark::from_i64)).into()
}

/// Runs the guard for `$op_id` in the transaction `$tx`: errs with [`DomainError::RolledBack`]
/// when the operation was taken for a rollback (or is gone), [`DomainError::Finished`] when it
/// finished.
macro_rules! guard {
    ($self:ident, $tx:ident, $op_id:expr) => {{
        let sql = if $self.db.is_postgres() { GUARD_PG } else { GUARD_SQLITE };
        let mark: Option<i64> = sqlx::query_scalar(sql).bind($op_id).fetch_optional(&mut *$tx).await?;
        if mark != Some(0) {
            return Err(refused_by(mark));
        }
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
mod nodes;
mod operations;
mod workers;

impl Domain {
    /// The domain on `db` (migrated already).
    pub fn new(db: Db) -> Self {
        let ledger = std::sync::Arc::new(db.ledger());
        Self { db, ledger }
    }

    /// The effect ledger on the same database.
    pub fn ledger(&self) -> std::sync::Arc<dyn idempotency_effects::Ledger> {
        self.ledger.clone()
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

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<()> {
        with_pool!(&self.db, p => { sqlx::query("SELECT 1").execute(p).await?; });
        Ok(())
    }
}
