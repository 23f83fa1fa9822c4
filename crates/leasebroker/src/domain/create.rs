//! A create in two commits around its hypervisor call: everything before the call (the
//! attempt, the allocation, the lease, the intent with its send stamp) in one transaction, and
//! everything after it (the VM, the worker, the operation finished) in another.
//!
//! Each write inside keeps its own sub-key and `ON CONFLICT` rule, so a retry that finds some of
//! them done by an earlier attempt goes on from there, as with one transaction per step.

use sqlx::Row;

use super::nodes::allocate_in;
use super::*;
use crate::db::with_pool;

/// What [`Domain::start_create`] committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateStart {
    /// The node and lease are held, and the boot intent as stored.
    Held {
        /// The node allocated under the create's `alloc` sub-key (now, or by an earlier attempt).
        node: Node,
        /// The boot intent.
        intent: Intent,
        /// True when this call recorded the intent, with its send stamp: the right to send the
        /// boot is this attempt's (once the commit came back in time). False: an earlier attempt
        /// recorded it, and the call must be reconciled first.
        created: bool,
    },
    /// No node was allocated: none is free, or the quota is reached. Nothing was written.
    Refused(Allocation),
    /// The create finished already (its worker exists, or was deleted since, or the operation
    /// is marked finished): nothing was written, and this attempt answers from what it left.
    Finished,
}

/// The sub-keys and values of a create's first commit.
#[derive(Debug, Clone, Copy)]
pub struct StartCreate<'a> {
    /// The operation's row (`begin_attempt`).
    pub op: &'a OperationRow,
    /// The allocation's sub-key.
    pub alloc_id: &'a str,
    /// The lease's public id.
    pub lease_id: &'a str,
    /// The boot intent's sub-key (the hypervisor tag).
    pub intent_id: &'a str,
    /// The worker's public id: when it exists, or its tombstone does, the create finished.
    pub worker_id: &'a str,
    /// The most nodes the principal may hold (0: no limit).
    pub quota: u32,
    /// When the reaper should first look at the operation (µs since the epoch).
    pub check_at: i64,
}

impl Domain {
    /// The first commit of a create: records the attempt, allocates a node under `alloc_id`
    /// (or finds the one allocated under it), inserts the lease, and records the boot intent,
    /// with its send stamp (taken in the transaction) if it is new, in one transaction. Errs with
    /// [`DomainError::RolledBack`] when the reaper took the operation for a rollback; answers
    /// [`CreateStart::Finished`] when the create finished.
    ///
    /// The attempt's write comes first: it is the rollback fence (on PostgreSQL it locks the
    /// operation's row, so a rollback's mark waits for this transaction; on SQLite the
    /// transaction holds the write lock from its first statement). A new intent is born with
    /// its send stamp: that is the compare-and-set from "no intent", so no other attempt can
    /// send between the record and the stamp.
    ///
    /// A unique violation (an overlapping attempt of the same request allocated at the same
    /// moment) is returned as the error it is: the caller goes on step by step, where each step
    /// resolves it.
    pub async fn start_create(&self, s: StartCreate<'_>) -> Result<CreateStart> {
        let postgres = self.db.is_postgres();
        let op = s.op;
        let principal = op.principal.as_str();
        let now = op.last_attempt_at;
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let written = sqlx::query(BEGIN_ATTEMPT)
                .bind(&op.op_id).bind(&op.kind).bind(principal).bind(&op.endpoint).bind(&op.idem_key)
                .bind(&op.record_id).bind(now).bind(s.check_at)
                .execute(&mut *tx).await?.rows_affected();
            if written == 0 {
                let mark: Option<i64> = sqlx::query_scalar("SELECT CAST(rolled_back AS BIGINT) FROM lb_operations WHERE op_id = $1")
                    .bind(&op.op_id).fetch_optional(&mut *tx).await?;
                return match refused_by(mark) {
                    DomainError::Finished => Ok(CreateStart::Finished),
                    refused => Err(refused),
                };
            }
            // Decided here, under the attempt's lock, not before: a worker that exists or was
            // deleted means the create finished (an attempt that stalled after reading "no
            // worker" must not start it again). Nothing is written then.
            let finished = sqlx::query("SELECT 1 FROM lb_workers WHERE worker_id = $1 \
                                        UNION ALL SELECT 1 FROM lb_tombstones WHERE worker_id = $1")
                .bind(s.worker_id).fetch_optional(&mut *tx).await?.is_some();
            if finished {
                tx.rollback().await?;
                return Ok(CreateStart::Finished);
            }
            let held = sqlx::query_as::<_, Node>("SELECT node_id, cpu, memory_gb FROM lb_nodes WHERE alloc_id = $1")
                .bind(s.alloc_id).fetch_optional(&mut *tx).await?;
            let node = match held {
                Some(node) => node,
                None => match allocate_in!(tx, postgres, s.alloc_id, principal, now, s.quota) {
                    Some(node) => node,
                    None => {
                        // Refused before any side effect: nothing stays, not even the attempt's
                        // row (the reaper has nothing to look at).
                        tx.rollback().await?;
                        return Ok(CreateStart::Refused(self.refusal(principal, s.quota).await?));
                    }
                },
            };
            sqlx::query("INSERT INTO lb_leases (lease_id, node_id, principal, created_at) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (lease_id) DO NOTHING")
                .bind(s.lease_id).bind(&node.node_id).bind(principal).bind(now)
                .execute(&mut *tx).await?;
            // The send stamp is taken here, holding the lock, not before waiting for it.
            let stamp = send_stamp(now);
            let created = sqlx::query("INSERT INTO lb_intents (intent_id, kind, state, created_at, last_attempt_at, op_id) \
                         VALUES ($1, 'boot', 'pending', $2, $3, $4) ON CONFLICT (intent_id) DO NOTHING")
                .bind(s.intent_id).bind(now).bind(stamp).bind(&op.op_id)
                .execute(&mut *tx).await?.rows_affected() == 1;
            let intent = sqlx::query_as::<_, Intent>(
                "SELECT intent_id, kind, state, vm_id, created_at, last_attempt_at FROM lb_intents WHERE intent_id = $1")
                .bind(s.intent_id).fetch_one(&mut *tx).await?;
            tx.commit().await?;
            Ok(CreateStart::Held { node, intent, created })
        })
    }

    /// The last commit of a create: marks the boot intent done with `vm_id` (the first VM
    /// recorded wins, and the worker gets that one), inserts the worker (or finds the one an
    /// earlier attempt inserted under the same id), and finishes the operation (its intents and
    /// its row deleted), in one transaction fenced like every step of a create (see
    /// [`DomainError::RolledBack`]).
    pub async fn finish_create(&self, intent_id: &str, vm_id: &str, w: &WorkerRow, op_id: &str) -> Result<WorkerRow> {
        let inserted = with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            let booted = sqlx::query("UPDATE lb_intents SET state = 'done', vm_id = $2 WHERE intent_id = $1 AND state <> 'done'")
                .bind(intent_id).bind(vm_id).execute(&mut *tx).await?.rows_affected();
            let recorded: Option<String> = sqlx::query("SELECT vm_id FROM lb_intents WHERE intent_id = $1")
                .bind(intent_id).fetch_optional(&mut *tx).await?
                .map(|r| r.try_get::<Option<String>, _>(0)).transpose()?.flatten();
            let vm_id = recorded.unwrap_or_else(|| vm_id.to_owned());
            let inserted = sqlx::query("INSERT INTO lb_workers (worker_id, principal, image, cpu, memory_gb, labels, node_id, lease_id, \
                         vm_id, state, reboot_count, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                         ON CONFLICT (worker_id) DO NOTHING")
                .bind(&w.worker_id).bind(&w.principal).bind(&w.image).bind(w.cpu).bind(w.memory_gb)
                .bind(&w.labels).bind(&w.node_id).bind(&w.lease_id).bind(&vm_id).bind(&w.state)
                .bind(w.reboot_count).bind(w.created_at)
                .execute(&mut *tx).await?.rows_affected() == 1;
            // The operation keeps a compact mark (its intents go), so no late attempt starts it again.
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            sqlx::query(MARK_FINISHED).bind(op_id).bind(crate::service::now_micros()).execute(&mut *tx).await?;
            // Last: the counter's row stays locked until the commit (64 rows, so creates rarely meet).
            if booted == 1 {
                sqlx::query(COUNT_BOOT).bind(boot_counter(intent_id)).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            inserted.then(|| WorkerRow { vm_id, ..w.clone() })
        });
        match inserted {
            Some(row) => Ok(row),
            None => self.worker(&w.principal, &w.worker_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound)),
        }
    }
}

/// [`Domain::begin_attempt`]'s statement: inserts the operation or moves its `last_attempt_at`
/// and the reaper's next look at it, unless it is rolled back, taken for a rollback, or finished
/// (then no row is written).
pub(super) const BEGIN_ATTEMPT: &str = "INSERT INTO lb_operations \
     (op_id, kind, principal, endpoint, idem_key, record_id, last_attempt_at, next_check_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
     ON CONFLICT (op_id) DO UPDATE SET last_attempt_at = EXCLUDED.last_attempt_at, next_check_at = EXCLUDED.next_check_at \
     WHERE lb_operations.rolled_back = 0";

/// Marks the live operation `$1` finished at `$2` (the mark's time, from which the retention
/// runs): kept, compact, so no attempt can start it again.
pub(super) const MARK_FINISHED: &str =
    "UPDATE lb_operations SET rolled_back = 3, last_attempt_at = $2 WHERE op_id = $1 AND rolled_back = 0";
