//! Hypervisor intents: recorded before the call, stamped by compare-and-set before each send.

use sqlx::Row;

use super::*;
use crate::db::with_pool;

impl Domain {
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
    /// `seen` (the stamp the caller read, and decided from) to a new one, by compare-and-set
    /// ([`stamp_send!`], taken once the guard holds the lock). `None` when the stamp moved since
    /// it was read: another attempt (one whose stale claim was taken over while it still ran)
    /// acted on the intent in between, so this one must not send. Called right before every
    /// send, the first one included; the settle window runs from the new stamp.
    pub async fn stamp_intent(&self, intent_id: &str, op_id: &str, seen: i64) -> Result<Option<i64>> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            let stamped = stamp_send!(tx, "UPDATE lb_intents SET state = 'pending', last_attempt_at = $3 \
                         WHERE intent_id = $1 AND state <> 'done' AND last_attempt_at = $2", intent_id, seen);
            tx.commit().await?;
            stamped
        }))
    }

    /// Decides which VM a pending boot intent of the operation `op_id` adopts, in one
    /// transaction fenced on the operation (see [`DomainError::RolledBack`],
    /// [`DomainError::Finished`]): the VM it records already (an overlapping attempt adopted
    /// one), or else `candidate`, recorded now. Returns the VM adopted.
    pub async fn adopt_vm(&self, intent_id: &str, op_id: &str, candidate: &str) -> Result<String> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            guard!(self, tx, op_id);
            sqlx::query("UPDATE lb_intents SET vm_id = $2 WHERE intent_id = $1 AND vm_id IS NULL")
                .bind(intent_id).bind(candidate).execute(&mut *tx).await?;
            let recorded: Option<String> = sqlx::query("SELECT vm_id FROM lb_intents WHERE intent_id = $1")
                .bind(intent_id).fetch_optional(&mut *tx).await?
                .map(|r| r.try_get::<Option<String>, _>(0)).transpose()?.flatten();
            tx.commit().await?;
            recorded.unwrap_or_else(|| candidate.to_owned())
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
                sqlx::query(COUNT_BOOT).bind(boot_counter(intent_id)).execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        let intent = self.intent(intent_id).await?.ok_or(DomainError::Db(sqlx::Error::RowNotFound))?;
        Ok(intent.vm_id.unwrap_or_else(|| vm_id.to_owned()))
    }

    /// Marks a reboot intent done and, if this call is the one that did, counts the reboot on
    /// the worker and marks the operation `op_id` finished (so no attempt that outlived its claim
    /// starts it again), in one transaction. Returns the worker's reboot count.
    pub async fn finish_reboot(&self, intent_id: &str, vm_id: &str, worker_id: &str, op_id: &str) -> Result<i64> {
        Ok(with_pool!(&self.db, p => {
            let mut tx = p.begin().await?;
            let changed = sqlx::query("UPDATE lb_intents SET state = 'done', vm_id = $2 WHERE intent_id = $1 AND state <> 'done'")
                .bind(intent_id).bind(vm_id).execute(&mut *tx).await?.rows_affected();
            if changed == 1 {
                sqlx::query("UPDATE lb_workers SET reboot_count = reboot_count + 1 WHERE worker_id = $1")
                    .bind(worker_id).execute(&mut *tx).await?;
                sqlx::query("UPDATE lb_counters SET value = value + 1 WHERE name = 'reboots'").execute(&mut *tx).await?;
            }
            // The operation keeps a compact mark: its intents go.
            sqlx::query("DELETE FROM lb_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            sqlx::query(create::MARK_FINISHED).bind(op_id).bind(crate::service::now_micros()).execute(&mut *tx).await?;
            let count: i64 = sqlx::query("SELECT reboot_count FROM lb_workers WHERE worker_id = $1")
                .bind(worker_id).fetch_optional(&mut *tx).await?
                .map(|r| r.try_get(0)).transpose()?.unwrap_or(0);
            tx.commit().await?;
            count
        }))
    }
}
