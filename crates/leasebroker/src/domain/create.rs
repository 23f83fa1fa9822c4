//! A create in two commits of leasebroker's own around its hypervisor call: everything before
//! the call (the attempt and the boot intent in the effect ledger, the allocation, the lease) in
//! one transaction, and everything after it (the VM the call made, the worker, the operation
//! finished) in another. Between them, `idempotency-effects` runs the call; what it made is
//! recorded by the second transaction (`Attempt::run_decided_unrecorded`).
//!
//! Each write inside keeps its own sub-key and `ON CONFLICT` rule, so a retry that finds some of
//! them done by an earlier attempt goes on from there, as with one transaction per step.

use idempotency_effects::{Attempt, Decided, Effect, EffectError, Made, Outcome};

use super::nodes::allocate_in;
use super::*;
use crate::db::with_pool;

/// The ledger's steps inside one of leasebroker's own transactions, on either database.
pub(crate) trait LedgerTx {
    /// [`Attempt::decide_in_sqlite`] / [`Attempt::decide_in_postgres`].
    async fn decide(&mut self, attempt: &Attempt, effect: &dyn Effect) -> std::result::Result<Decided, EffectError>;
    /// [`Attempt::finish_in_sqlite`] / [`Attempt::finish_in_postgres`].
    async fn finish(&mut self, attempt: &Attempt) -> std::result::Result<(), EffectError>;
    /// [`Attempt::finish_made_in_sqlite`] / [`Attempt::finish_made_in_postgres`].
    async fn finish_made(&mut self, attempt: &Attempt, made: &Made) -> std::result::Result<Outcome, EffectError>;
}

impl LedgerTx for sqlx::SqliteConnection {
    async fn decide(&mut self, attempt: &Attempt, effect: &dyn Effect) -> std::result::Result<Decided, EffectError> {
        attempt.decide_in_sqlite(self, effect).await
    }
    async fn finish(&mut self, attempt: &Attempt) -> std::result::Result<(), EffectError> {
        attempt.finish_in_sqlite(self).await
    }
    async fn finish_made(&mut self, attempt: &Attempt, made: &Made) -> std::result::Result<Outcome, EffectError> {
        attempt.finish_made_in_sqlite(self, made).await
    }
}

impl LedgerTx for sqlx::PgConnection {
    async fn decide(&mut self, attempt: &Attempt, effect: &dyn Effect) -> std::result::Result<Decided, EffectError> {
        attempt.decide_in_postgres(self, effect).await
    }
    async fn finish(&mut self, attempt: &Attempt) -> std::result::Result<(), EffectError> {
        attempt.finish_in_postgres(self).await
    }
    async fn finish_made(&mut self, attempt: &Attempt, made: &Made) -> std::result::Result<Outcome, EffectError> {
        attempt.finish_made_in_postgres(self, made).await
    }
}

/// What [`Domain::start_create`] committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateStart {
    /// The node and lease are held, and the boot intent decided.
    Held {
        /// The node allocated under the create's `alloc` sub-key (now, or by an earlier attempt).
        node: Node,
        /// The boot intent as the ledger decided it: [`Decided::Fresh`] when this call recorded
        /// it with its send stamp (the right to send the boot is this attempt's, once the commit
        /// came back in time); [`Decided::Existing`] when an earlier attempt recorded it.
        decided: Decided,
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
    /// The attempt (its operation is the create's record).
    pub attempt: &'a Attempt,
    /// The boot effect.
    pub boot: &'a dyn Effect,
    /// The principal.
    pub principal: &'a Principal,
    /// The allocation's sub-key.
    pub alloc_id: &'a str,
    /// The lease's public id.
    pub lease_id: &'a str,
    /// The worker's public id: when it exists, or its tombstone does, the create finished.
    pub worker_id: &'a WorkerId,
    /// The most nodes the principal may hold (0: no limit).
    pub quota: u32,
    /// Now (µs since the epoch).
    pub now: i64,
}

impl Domain {
    /// The first commit of a create: the attempt and the boot intent (the effect ledger's
    /// decide step: the intent is born with its send stamp when it is new), a node allocated
    /// under `alloc_id` (or the one allocated under it), and the lease, in one transaction.
    /// Errs with [`DomainError::RolledBack`] when the reaper took the operation for a rollback;
    /// answers [`CreateStart::Finished`] when the create finished.
    ///
    /// The ledger's step comes first: it is the fence (it writes the operation's row, so on
    /// PostgreSQL it locks that row and a rollback's mark waits for this transaction; on SQLite
    /// the transaction holds the write lock from that statement).
    ///
    /// A unique violation (an overlapping attempt of the same request allocated at the same
    /// moment) is returned as the error it is: the caller goes on step by step, where each step
    /// resolves it.
    pub async fn start_create(&self, s: StartCreate<'_>) -> Result<CreateStart> {
        let postgres = self.db.is_postgres();
        let (principal, now) = (s.principal.as_str(), s.now);
        with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let decided = match LedgerTx::decide(&mut *tx, s.attempt, s.boot).await {
                Ok(decided) => decided,
                Err(EffectError::Finished) => return Ok(CreateStart::Finished),
                Err(e) => return Err(e.into()),
            };
            // Decided here, under the attempt's lock, not before: a worker that exists or was
            // deleted means the create finished (an attempt that stalled after reading "no
            // worker" must not start it again). Nothing is written then. The same statement
            // reads the node an earlier attempt holds under the allocation's sub-key.
            let (finished, held) = sqlx::query_as::<_, (bool, Option<String>, Option<i64>, Option<i64>)>(
                "SELECT EXISTS (SELECT 1 FROM lb_workers WHERE worker_id = $1) \
                 OR EXISTS (SELECT 1 FROM lb_tombstones WHERE worker_id = $1), n.node_id, n.cpu, n.memory_gb \
                 FROM (SELECT 1 AS one) AS one LEFT JOIN lb_nodes n ON n.alloc_id = $2")
                .bind(s.worker_id.as_str()).bind(s.alloc_id).fetch_one(&mut *tx).await
                .map(|(finished, node_id, cpu, memory_gb)| {
                    let held = node_id.map(|node_id| Ok::<_, sqlx::Error>(Node {
                        node_id: NodeId::try_from(node_id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                        cpu: cpu.unwrap_or(0),
                        memory_gb: memory_gb.unwrap_or(0),
                    }));
                    held.transpose().map(|held| (finished, held))
                })??;
            if finished {
                tx.rollback().await?;
                return Ok(CreateStart::Finished);
            }
            let node = match held {
                Some(node) => node,
                None => match allocate_in!(tx, postgres, s.alloc_id, principal, now, s.quota) {
                    Some(node) => node,
                    None => {
                        // Refused before any side effect: nothing stays, not even the attempt's
                        // row or its intent (the reaper has nothing to look at).
                        tx.rollback().await?;
                        return Ok(CreateStart::Refused(self.refusal(principal, s.quota).await?));
                    }
                },
            };
            sqlx::query("INSERT INTO lb_leases (lease_id, node_id, principal, created_at) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (lease_id) DO NOTHING")
                .bind(s.lease_id).bind(node.node_id.as_str()).bind(principal).bind(now)
                .execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(CreateStart::Held { node, decided })
        })
    }

    /// The last commit of a create: finishes the operation in the ledger (its first statement,
    /// the fence: see [`DomainError::RolledBack`], [`DomainError::Finished`]) with the boot's VM
    /// when this attempt booted it (`boot`; the VM stays owned by the operation), inserts the
    /// worker with the VM the ledger holds (or finds the one an earlier attempt inserted under
    /// the same id) and counts the boot, in one transaction. Returns the worker and the boot's
    /// outcome as recorded (another VM than `boot`'s when an overlapping attempt recorded its
    /// own first: `boot`'s is then a duplicate).
    pub async fn finish_create(&self, attempt: &Attempt, boot: &Made, w: &WorkerRow) -> Result<(WorkerRow, Outcome)> {
        let (inserted, recorded) = with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let recorded = match LedgerTx::finish_made(&mut *tx, attempt, boot).await {
                Ok(recorded) => recorded,
                Err(e) => {
                    // Not live: the boot's record (when any) is kept for the reaper, nothing else
                    // was written.
                    if matches!(e, EffectError::Finished | EffectError::RolledBack) {
                        tx.commit().await?;
                    }
                    return Err(e.into());
                }
            };
            let vm_id = recorded.id();
            let inserted = sqlx::query("INSERT INTO lb_workers (worker_id, principal, image, cpu, memory_gb, labels, node_id, lease_id, \
                         vm_id, state, reboot_count, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                         ON CONFLICT (worker_id) DO NOTHING")
                .bind(w.worker_id.as_str()).bind(w.principal.as_str()).bind(&w.image).bind(w.cpu).bind(w.memory_gb)
                .bind(&w.labels).bind(w.node_id.as_str()).bind(&w.lease_id).bind(vm_id).bind(&w.state)
                .bind(w.reboot_count).bind(w.created_at)
                .execute(&mut *tx).await?.rows_affected() == 1;
            // Last: the counter's row stays locked until the commit (64 rows, so creates rarely meet).
            sqlx::query(COUNT_BOOT).bind(boot_counter(attempt.operation().id())).execute(&mut *tx).await?;
            tx.commit().await?;
            (inserted, recorded)
        });
        if inserted {
            return Ok((WorkerRow { vm_id: recorded.id().to_owned(), ..w.clone() }, recorded));
        }
        let worker = self.worker(&w.principal, &w.worker_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))?;
        Ok((worker, recorded))
    }

    /// The last commit of a reboot: finishes the operation in the ledger (the fence) with what
    /// this attempt's call did (`reboot`, when it ran one) and, when this call finished it,
    /// counts the reboot on the worker, in one transaction; an operation finished already
    /// counts nothing again. Returns the worker's reboot count.
    pub async fn finish_reboot(&self, attempt: &Attempt, reboot: Option<&Made>, worker_id: &WorkerId) -> Result<i64> {
        let worker_id = worker_id.as_str();
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let finished = match reboot {
                Some(made) => LedgerTx::finish_made(&mut *tx, attempt, made).await.map(drop),
                None => LedgerTx::finish(&mut *tx, attempt).await,
            };
            match finished {
                Ok(()) => {
                    sqlx::query("UPDATE lb_workers SET reboot_count = reboot_count + 1 WHERE worker_id = $1")
                        .bind(worker_id).execute(&mut *tx).await?;
                    sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'reboots'").execute(&mut *tx).await?;
                }
                Err(EffectError::Finished) => {} // an overlapping attempt counted it
                Err(e) => {
                    // Rolled back meanwhile: the reboot's record (when any) is kept for the
                    // reaper, nothing else was written.
                    if matches!(e, EffectError::RolledBack) {
                        tx.commit().await?;
                    }
                    return Err(e.into());
                }
            }
            let count: i64 = sqlx::query_scalar("SELECT reboot_count FROM lb_workers WHERE worker_id = $1")
                .bind(worker_id).fetch_optional(&mut *tx).await?.unwrap_or(0);
            tx.commit().await?;
            count
        }))
    }

    /// The last commit of a delete: finishes the operation in the ledger (the fence) and deletes
    /// the worker, its lease and its node's allocation with the tombstone `tombstone_id`, in one
    /// transaction. False when the worker was gone already (its tombstone says by whom).
    pub async fn finish_delete(
        &self,
        attempt: &Attempt,
        principal: &Principal,
        worker_id: &WorkerId,
        tombstone_id: &str,
        now: i64,
    ) -> Result<bool> {
        let (principal, worker_id) = (principal.as_str(), worker_id.as_str());
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            if let Err(e) = LedgerTx::finish(&mut *tx, attempt).await {
                tx.rollback().await?;
                return Err(e.into());
            }
            let deleted = super::workers::delete_worker_in!(tx, principal, worker_id, tombstone_id, now);
            tx.commit().await?;
            deleted
        }))
    }
}
