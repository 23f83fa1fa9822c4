//! The statements every PostgreSQL table of records shares, written once: the read by scope and
//! the fenced transitions (each names its row by the scope and changes it only while the
//! caller's claim holds: the same record id and generation), and the one way their parameters
//! are bound.
//!
//! The plain table ([`crate::PostgresStore`]) and the partitioned one
//! ([`crate::PartitionedPostgresStore`]) differ only in the table's name and in the columns a
//! row brings back; their claims differ in substance and stay with each store.

use idempotency::{Record, Scope, stored_component};
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;

/// A PostgreSQL statement with its parameters bound so far.
pub(crate) type PgQuery<'q> = Query<'q, Postgres, PgArguments>;

/// One table's statements. `$1`-`$3` name the row (principal, endpoint, key as stored); in the
/// fenced ones `$4`-`$5` are the claim's record id and generation ([`bind_fence`]) and the
/// parameters after them are each statement's own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FencedSql {
    /// The record of a scope.
    pub select: &'static str,
    /// Takes over a failed claim, or an in-flight one started at or before `$7`, as the next
    /// generation, started at `$6`, expiring no earlier than `$8`.
    pub reclaim: &'static str,
    /// Stores the response (`$6`-`$9`: status, headers, body, encoding), expiring at `$10`.
    pub complete: &'static str,
    /// Marks the claim failed.
    pub fail: &'static str,
    /// Marks the claim uncertain (its outcome is unknown).
    pub mark_uncertain: &'static str,
    /// Marks an in-flight record started at or before `$6` (stale) uncertain, expiring no
    /// earlier than `$7`; returns the row.
    pub mark_stale_uncertain: &'static str,
    /// Takes over an uncertain record as the next generation, started at `$6`, expiring no
    /// earlier than `$7`; returns the row.
    pub take_over_uncertain: &'static str,
    /// Renews the claim at `$6` and the record's expiry to `$7`; neither moves backwards
    /// (replicas' clocks differ a little).
    pub heartbeat: &'static str,
    /// Deletes the record of the claim.
    pub remove: &'static str,
}

/// The [`FencedSql`] of `$table`, whose rows come back as the columns of the macro `$columns`
/// ([`crate::row::state_columns`] or [`crate::row::record_columns`]).
macro_rules! fenced_sql {
    ($table:literal, $columns:ident) => {
        $crate::fenced::FencedSql {
            select: concat!(
                "SELECT ",
                $crate::row::$columns!(),
                " FROM ",
                $table,
                " WHERE principal = $1 AND endpoint = $2 AND key = $3"
            ),
            reclaim: concat!(
                "UPDATE ",
                $table,
                " SET state = 'in_flight', generation = generation + 1, started_at = $6, \
                   expires_at = GREATEST(expires_at, $8) \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND (state = 'failed' OR (state = 'in_flight' AND started_at <= $7)) \
                 RETURNING ",
                $crate::row::$columns!()
            ),
            // Neither this nor `fail` notifies: a NOTIFY in the statement would hold
            // PostgreSQL's notification queue lock through the commit, one completion at a
            // time; the store announces after the commit (crate::changes).
            complete: concat!(
                "UPDATE ",
                $table,
                " SET state = 'completed', response_status = $6, \
                   response_headers = $7, response_body = $8, response_encoding = $9, expires_at = $10 \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight'"
            ),
            fail: concat!(
                "UPDATE ",
                $table,
                " SET state = 'failed' \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight'"
            ),
            mark_uncertain: concat!(
                "UPDATE ",
                $table,
                " SET state = 'uncertain' \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight'"
            ),
            mark_stale_uncertain: concat!(
                "UPDATE ",
                $table,
                " SET state = 'uncertain', expires_at = GREATEST(expires_at, $7) \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight' AND started_at <= $6 \
                 RETURNING ",
                $crate::row::$columns!()
            ),
            take_over_uncertain: concat!(
                "UPDATE ",
                $table,
                " SET state = 'in_flight', generation = generation + 1, started_at = $6, \
                   expires_at = GREATEST(expires_at, $7) \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'uncertain' \
                 RETURNING ",
                $crate::row::$columns!()
            ),
            heartbeat: concat!(
                "UPDATE ",
                $table,
                " SET started_at = GREATEST(started_at, $6), expires_at = GREATEST(expires_at, $7) \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight'"
            ),
            remove: concat!(
                "DELETE FROM ",
                $table,
                " WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                   AND state = 'in_flight'"
            ),
        }
    };
}
pub(crate) use fenced_sql;

/// `sql` with `$1`-`$3` bound to `scope` as stored ([`stored_component`]: a long component
/// shortened).
pub(crate) fn bind_scope<'q>(sql: &'static str, scope: &'q Scope) -> PgQuery<'q> {
    sqlx::query(sql)
        .bind(stored_component(scope.principal.as_str()))
        .bind(stored_component(scope.endpoint.as_str()))
        .bind(stored_component(scope.key.as_str()))
}

/// `sql` with `$1`-`$5` bound to the row of `record` and its fence: record id and generation.
pub(crate) fn bind_fence<'q>(sql: &'static str, record: &'q Record) -> PgQuery<'q> {
    bind_scope(sql, &record.scope).bind(record.record_id.as_bytes().as_slice()).bind(record.generation)
}

#[cfg(test)]
mod tests {
    /// The generated statements are the ones the stores ran before they were generated (the
    /// plain table's, written out by hand), up to whitespace.
    #[test]
    fn the_plain_tables_statements_are_the_handwritten_ones() {
        let sql = fenced_sql!("idempotency_records", state_columns);
        let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            words(sql.reclaim),
            words(concat!(
                "UPDATE idempotency_records SET state = 'in_flight', generation = generation + 1, started_at = $6, \
                 expires_at = GREATEST(expires_at, $8) \
                 WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 \
                 AND (state = 'failed' OR (state = 'in_flight' AND started_at <= $7)) RETURNING ",
                crate::row::state_columns!()
            ))
        );
        assert_eq!(
            words(sql.heartbeat),
            "UPDATE idempotency_records SET started_at = GREATEST(started_at, $6), expires_at = GREATEST(expires_at, \
             $7) WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $4 AND generation = $5 AND \
             state = 'in_flight'"
        );
        assert_eq!(
            words(sql.remove),
            "DELETE FROM idempotency_records WHERE principal = $1 AND endpoint = $2 AND key = $3 AND \
             record_id = $4 AND generation = $5 AND state = 'in_flight'"
        );
        let partitioned = fenced_sql!("idempotency_records_by_day", record_columns);
        assert!(partitioned.select.starts_with("SELECT principal, endpoint, key, record_id"));
        assert!(partitioned.select.contains(" FROM idempotency_records_by_day WHERE"));
    }
}
