//! The partitions: one per UTC day of expiry, created ahead and on demand, detached and
//! dropped once their day has ended (the layout and its locking are described on the parent
//! module).

use std::collections::BTreeSet;

use chrono::{NaiveDate, TimeZone, Utc};
use idempotency::{StoreError, Timestamp};
use sqlx::AssertSqlSafe;

use super::{LOCK_NAMESPACE, PARTITIONED_TABLE, PartitionedPostgresStore};
use crate::row::db_error;

impl PartitionedPostgresStore {
    /// Creates the partitions of `days` that are missing, in one transaction.
    pub(super) async fn ensure_partitions(&self, days: &[NaiveDate]) -> Result<(), StoreError> {
        let have = attached(&self.pool).await?;
        if days.iter().all(|d| have.contains(d)) {
            return Ok(());
        }
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
            .bind(LOCK_NAMESPACE)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        // Again under the lock: another replica may have created them meanwhile.
        let have = attached(&mut *tx).await?;
        for &day in days.iter().filter(|d| !have.contains(d)) {
            let name = partition_name(day)?;
            // A table of this name that is not a partition is what a sweep detached and did not
            // get to drop (a crash in between): all its rows had expired. Never attach it back:
            // its keys may have been claimed again since.
            let ddl = format!(
                r#"DROP TABLE IF EXISTS "{name}";
                   CREATE TABLE "{name}" (LIKE {PARTITIONED_TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
                   ALTER TABLE {PARTITIONED_TABLE} ATTACH PARTITION "{name}"
                     FOR VALUES FROM ('{from} 00:00:00+00') TO ('{to} 00:00:00+00')"#,
                from = day.format("%Y-%m-%d"),
                to = next_day(day)?.format("%Y-%m-%d"),
            );
            sqlx::raw_sql(AssertSqlSafe(ddl)).execute(&mut *tx).await.map_err(db_error)?;
        }
        tx.commit().await.map_err(db_error)
    }

    /// Detaches every partition whose day ended by `now`, then, within the drop window, counts
    /// and drops every detached one. Returns the number of records dropped.
    pub(super) async fn drop_expired_partitions(&self, now: Timestamp) -> Result<u64, StoreError> {
        let mut ended = vec![];
        for day in attached(&self.pool).await? {
            if day_end(day)? > now {
                break;
            }
            ended.push(day);
        }
        if !ended.is_empty() {
            self.detach(&ended).await?;
        }
        if !self.drop_window.contains(now) {
            return Ok(0);
        }
        let mut dropped = 0;
        for day in detached(&self.pool).await? {
            if day_end(day)? > now {
                continue;
            }
            let name = partition_name(day)?;
            let mut tx = self.pool.begin().await.map_err(db_error)?;
            sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
                .bind(LOCK_NAMESPACE)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            if !detached(&mut *tx).await?.contains(&day) {
                continue;
            }
            // Nothing writes to a detached table, so the count is exact. One process scans it:
            // parallel workers would take every core from the claims for the scan's length.
            sqlx::query("SET LOCAL max_parallel_workers_per_gather = 0").execute(&mut *tx).await.map_err(db_error)?;
            let count: i64 = sqlx::query_scalar(AssertSqlSafe(format!(r#"SELECT count(*) FROM "{name}""#)))
                .fetch_one(&mut *tx)
                .await
                .map_err(db_error)?;
            sqlx::query(AssertSqlSafe(format!(r#"DROP TABLE "{name}""#))).execute(&mut *tx).await.map_err(db_error)?;
            tx.commit().await.map_err(db_error)?;
            dropped += u64::try_from(count).unwrap_or(0);
        }
        Ok(dropped)
    }

    /// Detaches the partitions of `days` (ended days) without holding claims up.
    ///
    /// `DETACH PARTITION ... CONCURRENTLY` takes only `SHARE UPDATE EXCLUSIVE` on the parent,
    /// which no claim, completion or read conflicts with, marks the partition pending detach
    /// (from then on new statements no longer see it), waits for every transaction that may
    /// still be using it, and finishes in a second transaction. A long transaction on the table
    /// therefore delays the drop of the day, not the claims. A detach cancelled or killed
    /// half-way leaves its partition pending; the next sweep finishes it (`FINALIZE`) first.
    ///
    /// Neither form can run in a transaction block, so replicas take turns with a session
    /// advisory lock, on a connection that is closed afterwards: whatever happens, closing the
    /// session releases the lock.
    pub(super) async fn detach(&self, days: &[NaiveDate]) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error)?;
        conn.close_on_drop();
        sqlx::query("SELECT pg_advisory_lock($1, 0)")
            .bind(LOCK_NAMESPACE)
            .execute(&mut *conn)
            .await
            .map_err(db_error)?;
        // Again under the lock: another replica's sweep may have taken some meanwhile.
        let pending = pending_detach(&mut *conn).await?;
        let attached = attached(&mut *conn).await?;
        let finish = days.iter().filter(|d| pending.contains(d)).map(|d| (d, "FINALIZE"));
        let start = days.iter().filter(|d| attached.contains(d) && !pending.contains(d)).map(|d| (d, "CONCURRENTLY"));
        // PostgreSQL allows one pending detach per table: finish those before starting others.
        for (&day, how) in finish.chain(start) {
            let name = partition_name(day)?;
            tracing::debug!(partition = %name, how, "detaching an ended day");
            let detach = format!(r#"ALTER TABLE {PARTITIONED_TABLE} DETACH PARTITION "{name}" {how}"#);
            sqlx::raw_sql(AssertSqlSafe(detach)).execute(&mut *conn).await.map_err(db_error)?;
        }
        Ok(())
    }
}

/// The hours of the day (UTC) in which a sweep drops detached days: `from` (inclusive) to
/// `to` (exclusive), across midnight when `to` is before `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropWindow {
    from: u32,
    to: u32,
}

impl DropWindow {
    /// Every hour: a day is dropped on the first sweep after it ends.
    pub const ANY_TIME: DropWindow = DropWindow { from: 0, to: 24 };

    /// From hour `from` to hour `to` (0 to 24, UTC), e.g. `hours(2, 5)` for 02:00 to 05:00, or
    /// `hours(22, 4)` across midnight. `None` for an hour past 24 or an empty window.
    pub fn hours(from: u32, to: u32) -> Option<Self> {
        (from <= 24 && to <= 24 && from != to).then_some(Self { from, to })
    }

    /// Whether `t` falls within the window.
    pub fn contains(&self, t: Timestamp) -> bool {
        use chrono::Timelike;
        let hour = t.hour();
        if self.from <= self.to { (self.from..self.to).contains(&hour) } else { hour >= self.from || hour < self.to }
    }
}

/// The UTC day of `t`.
pub(super) fn day_of(t: Timestamp) -> NaiveDate {
    t.date_naive()
}

fn next_day(day: NaiveDate) -> Result<NaiveDate, StoreError> {
    day.succ_opt().ok_or_else(|| StoreError::Corrupt(format!("no day after {day}")))
}

/// The first instant after `day`.
pub(super) fn day_end(day: NaiveDate) -> Result<Timestamp, StoreError> {
    let next = next_day(day)?;
    Ok(Utc.from_utc_datetime(&next.and_time(chrono::NaiveTime::MIN)))
}

const PARTITION_PREFIX: &str = "idempotency_records_by_day_p";

/// `idempotency_records_by_day_pYYYYMMDD`; years outside 1..=9999 have no partition (and a
/// record expiring then cannot be stored in this layout).
fn partition_name(day: NaiveDate) -> Result<String, StoreError> {
    use chrono::Datelike;
    if !(1..=9999).contains(&day.year()) {
        return Err(StoreError::unavailable(OutOfRange(day)));
    }
    Ok(format!("{PARTITION_PREFIX}{}", day.format("%Y%m%d")))
}

/// A record expiring on a day this layout cannot name.
#[derive(Debug, thiserror::Error)]
#[error("the partitioned layout stores expiries in the years 1 to 9999, not {0}")]
struct OutOfRange(NaiveDate);

fn parse_partition_name(name: &str) -> Option<NaiveDate> {
    let digits = name.strip_prefix(PARTITION_PREFIX)?;
    (digits.len() == 8).then(|| NaiveDate::parse_from_str(digits, "%Y%m%d").ok()).flatten()
}

/// The days whose partitions are attached.
pub(super) async fn attached<'c, E: sqlx::PgExecutor<'c>>(e: E) -> Result<BTreeSet<NaiveDate>, StoreError> {
    days_of_tables(
        e,
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass('idempotency_records_by_day')",
    )
    .await
}

/// The days of the partitions a detach left pending (cancelled or killed half-way).
async fn pending_detach<'c, E: sqlx::PgExecutor<'c>>(e: E) -> Result<BTreeSet<NaiveDate>, StoreError> {
    days_of_tables(
        e,
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass('idempotency_records_by_day') AND i.inhdetachpending",
    )
    .await
}

/// The days of tables named like partitions that are not attached: detached by a sweep.
async fn detached<'c, E: sqlx::PgExecutor<'c>>(e: E) -> Result<BTreeSet<NaiveDate>, StoreError> {
    days_of_tables(
        e,
        "SELECT c.relname::text FROM pg_class c \
         WHERE c.relnamespace = to_regnamespace(current_schema())::oid AND c.relkind = 'r' \
           AND NOT c.relispartition AND starts_with(c.relname::text, 'idempotency_records_by_day_p')",
    )
    .await
}

/// The days of the partition-named tables a catalog query (one `relname` column) lists.
async fn days_of_tables<'c, E: sqlx::PgExecutor<'c>>(
    e: E,
    sql: &'static str,
) -> Result<BTreeSet<NaiveDate>, StoreError> {
    let names: Vec<String> = sqlx::query_scalar(sql).fetch_all(e).await.map_err(db_error)?;
    Ok(names.iter().filter_map(|n| parse_partition_name(n)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_names_round_trip_and_reject_other_tables() {
        let day = NaiveDate::from_ymd_opt(2026, 12, 1).expect("date");
        let name = partition_name(day).expect("name");
        assert_eq!(name, "idempotency_records_by_day_p20261201");
        assert_eq!(parse_partition_name(&name), Some(day));
        for other in
            ["idempotency_records", "idempotency_records_by_day_p2026120", "idempotency_records_by_day_p20261301x"]
        {
            assert_eq!(parse_partition_name(other), None, "{other}");
        }
        assert!(partition_name(NaiveDate::from_ymd_opt(10_000, 1, 1).expect("date")).is_err());
    }

    #[test]
    fn a_drop_window_holds_its_hours_across_midnight_too() {
        let at = |h: u32| Utc.with_ymd_and_hms(2026, 12, 4, h, 30, 0).single().expect("time");
        let night = DropWindow::hours(2, 5).expect("window");
        assert_eq!((0..24).filter(|&h| night.contains(at(h))).collect::<Vec<_>>(), [2, 3, 4]);
        let across = DropWindow::hours(22, 2).expect("window");
        assert_eq!((0..24).filter(|&h| across.contains(at(h))).collect::<Vec<_>>(), [0, 1, 22, 23]);
        assert!((0..24).all(|h| DropWindow::ANY_TIME.contains(at(h))));
        assert_eq!(DropWindow::hours(3, 3), None);
        assert_eq!(DropWindow::hours(0, 25), None);
    }

    #[test]
    fn a_day_ends_at_the_next_midnight_utc() {
        let day = NaiveDate::from_ymd_opt(2026, 12, 31).expect("date");
        assert_eq!(day_end(day).expect("end").to_rfc3339(), "2027-01-01T00:00:00+00:00");
        let t = day_end(day).expect("end") - chrono::Duration::microseconds(1);
        assert_eq!(day_of(t), day);
    }
}
