//! The two steps that also run in a transaction the caller opens and commits: deciding an
//! effect (begin the attempt, then read or record the intent) and finishing its operation. The
//! ledger runs them in its own transactions ([`Ledger::decide`](crate::Ledger::decide),
//! [`Ledger::finish`](crate::Ledger::finish)); a service runs them in its own through
//! [`Attempt`](crate::Attempt).

use std::time::Duration;

use sqlx::Row;

use super::rows::{INTENT_COLUMNS, read_intent};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use crate::Outcome;
use crate::ledger::{Decided, Intent, IntentState, LedgerError, Mark, NewIntent, OperationRow};
use crate::{micros, now_micros};

/// The send stamp of a call about to be sent, for an intent whose stamp was `seen`: `ahead` of
/// the clock, and always past `seen` (so the compare-and-set moves it). Taken only inside the
/// transaction that decides to send, once it holds its lock.
pub(super) fn send_stamp(seen: i64, ahead: Duration) -> i64 {
    now_micros().saturating_add(micros(ahead)).max(seen + 1)
}

/// The first step of an effect on `$conn`, a connection inside a transaction that the caller
/// commits (see [`Ledger::decide`](crate::Ledger::decide)): begins the attempt on the
/// operation's row (the upsert is the fence, and takes the lock), then reads the intent or
/// records it with its send stamp, taken after the lock. Returns early with the mark's error
/// when the operation is not live.
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
            .bind(&op.subject)
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
        // The lock is held (the upsert wrote the operation's row): the stamp starts now. The
        // insert is the compare-and-set from "no intent"; an intent there already is read.
        let insert = format!(
            "INSERT INTO fx_intents (intent_id, op_id, effect, keeps, state, created_at, sent_at) \
             VALUES ($1, $2, $3, $4, 'pending', $5, $6) ON CONFLICT (intent_id) DO NOTHING RETURNING {INTENT_COLUMNS}"
        );
        let fresh = sqlx::query(sqlx::AssertSqlSafe(insert))
            .bind(&new.intent_id)
            .bind(&op.op_id)
            .bind(&new.effect)
            .bind(i64::from(new.keeps))
            .bind(op.last_attempt_at)
            .bind(send_stamp(0, $ahead))
            .fetch_optional(&mut *$conn)
            .await?;
        match fresh {
            Some(row) => Decided::Fresh(read_intent!(&row)),
            None => {
                let sql = format!("SELECT {INTENT_COLUMNS} FROM fx_intents WHERE intent_id = $1");
                let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&new.intent_id).fetch_one(&mut *$conn).await?;
                Decided::Existing(read_intent!(&row))
            }
        }
    }};
}

/// Finishes the live operation `$op_id` on `$conn`, a connection inside a transaction the
/// caller commits (see [`Ledger::finish`](crate::Ledger::finish)): the mark is written first, so
/// it is the fence (it takes the operation row's lock). `$record`, when some, is what a call of
/// this attempt made, recorded on its intent right after the mark (as
/// [`Ledger::record`](crate::Ledger::record): the first id recorded wins) and before the
/// intents are read for ownership. Evaluates to the id the intent holds (`None` without a
/// record, or when the intent is gone). Returns early with the mark's error when the operation
/// is not live, after the record, which the caller commits still (the reaper reconciles by it).
macro_rules! finish_in {
    ($conn:ident, $op_id:expr, $now:expr, $record:expr) => {{
        let (op_id, now, record): (&str, i64, Option<(&str, &$crate::Outcome)>) = ($op_id, $now, $record);
        let marked = sqlx::query(
            "UPDATE fx_operations SET mark = 3, marked_at = $2, next_check_at = $2 \
                                  WHERE op_id = $1 AND mark = 0",
        )
        .bind(op_id)
        .bind(now)
        .execute(&mut *$conn)
        .await?
        .rows_affected();
        let recorded: Option<String> = match record {
            Some((tag, outcome)) => sqlx::query_scalar::<_, Option<String>>(RECORD)
                .bind(tag)
                .bind(outcome.id())
                .bind(outcome.state().as_str())
                .fetch_optional(&mut *$conn)
                .await?
                .flatten(),
            None => None,
        };
        if marked == 0 {
            let mark: Option<i64> = sqlx::query_scalar("SELECT mark FROM fx_operations WHERE op_id = $1")
                .bind(op_id)
                .fetch_optional(&mut *$conn)
                .await?;
            return Err(LedgerError::refused_by(mark.and_then(Mark::from_i64)));
        }
        if $crate::sql::steps::speaks_postgres(&*$conn) {
            sqlx::query(END_INTENTS_POSTGRES).bind(op_id).bind(now).execute(&mut *$conn).await?;
        } else {
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
            sqlx::query(SPEND_INTENTS).bind(op_id).bind(now).execute(&mut *$conn).await?;
            sqlx::query("DELETE FROM fx_intents WHERE op_id = $1 AND state <> 'accepted'")
                .bind(op_id)
                .execute(&mut *$conn)
                .await?;
        }
        recorded
    }};
}

/// The end of a finished operation's intents on PostgreSQL, in one statement (one round trip
/// instead of three): the resources of its done intents that keep theirs stay owned, every
/// intent's tag is remembered as issued here, and the intents go but the accepted ones. The
/// statement's parts all read the table as it was when it began (PostgreSQL runs a
/// data-modifying `WITH` on one snapshot), so the tags are those of every intent, the deleted
/// ones included, as SQLite's three statements in that order read them.
pub(super) const END_INTENTS_POSTGRES: &str = "WITH gone AS (\
     DELETE FROM fx_intents WHERE op_id = $1 AND state <> 'accepted' RETURNING intent_id, resource_id, keeps, state), \
     owned AS (INSERT INTO fx_owned (tag, resource_id, op_id, owned_at) \
     SELECT intent_id, resource_id, $1, $2 FROM gone WHERE keeps = 1 AND state = 'done' AND resource_id IS NOT NULL \
     ON CONFLICT (tag) DO NOTHING) \
     INSERT INTO fx_spent (tag, spent_at) SELECT intent_id, $2 FROM fx_intents WHERE op_id = $1 ON CONFLICT (tag) DO NOTHING";

/// Which SQL a connection speaks, where SQLite's and PostgreSQL's differ.
pub(crate) trait Dialect {
    /// PostgreSQL.
    const POSTGRES: bool;
}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::SqliteConnection {
    const POSTGRES: bool = false;
}

#[cfg(feature = "postgres")]
impl Dialect for sqlx::PgConnection {
    const POSTGRES: bool = true;
}

/// Whether `conn` speaks PostgreSQL.
pub(crate) fn speaks_postgres<C: Dialect>(_conn: &C) -> bool {
    C::POSTGRES
}

/// Records what a sent call made on its pending intent `$1`: state `$3` (done or accepted) and
/// resource `$2`, unless an id is recorded already (the first one wins); returns the id held.
pub(super) const RECORD: &str = "UPDATE fx_intents SET state = CASE WHEN state = 'pending' THEN $3 ELSE state END, \
     resource_id = COALESCE(resource_id, $2) WHERE intent_id = $1 RETURNING resource_id";

/// Remembers the tags of an operation's intents (`$1`) as issued here (at `$2`), before they
/// are deleted (an accepted one a finished operation keeps is remembered too, harmlessly): the
/// inventory sweep undoes only what carries a tag this ledger issued.
pub(super) const SPEND_INTENTS: &str = "INSERT INTO fx_spent (tag, spent_at) \
     SELECT intent_id, $2 FROM fx_intents WHERE op_id = $1 ON CONFLICT (tag) DO NOTHING";

pub(super) const BEGIN_ATTEMPT: &str = "INSERT INTO fx_operations \
     (op_id, kind, principal, endpoint, idem_key, record_id, subject, mark, last_attempt_at, next_check_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8, $9) \
     ON CONFLICT (op_id) DO UPDATE SET last_attempt_at = excluded.last_attempt_at, \
     next_check_at = excluded.next_check_at WHERE fx_operations.mark = 0";

#[cfg(feature = "sqlite")]
/// [`Ledger::decide`](crate::Ledger::decide) inside the caller's own SQLite transaction (begun
/// with `BEGIN IMMEDIATE`, committed by the caller), so a service can record its own rows (a
/// node, a lease) and the effect's intent in one commit. Use it through
/// [`crate::Attempt::decide_in_sqlite`].
pub(crate) async fn decide_in_sqlite(
    conn: &mut sqlx::SqliteConnection,
    op: &OperationRow,
    new: &NewIntent,
    ahead: Duration,
) -> Result<Decided, LedgerError> {
    Ok(decide_in!(conn, op, new, ahead))
}

#[cfg(feature = "postgres")]
/// [`Ledger::decide`](crate::Ledger::decide) inside the caller's own PostgreSQL transaction
/// (committed by the caller). Use it through [`crate::Attempt::decide_in_postgres`].
pub(crate) async fn decide_in_postgres(
    conn: &mut sqlx::PgConnection,
    op: &OperationRow,
    new: &NewIntent,
    ahead: Duration,
) -> Result<Decided, LedgerError> {
    Ok(decide_in!(conn, op, new, ahead))
}

#[cfg(feature = "sqlite")]
/// [`Ledger::finish`](crate::Ledger::finish) inside the caller's own SQLite transaction
/// (committed by the caller), so a service can write its result (a worker row) and the
/// operation's end in one commit, with what a call of this attempt made when `record` is some.
/// Use it through [`crate::Attempt::finish_in_sqlite`] / [`crate::Attempt::finish_made_in_sqlite`].
pub(crate) async fn finish_in_sqlite(
    conn: &mut sqlx::SqliteConnection,
    op_id: &str,
    now: i64,
    record: Option<(&str, &Outcome)>,
) -> Result<Option<String>, LedgerError> {
    Ok(finish_in!(conn, op_id, now, record))
}

#[cfg(feature = "postgres")]
/// As [`finish_in_sqlite`], in the caller's own PostgreSQL transaction.
pub(crate) async fn finish_in_postgres(
    conn: &mut sqlx::PgConnection,
    op_id: &str,
    now: i64,
    record: Option<(&str, &Outcome)>,
) -> Result<Option<String>, LedgerError> {
    Ok(finish_in!(conn, op_id, now, record))
}

pub(super) use {decide_in, finish_in};
