//! The ledger on SQLite or PostgreSQL: the same SQL (`$N` placeholders suit both drivers), one
//! transaction per method.
//!
//! Every step of an operation opens with its fence: on SQLite the transaction is `BEGIN
//! IMMEDIATE` (it holds the one write lock from its start), on PostgreSQL the operation's row is
//! locked (`FOR SHARE`, or by the upsert that begins an attempt), so a finish or a rollback,
//! which writes the row, and a step are always ordered. The send stamp is computed after that:
//! a wait for a connection or a lock never eats into the time it lies ahead of the clock.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;
use sqlx::migrate::Migrator;

use crate::ledger::{Decided, Intent, IntentState, Ledger, LedgerError, Mark, NewIntent, OperationRow};
use crate::{micros, now_micros};

/// The table where the ledger's migrations record their history (neither sqlx's default nor
/// the idempotency store's, so all three migrators can share one database).
pub const MIGRATIONS_TABLE: &str = "_idempotency_effects_migrations";

/// A connection pool on one of the two supported databases.
#[derive(Debug, Clone)]
enum Pool {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

/// A [`Ledger`] in SQLite or PostgreSQL tables (`fx_operations`, `fx_intents`, `fx_owned`),
/// created by [`SqlLedger::migrate`]. Several handles (replicas) may share one database.
#[derive(Debug, Clone)]
pub struct SqlLedger {
    pool: Pool,
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::ColumnNotFound(_) | sqlx::Error::Decode(_) => {
                LedgerError::Corrupt(e.to_string())
            }
            e => LedgerError::Unavailable(Box::new(e)),
        }
    }
}

/// Runs `$body` with `$tx` a transaction that holds its fence lock (see the module docs) and
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

const INTENT_COLUMNS: &str =
    "intent_id, op_id, effect, keeps, state, resource_id, created_at, sent_at, watcher, watch_until";
const OP_COLUMNS: &str = "op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at, next_check_at";

macro_rules! read_intent {
    ($row:expr) => {{
        let row = $row;
        let state: String = row.try_get("state")?;
        Intent {
            intent_id: row.try_get("intent_id")?,
            op_id: row.try_get("op_id")?,
            effect: row.try_get("effect")?,
            keeps: row.try_get::<i64, _>("keeps")? != 0,
            state: IntentState::from_stored(&state)
                .ok_or_else(|| LedgerError::Corrupt(format!("intent state {state:?}")))?,
            resource_id: row.try_get("resource_id")?,
            created_at: row.try_get("created_at")?,
            sent_at: row.try_get("sent_at")?,
            watcher: row.try_get("watcher")?,
            watch_until: row.try_get("watch_until")?,
        }
    }};
}

macro_rules! read_op {
    ($row:expr) => {{
        let row = $row;
        let mark: i64 = row.try_get("mark")?;
        OperationRow {
            op_id: row.try_get("op_id")?,
            kind: row.try_get("kind")?,
            principal: row.try_get("principal")?,
            endpoint: row.try_get("endpoint")?,
            idem_key: row.try_get("idem_key")?,
            record_id: row.try_get("record_id")?,
            mark: Mark::from_i64(mark).ok_or_else(|| LedgerError::Corrupt(format!("operation mark {mark}")))?,
            last_attempt_at: row.try_get("last_attempt_at")?,
            next_check_at: row.try_get("next_check_at")?,
        }
    }};
}

/// The send stamp of a call about to be sent, for an intent whose stamp was `seen`: `ahead` of
/// the clock, and always past `seen` (so the compare-and-set moves it). Taken only inside the
/// transaction that decides to send, once it holds its lock.
fn send_stamp(seen: i64, ahead: Duration) -> i64 {
    now_micros().saturating_add(micros(ahead)).max(seen + 1)
}

/// The first step of an effect on `$conn`, a connection inside a transaction that the caller
/// commits (see [`Ledger::decide`]): begins the attempt on the operation's row (the upsert is
/// the fence, and takes the lock), then reads the intent or records it with its send stamp,
/// taken after the lock. Returns early with the mark's error when the operation is not live.
macro_rules! decide_in {
    ($conn:ident, $op:expr, $new:expr, $ahead:expr) => {{
        let (op, new): (&OperationRow, &NewIntent) = ($op, $new);
        let begun = sqlx::query(BEGIN_ATTEMPT)
            .bind(&op.op_id)
            .bind(&op.kind)
            .bind(&op.principal)
            .bind(&op.endpoint)
            .bind(&op.idem_key)
            .bind(&op.record_id)
            .bind(op.last_attempt_at)
            .bind(op.next_check_at)
            .execute(&mut *$conn)
            .await?
            .rows_affected();
        if begun == 0 {
            let mark: Option<i64> = sqlx::query_scalar("SELECT mark FROM fx_operations WHERE op_id = $1")
                .bind(&op.op_id)
                .fetch_optional(&mut *$conn)
                .await?;
            return Err(LedgerError::refused_by(mark.and_then(Mark::from_i64)));
        }
        let sql = format!("SELECT {INTENT_COLUMNS} FROM fx_intents WHERE intent_id = $1");
        match sqlx::query(sqlx::AssertSqlSafe(sql.clone())).bind(&new.intent_id).fetch_optional(&mut *$conn).await? {
            Some(row) => Decided::Existing(read_intent!(&row)),
            None => {
                // The lock is held (the upsert wrote the operation's row): the stamp starts now.
                let stamp = send_stamp(0, $ahead);
                sqlx::query(
                    "INSERT INTO fx_intents (intent_id, op_id, effect, keeps, state, created_at, sent_at) \
                             VALUES ($1, $2, $3, $4, 'pending', $5, $6)",
                )
                .bind(&new.intent_id)
                .bind(&op.op_id)
                .bind(&new.effect)
                .bind(i64::from(new.keeps))
                .bind(op.last_attempt_at)
                .bind(stamp)
                .execute(&mut *$conn)
                .await?;
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&new.intent_id).fetch_one(&mut *$conn).await?;
                Decided::Fresh(read_intent!(&row))
            }
        }
    }};
}

/// Finishes the live operation `$op_id` on `$conn`, a connection inside a transaction the
/// caller commits (see [`Ledger::finish`]): the mark is written first, so it is the fence (it
/// takes the operation row's lock). Returns early with the mark's error when it is not live.
macro_rules! finish_in {
    ($conn:ident, $op_id:expr, $now:expr) => {{
        let (op_id, now): (&str, i64) = ($op_id, $now);
        let marked = sqlx::query(
            "UPDATE fx_operations SET mark = 3, marked_at = $2, next_check_at = $2 \
                                  WHERE op_id = $1 AND mark = 0",
        )
        .bind(op_id)
        .bind(now)
        .execute(&mut *$conn)
        .await?
        .rows_affected();
        if marked == 0 {
            let mark: Option<i64> = sqlx::query_scalar("SELECT mark FROM fx_operations WHERE op_id = $1")
                .bind(op_id)
                .fetch_optional(&mut *$conn)
                .await?;
            return Err(LedgerError::refused_by(mark.and_then(Mark::from_i64)));
        }
        sqlx::query(
            "INSERT INTO fx_owned (tag, resource_id, op_id, owned_at) \
                     SELECT intent_id, resource_id, op_id, $2 FROM fx_intents \
                     WHERE op_id = $1 AND keeps = 1 AND state = 'done' AND resource_id IS NOT NULL \
                     ON CONFLICT (tag) DO NOTHING",
        )
        .bind(op_id)
        .bind(now)
        .execute(&mut *$conn)
        .await?;
        sqlx::query("DELETE FROM fx_intents WHERE op_id = $1 AND state <> 'accepted'")
            .bind(op_id)
            .execute(&mut *$conn)
            .await?;
    }};
}

const BEGIN_ATTEMPT: &str = "INSERT INTO fx_operations \
     (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at, next_check_at) \
     VALUES ($1, $2, $3, $4, $5, $6, 0, $7, $8) \
     ON CONFLICT (op_id) DO UPDATE SET last_attempt_at = excluded.last_attempt_at, \
     next_check_at = excluded.next_check_at WHERE fx_operations.mark = 0";

impl SqlLedger {
    #[cfg(feature = "sqlite")]
    /// A ledger on an SQLite pool (WAL and a busy timeout, as
    /// [`SqliteStore::connect_options`](idempotency_sqlx::SqliteStore::connect_options) sets).
    pub fn sqlite(pool: sqlx::SqlitePool) -> Self {
        Self { pool: Pool::Sqlite(pool) }
    }

    #[cfg(feature = "postgres")]
    /// A ledger on a PostgreSQL pool.
    pub fn postgres(pool: sqlx::PgPool) -> Self {
        Self { pool: Pool::Postgres(pool) }
    }

    /// Connects to `url` (`sqlite:...` or `postgres://...`) with `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, LedgerError> {
        #[cfg(feature = "postgres")]
        if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let pool = idempotency_sqlx::postgres_pool_options(max_connections).connect(url).await?;
            return Ok(Self::postgres(pool));
        }
        #[cfg(feature = "sqlite")]
        {
            let options = idempotency_sqlx::SqliteStore::connect_options(url)
                .map_err(|e| LedgerError::Unavailable(Box::new(e)))?;
            let pool = idempotency_sqlx::sqlite_pool_options(max_connections).connect_with(options).await?;
            Ok(Self::sqlite(pool))
        }
        #[cfg(not(feature = "sqlite"))]
        Err(LedgerError::Unavailable(format!("unsupported database URL {url:?}").into()))
    }

    /// Creates or updates the tables (versioned migrations, history in [`MIGRATIONS_TABLE`]).
    pub async fn migrate(&self) -> Result<(), LedgerError> {
        let run = match &self.pool {
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(p) => migrator(true).run(p).await,
            #[cfg(feature = "postgres")]
            Pool::Postgres(p) => migrator(false).run(p).await,
        };
        run.map_err(|e| LedgerError::Unavailable(Box::new(e)))
    }
}

#[cfg(feature = "sqlite")]
/// [`Ledger::decide`] inside the caller's own SQLite transaction (begun with `BEGIN IMMEDIATE`,
/// committed by the caller), so a service can record its own rows (a node, a lease) and the
/// effect's intent in one commit. Use it through [`crate::Attempt::decide_in_sqlite`].
pub(crate) async fn decide_in_sqlite(
    conn: &mut sqlx::SqliteConnection,
    op: &OperationRow,
    new: &NewIntent,
    ahead: Duration,
) -> Result<Decided, LedgerError> {
    Ok(decide_in!(conn, op, new, ahead))
}

#[cfg(feature = "postgres")]
/// [`Ledger::decide`] inside the caller's own PostgreSQL transaction (committed by the caller).
/// Use it through [`crate::Attempt::decide_in_postgres`].
pub(crate) async fn decide_in_postgres(
    conn: &mut sqlx::PgConnection,
    op: &OperationRow,
    new: &NewIntent,
    ahead: Duration,
) -> Result<Decided, LedgerError> {
    Ok(decide_in!(conn, op, new, ahead))
}

#[cfg(feature = "sqlite")]
/// [`Ledger::finish`] inside the caller's own SQLite transaction (committed by the caller), so
/// a service can write its result (a worker row) and the operation's end in one commit. Use it
/// through [`crate::Attempt::finish_in_sqlite`].
pub(crate) async fn finish_in_sqlite(
    conn: &mut sqlx::SqliteConnection,
    op_id: &str,
    now: i64,
) -> Result<(), LedgerError> {
    finish_in!(conn, op_id, now);
    Ok(())
}

#[cfg(feature = "postgres")]
/// [`Ledger::finish`] inside the caller's own PostgreSQL transaction. Use it through
/// [`crate::Attempt::finish_in_postgres`].
pub(crate) async fn finish_in_postgres(
    conn: &mut sqlx::PgConnection,
    op_id: &str,
    now: i64,
) -> Result<(), LedgerError> {
    finish_in!(conn, op_id, now);
    Ok(())
}

/// The ledger's migrations for SQLite (`true`) or PostgreSQL.
pub fn migrator(sqlite: bool) -> Migrator {
    let files: &[(&'static str, &'static str)] = if sqlite {
        idempotency_sqlx::embedded_migrations!("migrations/sqlite", "20261202200001_effect_ledger.sql")
    } else {
        idempotency_sqlx::embedded_migrations!("migrations/postgres", "20261202200001_effect_ledger.sql")
    };
    let mut m = idempotency_sqlx::embedded_migrator(files).expect("the file names are checked by a test");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
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
            sqlx::query("UPDATE fx_intents SET state = CASE WHEN state = 'pending' THEN $3 ELSE state END, \
                         resource_id = COALESCE(resource_id, $2) WHERE intent_id = $1")
                .bind(intent_id).bind(resource_id).bind(state.as_str()).execute(&mut *tx).await?;
            let recorded: Option<Option<String>> = sqlx::query_scalar("SELECT resource_id FROM fx_intents WHERE intent_id = $1")
                .bind(intent_id).fetch_optional(&mut *tx).await?;
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

    async fn release(&self, intent_id: &str) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("UPDATE fx_intents SET state = 'failed' WHERE intent_id = $1 AND state = 'pending'")
                .bind(intent_id).execute(p).await?.rows_affected() == 1)
        })
    }

    async fn finish(&self, op_id: &str, now: i64) -> Result<(), LedgerError> {
        in_tx!(self, tx, _guard => {
            finish_in!(tx, op_id, now);
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
                            (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at, next_check_at) \
                            VALUES ($1, $2, $3, $4, $5, $6, 1, $7, $8) ON CONFLICT (op_id) DO NOTHING")
                .bind(&op.op_id).bind(&op.kind).bind(&op.principal).bind(&op.endpoint).bind(&op.idem_key)
                .bind(&op.record_id).bind(op.last_attempt_at).bind(op.next_check_at)
                .execute(p).await?.rows_affected() == 1)
        })
    }

    async fn rolled_back(&self, op_id: &str, now: i64) -> Result<bool, LedgerError> {
        in_tx!(self, tx, _guard => {
            let marked = sqlx::query("UPDATE fx_operations SET mark = 2, marked_at = $2 WHERE op_id = $1 AND mark = 1")
                .bind(op_id).bind(now).execute(&mut *tx).await?.rows_affected() == 1;
            if marked {
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
            tx.commit().await?;
            Ok(i + o)
        })
    }

    async fn owns(&self, tag: &str, resource_id: &str, settled_before: i64) -> Result<bool, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("SELECT 1 FROM fx_owned WHERE tag = $1 AND resource_id = $2 \
                            UNION ALL \
                            SELECT 1 FROM fx_intents i JOIN fx_operations o ON o.op_id = i.op_id \
                            WHERE i.intent_id = $1 AND (o.mark < 2 OR i.state = 'accepted' OR i.sent_at > $3)")
                .bind(tag).bind(resource_id).bind(settled_before).fetch_optional(p).await?.is_some())
        })
    }

    async fn disown(&self, resource_id: &str) -> Result<u64, LedgerError> {
        on_pool!(self, p => {
            Ok(sqlx::query("DELETE FROM fx_owned WHERE resource_id = $1").bind(resource_id).execute(p).await?.rows_affected())
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
                    "INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, mark, \
                     last_attempt_at, next_check_at) ");
                q.push_values(chunk, |mut b, r| {
                    b.push_bind(r.op_id.clone()).push_bind(r.kind.clone()).push_bind(r.principal.clone())
                        .push_bind(r.endpoint.clone()).push_bind(r.idem_key.clone()).push_bind(r.record_id.clone())
                        .push_bind(r.mark.as_i64()).push_bind(r.last_attempt_at).push_bind(r.next_check_at);
                });
                q.build().execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compiled-in lists hold every file of their directory, read exactly as sqlx reads it.
    #[tokio::test]
    async fn the_embedded_migrations_are_the_directories() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for (sqlite, dir) in [(true, "migrations/sqlite"), (false, "migrations/postgres")] {
            let (ours, sqlx) = idempotency_sqlx::compare_with_directory(&migrator(sqlite), &root.join(dir)).await;
            assert_eq!(ours, sqlx, "{dir}");
        }
    }
}
