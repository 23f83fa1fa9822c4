//! Firmware-flash operations as the API shows them, and the one-running-flash-per-node fence.
//! The BMC call itself (its intent, its send stamp, the watcher's lease) is the effect ledger's.

use super::*;
use crate::db::with_pool;
use leasebroker_api::OperationState;

/// A firmware-flash operation, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashRow {
    /// `op-...`: a prefix and 16 hex digits of the request's derived sub-key `flash-op`.
    pub op_id: OperationId,
    /// The node whose BMC is flashed.
    pub node_id: NodeId,
    /// The firmware version.
    pub version: String,
    /// `running`, `succeeded`, `failed` or `uncertain` (stored as its wire name).
    pub state: OperationState,
    /// Why it failed.
    pub error: Option<String>,
    /// `accepted` once the BMC took the flash (or was found holding its tag); `unsent` before
    /// (the call's own state is its intent in the effect ledger).
    pub intent: String,
    /// The tag sent with the flash: the request's derived sub-key `flash` (also the id of its
    /// intent in the ledger).
    pub tag: String,
    /// When the operation was created (µs since the epoch).
    pub created_at: i64,
    /// When it ended.
    pub finished_at: Option<i64>,
    /// The operation's id in the effect ledger (the request's derived sub-key `op`).
    pub ledger_op: Option<String>,
    /// Where the flash's task is followed on the BMC (a path, from the accepted `SimpleUpdate`'s
    /// `Location` or a search by tag), on a Redfish BMC.
    pub task_uri: Option<String>,
    /// Why an operator resolved an `uncertain` operation as they did.
    pub resolution: Option<String>,
}

from_row!(FlashRow {
    op_id as String,
    node_id as String,
    version,
    state as String,
    error,
    intent,
    tag,
    created_at,
    finished_at,
    ledger_op,
    task_uri,
    resolution
});

impl FlashRow {
    /// Whether the operation's own course ended: succeeded, failed, or `uncertain` (which an
    /// operator ends).
    pub fn is_finished(&self) -> bool {
        self.state != OperationState::Running
    }

    /// Whether the operation ended `uncertain`: nothing more is done for it until an operator
    /// resolves it, and its node takes no other flash.
    pub fn is_uncertain(&self) -> bool {
        self.state == OperationState::Uncertain
    }

    /// Whether the BMC took the flash (or holds its tag).
    pub fn is_accepted(&self) -> bool {
        self.intent == "accepted"
    }
}

/// How a flash operation ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlashEnd {
    /// The node runs the version.
    Succeeded,
    /// It did not take; why.
    Failed(String),
    /// What came of it cannot be read (why): the node stays fenced until an operator resolves it.
    Uncertain(String),
}

impl FlashEnd {
    /// The operation's state: `succeeded`, `failed` or `uncertain` (also the `outcome` label of
    /// `leasebroker_operations_total`).
    pub fn state(&self) -> OperationState {
        match self {
            Self::Succeeded => OperationState::Succeeded,
            Self::Failed(_) => OperationState::Failed,
            Self::Uncertain(_) => OperationState::Uncertain,
        }
    }

    /// The operation's `error`: why it failed, or why its outcome is uncertain.
    pub fn error(&self) -> Option<&str> {
        match self {
            Self::Succeeded => None,
            Self::Failed(e) | Self::Uncertain(e) => Some(e),
        }
    }
}

/// What [`Domain::resolve_flash`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// The operation was `uncertain` and is resolved now: as it is now.
    Resolved(FlashRow),
    /// The operation is not `uncertain` (running, or ended already): as it is.
    NotUncertain(FlashRow),
    /// No such operation.
    NoOperation,
}

/// What [`Domain::start_flash`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlashStart {
    /// The operation of this request: created now, or by an earlier attempt.
    Operation(FlashRow),
    /// Another operation runs on the node, or ended `uncertain` there: this one was not created.
    Conflict(FlashRow),
    /// No such node in the pool.
    NoNode,
}

/// `SELECT <the row's columns> FROM lb_flash_operations <rest>`, as a literal.
macro_rules! select {
    ($rest:literal) => {
        concat!(
            "SELECT op_id, node_id, version, state, error, intent, tag, created_at, finished_at, ledger_op, \
             task_uri, resolution FROM lb_flash_operations ",
            $rest
        )
    };
}

impl Domain {
    /// The flash operation `op_id`.
    pub async fn flash_operation(&self, op_id: &OperationId) -> Result<Option<FlashRow>> {
        let op_id = op_id.as_str();
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!("WHERE op_id = $1")).bind(op_id).fetch_optional(p).await?
        }))
    }

    /// The flash operation whose BMC call carries `tag`.
    pub async fn flash_by_tag(&self, tag: &str) -> Result<Option<FlashRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!("WHERE tag = $1")).bind(tag).fetch_optional(p).await?
        }))
    }

    /// The operation that holds `node_id`, if any: running, or ended `uncertain`.
    pub async fn open_flash_on(&self, node_id: &NodeId) -> Result<Option<FlashRow>> {
        let node_id = node_id.as_str();
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!("WHERE node_id = $1 AND state IN ('running', 'uncertain')"))
                .bind(node_id).fetch_optional(p).await?
        }))
    }

    /// Whether the node is allocated: a worker holds it, or a create is taking it.
    pub async fn node_allocated(&self, node_id: &NodeId) -> Result<bool> {
        let node_id = node_id.as_str();
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_nodes WHERE node_id = $1 AND alloc_id IS NOT NULL")
                .bind(node_id).fetch_optional(p).await?.is_some()
        }))
    }

    /// Finds the operation `op_id` (its ledger operation `ledger_op`) or creates it, running,
    /// with its flash not sent yet. At most
    /// one operation holds a node, running or `uncertain` (a partial UNIQUE index): when another
    /// one holds it, this one is not created and that one is returned as a conflict.
    pub async fn start_flash(
        &self,
        op_id: &OperationId,
        ledger_op: &str,
        node: &NodeId,
        version: &str,
        tag: &str,
        now: i64,
    ) -> Result<FlashStart> {
        let node_id = node.as_str();
        // A conflicting operation can end between the failed insert and the read of it: then
        // the insert is tried again (a few times; a node flashed back to back is rare).
        for _ in 0..3 {
            if let Some(row) = self.flash_operation(op_id).await? {
                return Ok(FlashStart::Operation(row));
            }
            let node_exists = with_pool!(&self.db, p => {
                sqlx::query("SELECT 1 FROM lb_nodes WHERE node_id = $1").bind(node_id).fetch_optional(p).await?.is_some()
            });
            if !node_exists {
                return Ok(FlashStart::NoNode);
            }
            let inserted = with_pool!(&self.db, p => {
                sqlx::query("INSERT INTO lb_flash_operations \
                             (op_id, node_id, version, state, intent, tag, created_at, ledger_op) \
                             VALUES ($1, $2, $3, 'running', 'unsent', $4, $5, $6) ON CONFLICT (op_id) DO NOTHING")
                    .bind(op_id.as_str()).bind(node_id).bind(version).bind(tag).bind(now).bind(ledger_op)
                    .execute(p).await.map(|r| r.rows_affected())
            });
            match inserted {
                Ok(_) => continue, // read back above: ours, or an overlapping attempt's
                Err(e) if is_unique_violation(&e) => {
                    if let Some(running) = self.open_flash_on(node).await?
                        && running.op_id != *op_id
                    {
                        return Ok(FlashStart::Conflict(running));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        match self.open_flash_on(node).await? {
            Some(running) => Ok(FlashStart::Conflict(running)),
            None => Err(DomainError::Db(sqlx::Error::RowNotFound)),
        }
    }

    /// Records that the BMC took the flash (it answered, or it holds the tag), counting the flash
    /// once, and where its task is followed when the BMC said (`task`, a path on the BMC).
    /// Returns the row.
    pub async fn accept_flash(&self, op: &OperationId, task: Option<&str>) -> Result<FlashRow> {
        let op_id = op.as_str();
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let changed = sqlx::query("UPDATE lb_flash_operations SET intent = 'accepted' \
                                       WHERE op_id = $1 AND intent <> 'accepted' AND state = 'running'")
                .bind(op_id).execute(&mut *tx).await?.rows_affected();
            if changed == 1 {
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'flashes'").execute(&mut *tx).await?;
            }
            if let Some(task) = task {
                sqlx::query("UPDATE lb_flash_operations SET task_uri = $2 WHERE op_id = $1")
                    .bind(op_id).bind(task).execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        self.flash_operation(op).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))
    }

    /// Sets (or, with `None`, forgets) where the flash's task is followed.
    pub async fn follow_flash_task(&self, op_id: &OperationId, task: Option<&str>) -> Result<()> {
        let op_id = op_id.as_str();
        with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET task_uri = $2 WHERE op_id = $1")
                .bind(op_id).bind(task).execute(p).await?;
        });
        Ok(())
    }

    /// Ends a running operation whose flash was accepted. False when it had ended already.
    pub async fn finish_flash(&self, op_id: &OperationId, end: &FlashEnd, now: i64) -> Result<bool> {
        let op_id = op_id.as_str();
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET state = $2, error = $3, finished_at = $4 \
                         WHERE op_id = $1 AND state = 'running' AND intent = 'accepted'")
                .bind(op_id).bind(String::from(end.state())).bind(end.error()).bind(now).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Fails a running operation whose flash the BMC never took (refused, or never sent and
    /// abandoned). The caller holds the fence: the ledger's intent was refused (released), or
    /// its operation is taken for a rollback or finished, so no attempt can send it any more.
    /// False when the row moved on.
    pub async fn fail_unaccepted_flash(&self, op_id: &OperationId, error: &str, now: i64) -> Result<bool> {
        self.end_unaccepted_flash(op_id, &FlashEnd::Failed(error.to_owned()), now).await
    }

    /// Ends a running operation whose flash the BMC was never seen to take, fenced as
    /// [`Domain::fail_unaccepted_flash`] is: `failed`, `uncertain` (sent, and what came of it
    /// cannot be read), or `succeeded` (nothing needed flashing, or the inventory shows the
    /// version). False when the row moved on.
    pub async fn end_unaccepted_flash(&self, op_id: &OperationId, end: &FlashEnd, now: i64) -> Result<bool> {
        let op_id = op_id.as_str();
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET state = $4, error = $2, finished_at = $3 \
                         WHERE op_id = $1 AND state = 'running' AND intent <> 'accepted'")
                .bind(op_id).bind(end.error()).bind(now).bind(String::from(end.state())).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Ends an `uncertain` operation as an operator found the machine: `succeeded`, or `failed`
    /// (with the reason as its error); `reason` is kept either way. The node is free again. A
    /// flash the BMC was never seen to take and that the operator found done is counted as taken
    /// then (the fleet's `firmware_flashes_total`).
    pub async fn resolve_flash(&self, op: &OperationId, succeeded: bool, reason: &str, now: i64) -> Result<Resolved> {
        let op_id = op.as_str();
        let (state, error) = if succeeded {
            (OperationState::Succeeded, None)
        } else {
            (OperationState::Failed, Some(format!("resolved as failed by an operator: {reason}")))
        };
        let changed = with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let taken = sqlx::query("UPDATE lb_flash_operations SET intent = 'accepted' \
                                     WHERE op_id = $1 AND state = 'uncertain' AND intent <> 'accepted' AND $2")
                .bind(op_id).bind(succeeded).execute(&mut *tx).await?.rows_affected();
            if taken == 1 {
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'flashes'").execute(&mut *tx).await?;
            }
            let changed = sqlx::query("UPDATE lb_flash_operations SET state = $2, error = $3, resolution = $4, finished_at = $5 \
                                       WHERE op_id = $1 AND state = 'uncertain'")
                .bind(op_id).bind(String::from(state)).bind(error).bind(reason).bind(now).execute(&mut *tx).await?.rows_affected();
            tx.commit().await?;
            changed == 1
        });
        Ok(match self.flash_operation(op).await? {
            Some(row) if changed => Resolved::Resolved(row),
            Some(row) => Resolved::NotUncertain(row),
            None => Resolved::NoOperation,
        })
    }

    /// Up to `limit` running operations whose flash the BMC has not been seen to take, in id
    /// order after `after` (a pass goes round them with a cursor, so however many wait, every
    /// one is looked at in turn).
    pub async fn unaccepted_flashes(&self, after: &str, limit: u32) -> Result<Vec<FlashRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!(
                "WHERE state = 'running' AND intent <> 'accepted' AND op_id > $1 ORDER BY op_id LIMIT $2"))
                .bind(after).bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Records that a watcher saw `node_id` bricked.
    pub async fn note_bricked(&self, node_id: &NodeId, now: i64) -> Result<()> {
        let node_id = node_id.as_str();
        with_pool!(&self.db, p => {
            sqlx::query("INSERT INTO lb_bricked_nodes (node_id, seen_at) VALUES ($1, $2) ON CONFLICT (node_id) DO NOTHING")
                .bind(node_id).bind(now).execute(p).await?;
        });
        Ok(())
    }
}
