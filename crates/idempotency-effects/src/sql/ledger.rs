//! [`Ledger`] on [`SqlLedger`]: each method one transaction (or one statement) on the pool.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;

use super::rows::{INTENT_COLUMNS, OP_COLUMNS, read_intent, read_op};
use super::steps::{BEGIN_ATTEMPT, END_INTENTS_POSTGRES, RECORD, SPEND_INTENTS, decide_in, finish_in, send_stamp};
use super::{Pool, SqlLedger};
use crate::ledger::{Decided, Intent, IntentState, Ledger, LedgerError, Mark, NewIntent, OperationRow, Ownership};
use crate::now_micros;

/// Runs `$body` with `$tx` a transaction that holds its fence lock (see the `sql` module docs) and
/// `$guard` the fence's SQL (`$1`: the op id; answers the mark).
macro_rules! in_tx {
    ($self:ident, $tx:ident, $guard:ident => $body:expr) => {
        match &$self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(p) => {
                let mut $tx = p.begin_with("BEGIN IMMEDIATE").await?;
                let $guard = "SELECT mark FROM fx_operations WHERE op_id = $1";
                $body
            }
            #[cfg(feature = "postgres")]
            Pool::Postgres(p) => {
                let mut $tx = p.begin().await?;
                let $guard = "SELECT mark FROM fx_operations WHERE op_id = $1 FOR SHARE";
                $body
            }
        }
    };
}

/// Runs `$body` with `$p` the pool, for single statements.
macro_rules! on_pool {
    ($self:ident, $p:ident => $body:expr) => {
        match &$self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite($p) => $body,
            #[cfg(feature = "postgres")]
            Pool::Postgres($p) => $body,
        }
    };
}

/// Runs the fence `$guard` for `$op_id` in `$tx`: errs with the mark's error unless live.
macro_rules! fence {
    ($tx:ident, $guard:ident, $op_id:expr) => {{
        let mark: Option<i64> = sqlx::query_scalar($guard).bind($op_id).fetch_optional(&mut *$tx).await?;
        let mark = mark.and_then(Mark::from_i64);
        if mark != Some(Mark::Live) {
            return Err(LedgerError::refused_by(mark));
        }
    }};
}

#[async_trait]
impl Ledger for SqlLedger {
    async fn decide(&self, op: &OperationRow, new: &NewIntent, ahead: Duration) -> Result<Decided, LedgerError> {
        in_tx!(self, tx, _guard => {
            let decided = decide_in!(tx, op, new, ahead);
            tx.commit().await?;
            Ok(decided)
        })
    }

    async fn stamp(
        &self,
        op_id: &str,
        intent_id: &str,
        seen: i64,
        ahead: Duration,
    ) -> Result<Option<i64>, LedgerError> {
        in_tx!(self, tx, guard => {
            fence!(tx, guard, op_id);
            let stamp = send_stamp(seen, ahead);
            let moved = sqlx::query("UPDATE fx_intents SET state = 'pending', sent_at = $3 \
                                     WHERE intent_id = $1 AND op_id = $4 AND state IN ('pending', 'failed') AND sent_at = $2")
                .bind(intent_id).bind(seen).bind(stamp).bind(op_id)
                .execute(&mut *tx).await?.rows_affected() == 1;
            tx.commit().await?;
            Ok(moved.then_some(stamp))
        })
    }

    async fn adopt(&self, op_id: &str, intent_id: &str, candidate: &str) -> Result<String, LedgerError> {
        in_tx!(self, tx, guard => {
            fence!(tx, guard, op_id);
            sqlx::query("UPDATE fx_intents SET resource_id = $2 WHERE intent_id = $1 AND resource_id IS NULL")
                .bind(intent_id).bind(candidate).execute(&mut *tx).await?;
            let recorded: Option<Option<String>> = sqlx::query_scalar("SELECT resource_id FROM fx_intents WHERE intent_id = $1")
                .bind(intent_id).fetch_optional(&mut *tx).await?;
            tx.commit().await?;
            Ok(recorded.flatten().unwrap_or_else(|| candidate.to_owned()))
        })
    }

    async fn record(
        &self,
        op_id: &str,
        intent_id: &str,
        resource_id: &str,
        state: IntentState,
    ) -> Result<String, LedgerError> {
        in_tx!(self, tx, _guard => {
            let recorded: Option<Option<String>> = sqlx::query_scalar(RECORD)
                .bind(intent_id).bind(resource_id).bind(state.as_str()).fetch_optional(&mut *tx).await?;
            let mark: Option<i64> = sqlx::query_scalar("SELECT mark FROM fx_operations WHERE op_id = $1")
                .bind(op_id).fetch_optional(&mut *tx).await?;
            tx.commit().await?;
            let mark = mark.and_then(Mark::from_i64);
            match recorded {
                Some(recorded) if mark == Some(Mark::Live) => Ok(recorded.unwrap_or_else(|| resource_id.to_owned())),
                _ => Err(LedgerError::refused_by(mark)),
            }
        })
    }

    async fn release(&self, intent_id: &str, sent_at: i64) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("UPDATE fx_intents SET state = 'failed' WHERE intent_id = $1 AND state = 'pending' AND sent_at = $2")
                .bind(intent_id).bind(sent_at).execute(p).await?.rows_affected() == 1)
        })
    }

    async fn finish(&self, op_id: &str, now: i64) -> Result<(), LedgerError> {
        in_tx!(self, tx, _guard => {
            finish_in!(tx, op_id, now, None);
            tx.commit().await?;
            Ok(())
        })
    }

    async fn operation(&self, op_id: &str) -> Result<Option<OperationRow>, LedgerError> {
        on_pool!(self, p => {
            let sql = format!("SELECT {OP_COLUMNS} FROM fx_operations WHERE op_id = $1");
            match sqlx::query(sqlx::AssertSqlSafe(sql)).bind(op_id).fetch_optional(p).await? {
                Some(row) => Ok(Some(read_op!(&row))),
                None => Ok(None),
            }
        })
    }

    async fn intent(&self, intent_id: &str) -> Result<Option<Intent>, LedgerError> {
        on_pool!(self, p => {
            let sql = format!("SELECT {INTENT_COLUMNS} FROM fx_intents WHERE intent_id = $1");
            match sqlx::query(sqlx::AssertSqlSafe(sql)).bind(intent_id).fetch_optional(p).await? {
                Some(row) => Ok(Some(read_intent!(&row))),
                None => Ok(None),
            }
        })
    }

    async fn intents(&self, op_id: &str) -> Result<Vec<Intent>, LedgerError> {
        on_pool!(self, p => {
            let sql = format!("SELECT {INTENT_COLUMNS} FROM fx_intents WHERE op_id = $1 ORDER BY intent_id");
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(op_id).fetch_all(p).await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(read_intent!(row));
            }
            Ok(out)
        })
    }

    async fn due(&self, now: i64, limit: u32) -> Result<Vec<OperationRow>, LedgerError> {
        let half = i64::from(limit.div_ceil(2));
        let mut out = on_pool!(self, p => {
            let mut out = Vec::new();
            for order in ["next_check_at, op_id", "next_check_at DESC, op_id DESC"] {
                let sql = format!("SELECT {OP_COLUMNS} FROM fx_operations WHERE mark < 2 AND next_check_at <= $1 \
                                   ORDER BY {order} LIMIT $2");
                for row in &sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now).bind(half).fetch_all(p).await? {
                    out.push(read_op!(row));
                }
            }
            out
        });
        out.sort_by(|a, b| a.op_id.cmp(&b.op_id));
        out.dedup_by(|a, b| a.op_id == b.op_id);
        Ok(out)
    }

    async fn put_off(&self, op_id: &str, at: i64) -> Result<(), LedgerError> {
        on_pool!(self, p => {
            sqlx::query("UPDATE fx_operations SET next_check_at = $2 WHERE op_id = $1").bind(op_id).bind(at).execute(p).await?;
        });
        Ok(())
    }

    async fn take_for_rollback(&self, op_id: &str, seen_last_attempt: i64) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("UPDATE fx_operations SET mark = 1 WHERE op_id = $1 AND mark = 0 AND last_attempt_at = $2")
                .bind(op_id).bind(seen_last_attempt).execute(p).await?.rows_affected() == 1)
        })
    }

    async fn take_unbegun(&self, op: &OperationRow) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("INSERT INTO fx_operations \
                            (op_id, kind, principal, endpoint, idem_key, record_id, subject, mark, last_attempt_at, next_check_at) \
                            VALUES ($1, $2, $3, $4, $5, $6, $7, 1, $8, $9) ON CONFLICT (op_id) DO NOTHING")
                .bind(&op.op_id).bind(&op.kind).bind(&op.principal).bind(&op.endpoint).bind(&op.idem_key)
                .bind(&op.record_id).bind(&op.subject).bind(op.last_attempt_at).bind(op.next_check_at)
                .execute(p).await?.rows_affected() == 1)
        })
    }

    async fn rolled_back(&self, op_id: &str, now: i64) -> Result<bool, LedgerError> {
        in_tx!(self, tx, _guard => {
            let marked = sqlx::query("UPDATE fx_operations SET mark = 2, marked_at = $2 WHERE op_id = $1 AND mark = 1")
                .bind(op_id).bind(now).execute(&mut *tx).await?.rows_affected() == 1;
            if marked {
                sqlx::query(SPEND_INTENTS).bind(op_id).bind(now).execute(&mut *tx).await?;
                sqlx::query("DELETE FROM fx_intents WHERE op_id = $1").bind(op_id).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(marked)
        })
    }

    async fn prune(&self, before: i64) -> Result<u64, LedgerError> {
        in_tx!(self, tx, _guard => {
            let gone = "SELECT op_id FROM fx_operations o WHERE mark >= 2 AND marked_at < $1 \
                        AND NOT EXISTS (SELECT 1 FROM fx_intents i WHERE i.op_id = o.op_id AND i.state = 'accepted')";
            let i = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM fx_intents WHERE op_id IN ({gone})")))
                .bind(before).execute(&mut *tx).await?.rows_affected();
            let o = sqlx::query("DELETE FROM fx_operations WHERE mark >= 2 AND marked_at < $1 \
                                 AND NOT EXISTS (SELECT 1 FROM fx_intents i WHERE i.op_id = fx_operations.op_id AND i.state = 'accepted')")
                .bind(before).execute(&mut *tx).await?.rows_affected();
            sqlx::query("DELETE FROM fx_spent WHERE spent_at < $1").bind(before).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(i + o)
        })
    }

    async fn ownership(&self, tag: &str, resource_id: &str, settled_before: i64) -> Result<Ownership, LedgerError> {
        on_pool!(self, p => {
            let found: i32 = sqlx::query_scalar(
                "SELECT CASE \
                 WHEN EXISTS (SELECT 1 FROM fx_owned WHERE tag = $1 AND resource_id = $2) \
                   OR EXISTS (SELECT 1 FROM fx_intents i JOIN fx_operations o ON o.op_id = i.op_id \
                              WHERE i.intent_id = $1 AND (o.mark < 2 OR i.state = 'accepted' OR i.sent_at > $3)) THEN 2 \
                 WHEN EXISTS (SELECT 1 FROM fx_intents WHERE intent_id = $1) \
                   OR EXISTS (SELECT 1 FROM fx_owned WHERE tag = $1) \
                   OR EXISTS (SELECT 1 FROM fx_spent WHERE tag = $1) THEN 1 \
                 ELSE 0 END",
            )
            .bind(tag).bind(resource_id).bind(settled_before).fetch_one(p).await?;
            Ok(match found {
                2 => Ownership::Owned,
                1 => Ownership::Unowned,
                _ => Ownership::Foreign,
            })
        })
    }

    async fn disown(&self, resource_id: &str) -> Result<u64, LedgerError> {
        in_tx!(self, tx, _guard => {
            sqlx::query("INSERT INTO fx_spent (tag, spent_at) SELECT tag, $2 FROM fx_owned WHERE resource_id = $1 \
                         ON CONFLICT (tag) DO UPDATE SET spent_at = excluded.spent_at")
                .bind(resource_id).bind(now_micros()).execute(&mut *tx).await?;
            let n = sqlx::query("DELETE FROM fx_owned WHERE resource_id = $1").bind(resource_id).execute(&mut *tx).await?.rows_affected();
            tx.commit().await?;
            Ok(n)
        })
    }

    async fn to_watch(&self, watcher: &str, now: i64, limit: u32) -> Result<Vec<Intent>, LedgerError> {
        on_pool!(self, p => {
            let sql = format!("SELECT {INTENT_COLUMNS} FROM fx_intents WHERE state = 'accepted' \
                               AND (watch_until < $1 OR watcher = $2) ORDER BY watch_until, intent_id LIMIT $3");
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now).bind(watcher).bind(i64::from(limit)).fetch_all(p).await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(read_intent!(row));
            }
            Ok(out)
        })
    }

    async fn take_watch(
        &self,
        intent_id: &str,
        watcher: &str,
        seen_until: i64,
        until: i64,
    ) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("UPDATE fx_intents SET watcher = $2, watch_until = $4 \
                            WHERE intent_id = $1 AND state = 'accepted' AND watch_until = $3")
                .bind(intent_id).bind(watcher).bind(seen_until).bind(until).execute(p).await?.rows_affected() == 1)
        })
    }

    async fn conclude(&self, intent_id: &str, watcher: &str, state: IntentState) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("UPDATE fx_intents SET state = $3, watcher = NULL \
                            WHERE intent_id = $1 AND state = 'accepted' AND watcher = $2")
                .bind(intent_id).bind(watcher).bind(state.as_str()).execute(p).await?.rows_affected() == 1)
        })
    }

    async fn insert_operations(&self, rows: &[OperationRow]) -> Result<(), LedgerError> {
        on_pool!(self, p => {
            let mut tx = p.begin().await?;
            for chunk in rows.chunks(1000) {
                let mut q = sqlx::QueryBuilder::new(
                    "INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, subject, mark, \
                     last_attempt_at, next_check_at) ");
                q.push_values(chunk, |mut b, r| {
                    b.push_bind(r.op_id.clone()).push_bind(r.kind.clone()).push_bind(r.principal.clone())
                        .push_bind(r.endpoint.clone()).push_bind(r.idem_key.clone()).push_bind(r.record_id.clone())
                        .push_bind(r.subject.clone()).push_bind(r.mark.as_i64()).push_bind(r.last_attempt_at).push_bind(r.next_check_at);
                });
                q.build().execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }
}
