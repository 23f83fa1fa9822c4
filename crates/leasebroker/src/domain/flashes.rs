//! Firmware-flash operations: the row (with its BMC intent), the one-running-flash-per-node fence,
//! the send stamp taken by compare-and-set, and the watcher's lease on the row.

use super::*;
use crate::db::with_pool;

/// A firmware-flash operation, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashRow {
    /// `op-...`: a prefix and 16 hex digits of the request's derived sub-key `flash-op`.
    pub op_id: String,
    /// The node whose BMC is flashed.
    pub node_id: String,
    /// The firmware version.
    pub version: String,
    /// `running`, `succeeded` or `failed`.
    pub state: String,
    /// Why it failed.
    pub error: Option<String>,
    /// The BMC call: `unsent` (definitely not sent), `pending` (sent at `sent_at`, outcome
    /// unknown) or `accepted`.
    pub intent: String,
    /// The tag sent with the flash: the request's derived sub-key `flash`.
    pub tag: String,
    /// When the flash was last sent (µs since the epoch; 0 before the first send).
    pub sent_at: i64,
    /// When the operation was created (µs since the epoch).
    pub created_at: i64,
    /// When it ended.
    pub finished_at: Option<i64>,
    /// The watcher holding the lease on the row, if any.
    pub watcher: Option<String>,
    /// Until when that lease holds (µs since the epoch).
    pub watch_until: i64,
}

from_row!(FlashRow {
    op_id,
    node_id,
    version,
    state,
    error,
    intent,
    tag,
    sent_at,
    created_at,
    finished_at,
    watcher,
    watch_until
});

impl FlashRow {
    /// Whether the operation ended.
    pub fn is_finished(&self) -> bool {
        self.state != "running"
    }

    /// Whether the BMC took the flash (or holds its tag).
    pub fn is_accepted(&self) -> bool {
        self.intent == "accepted"
    }
}

/// What [`Domain::start_flash`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlashStart {
    /// The operation of this request: created now, or by an earlier attempt.
    Operation(FlashRow),
    /// Another operation runs on the node: this one was not created.
    Conflict(FlashRow),
    /// No such node in the pool.
    NoNode,
}

/// `SELECT <the row's columns> FROM lb_flash_operations <rest>`, as a literal.
macro_rules! select {
    ($rest:literal) => {
        concat!(
            "SELECT op_id, node_id, version, state, error, intent, tag, sent_at, created_at, finished_at, \
             watcher, watch_until FROM lb_flash_operations ",
            $rest
        )
    };
}

impl Domain {
    /// The flash operation `op_id`.
    pub async fn flash_operation(&self, op_id: &str) -> Result<Option<FlashRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!("WHERE op_id = $1")).bind(op_id).fetch_optional(p).await?
        }))
    }

    /// The operation running on `node_id`, if any.
    pub async fn running_flash_on(&self, node_id: &str) -> Result<Option<FlashRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!("WHERE node_id = $1 AND state = 'running'")).bind(node_id).fetch_optional(p).await?
        }))
    }

    /// Whether the node is allocated: a worker holds it, or a create is taking it.
    pub async fn node_allocated(&self, node_id: &str) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("SELECT 1 FROM lb_nodes WHERE node_id = $1 AND alloc_id IS NOT NULL")
                .bind(node_id).fetch_optional(p).await?.is_some()
        }))
    }

    /// Finds the operation `op_id` or creates it, running, with its flash not sent yet. At most
    /// one operation runs per node (a partial UNIQUE index): when another one runs there, this
    /// one is not created and the running one is returned as a conflict.
    pub async fn start_flash(
        &self,
        op_id: &str,
        node_id: &str,
        version: &str,
        tag: &str,
        now: i64,
    ) -> Result<FlashStart> {
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
                             (op_id, node_id, version, state, intent, tag, sent_at, created_at) \
                             VALUES ($1, $2, $3, 'running', 'unsent', $4, 0, $5) ON CONFLICT (op_id) DO NOTHING")
                    .bind(op_id).bind(node_id).bind(version).bind(tag).bind(now)
                    .execute(p).await.map(|r| r.rows_affected())
            });
            match inserted {
                Ok(_) => continue, // read back above: ours, or an overlapping attempt's
                Err(e) if is_unique_violation(&e) => {
                    if let Some(running) = self.running_flash_on(node_id).await?
                        && running.op_id != op_id
                    {
                        return Ok(FlashStart::Conflict(running));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        match self.running_flash_on(node_id).await? {
            Some(running) => Ok(FlashStart::Conflict(running)),
            None => Err(DomainError::Db(sqlx::Error::RowNotFound)),
        }
    }

    /// Takes the right to send the flash of a running, not accepted operation: moves its send
    /// stamp from `seen` to a new one by compare-and-set (`stamp_send!`, the same fence as
    /// boots and reboots, taken once the row is locked). `None` when the stamp moved since it was
    /// read, or the operation ended.
    pub async fn stamp_flash(&self, op_id: &str, seen: i64) -> Result<Option<i64>> {
        let lock = if self.db.is_postgres() {
            "SELECT 1 FROM lb_flash_operations WHERE op_id = $1 FOR UPDATE"
        } else {
            "UPDATE lb_flash_operations SET sent_at = sent_at WHERE op_id = $1"
        };
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            sqlx::query(lock).bind(op_id).execute(&mut *tx).await?;
            let stamped = stamp_send!(tx, "UPDATE lb_flash_operations SET intent = 'pending', sent_at = $3 \
                         WHERE op_id = $1 AND state = 'running' AND intent <> 'accepted' AND sent_at = $2", op_id, seen);
            tx.commit().await?;
            stamped
        }))
    }

    /// Marks the flash sent at `stamp` as definitely not sent (nothing left this process), so the
    /// next attempt may send it without waiting out the settle window.
    pub async fn unsend_flash(&self, op_id: &str, stamp: i64) -> Result<()> {
        with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET intent = 'unsent' \
                         WHERE op_id = $1 AND intent = 'pending' AND sent_at = $2")
                .bind(op_id).bind(stamp).execute(p).await?;
        });
        Ok(())
    }

    /// Records that the BMC took the flash (it answered, or it holds the tag), counting the flash
    /// once. Returns the row.
    pub async fn accept_flash(&self, op_id: &str) -> Result<FlashRow> {
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let changed = sqlx::query("UPDATE lb_flash_operations SET intent = 'accepted' \
                                       WHERE op_id = $1 AND intent <> 'accepted' AND state = 'running'")
                .bind(op_id).execute(&mut *tx).await?.rows_affected();
            if changed == 1 {
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'flashes'").execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        self.flash_operation(op_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))
    }

    /// Ends a running operation whose flash was accepted: `succeeded`, or `failed` with `error`.
    /// False when it had ended already.
    pub async fn finish_flash(&self, op_id: &str, succeeded: bool, error: Option<&str>, now: i64) -> Result<bool> {
        let state = if succeeded { "succeeded" } else { "failed" };
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET state = $2, error = $3, finished_at = $4, watcher = NULL \
                         WHERE op_id = $1 AND state = 'running' AND intent = 'accepted'")
                .bind(op_id).bind(state).bind(error).bind(now).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Fails a running operation whose flash the BMC never took: refused (sent at `sent_at`), or
    /// never sent and abandoned. Compare-and-set on the send stamp, so an attempt that sent the
    /// flash since keeps it. False when the row moved on.
    pub async fn fail_unaccepted_flash(&self, op_id: &str, sent_at: i64, error: &str, now: i64) -> Result<bool> {
        self.end_unaccepted_flash(op_id, sent_at, false, Some(error), now).await
    }

    /// Ends a running operation whose flash the BMC was never seen to take, by compare-and-set
    /// on the send stamp as [`Domain::fail_unaccepted_flash`] does: `failed` with `error`, or
    /// `succeeded` when nothing needed flashing (the node already runs the version). False when
    /// the row moved on.
    pub async fn end_unaccepted_flash(
        &self,
        op_id: &str,
        sent_at: i64,
        succeeded: bool,
        error: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        let state = if succeeded { "succeeded" } else { "failed" };
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET state = $5, error = $3, finished_at = $4, watcher = NULL \
                         WHERE op_id = $1 AND state = 'running' AND intent <> 'accepted' AND sent_at = $2")
                .bind(op_id).bind(sent_at).bind(error).bind(now).bind(state).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Up to `limit` running operations whose watch lease has expired (or is held by `watcher`),
    /// the least recently watched first: each pass takes (and so renews) the lease of what it
    /// watches, which puts those rows last, so however many operations wait unaccepted, every
    /// one is watched in turn.
    pub async fn flashes_to_watch(&self, watcher: &str, now: i64, limit: u32) -> Result<Vec<FlashRow>> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query_as::<_, FlashRow>(select!(
                "WHERE state = 'running' AND (watch_until < $1 OR watcher = $2) ORDER BY watch_until, op_id LIMIT $3")).bind(now).bind(watcher).bind(i64::from(limit)).fetch_all(p).await?
        }))
    }

    /// Takes (or renews) the watch lease on a running operation for `watcher` until `until`, by
    /// compare-and-set on the lease as it was read (`seen_until`): of several replicas that read
    /// one expired lease, one takes it. False when another took it first or the operation ended.
    pub async fn take_watch(&self, op_id: &str, watcher: &str, seen_until: i64, until: i64) -> Result<bool> {
        Ok(with_pool!(&self.db, p => {
            sqlx::query("UPDATE lb_flash_operations SET watcher = $2, watch_until = $4 \
                         WHERE op_id = $1 AND state = 'running' AND watch_until = $3")
                .bind(op_id).bind(watcher).bind(seen_until).bind(until).execute(p).await?.rows_affected() == 1
        }))
    }

    /// Records that a watcher saw `node_id` bricked.
    pub async fn note_bricked(&self, node_id: &str, now: i64) -> Result<()> {
        with_pool!(&self.db, p => {
            sqlx::query("INSERT INTO lb_bricked_nodes (node_id, seen_at) VALUES ($1, $2) ON CONFLICT (node_id) DO NOTHING")
                .bind(node_id).bind(now).execute(p).await?;
        });
        Ok(())
    }
}
