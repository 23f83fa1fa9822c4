//! The ledger on SQLite or PostgreSQL: the same SQL (`$N` placeholders suit both drivers), one
//! transaction per method.
//!
//! Every step of an operation opens with its fence: on SQLite the transaction is `BEGIN
//! IMMEDIATE` (it holds the one write lock from its start), on PostgreSQL the operation's row is
//! locked (`FOR SHARE`, or by the upsert that begins an attempt), so a finish or a rollback,
//! which writes the row, and a step are always ordered. The send stamp is computed after that:
//! a wait for a connection or a lock never eats into the time it lies ahead of the clock.

mod ledger;
mod rows;
mod steps;

use sqlx::migrate::Migrator;

use crate::ledger::LedgerError;
#[cfg(feature = "postgres")]
pub(crate) use steps::{decide_in_postgres, finish_in_postgres};
#[cfg(feature = "sqlite")]
pub(crate) use steps::{decide_in_sqlite, finish_in_sqlite};

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

/// A [`Ledger`](crate::Ledger) in SQLite or PostgreSQL tables (`fx_operations`, `fx_intents`,
/// `fx_owned`), created by [`SqlLedger::migrate`]. Several handles (replicas) may share one
/// database.
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

    /// Connects to `url` (`sqlite:...` or `postgres://...`, read as a
    /// [`DatabaseUrl`](idempotency_sqlx::DatabaseUrl)) with `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, LedgerError> {
        let url: idempotency_sqlx::DatabaseUrl = url.parse().map_err(|e| LedgerError::Unavailable(Box::new(e)))?;
        match &url {
            #[cfg(feature = "postgres")]
            idempotency_sqlx::DatabaseUrl::Postgres(raw) => {
                let options = idempotency_sqlx::postgres_pool_options(max_connections);
                Ok(Self::postgres(idempotency_sqlx::connect_postgres(raw, options).await?))
            }
            #[cfg(feature = "sqlite")]
            idempotency_sqlx::DatabaseUrl::Sqlite(raw) => {
                let options = idempotency_sqlx::SqliteStore::connect_options(raw)
                    .map_err(|e| LedgerError::Unavailable(Box::new(e)))?;
                let pool = idempotency_sqlx::sqlite_pool_options(max_connections).connect_with(options).await?;
                Ok(Self::sqlite(pool))
            }
            _ => Err(LedgerError::Unavailable(format!("this build has no driver for the database {url}").into())),
        }
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

/// The ledger's migrations for SQLite (`true`) or PostgreSQL.
pub fn migrator(sqlite: bool) -> Migrator {
    let files: &[(&'static str, &'static str)] = if sqlite {
        idempotency_sqlx::embedded_migrations!(
            "migrations/sqlite",
            "20261202200001_effect_ledger.sql",
            "20261203100001_operation_subject.sql",
            "20261203200001_spent_tags.sql"
        )
    } else {
        idempotency_sqlx::embedded_migrations!(
            "migrations/postgres",
            "20261202200001_effect_ledger.sql",
            "20261203100001_operation_subject.sql",
            "20261203200001_spent_tags.sql"
        )
    };
    let mut m = idempotency_sqlx::embedded_migrator(files).expect("the file names are checked by a test");
    m.dangerous_set_table_name(MIGRATIONS_TABLE);
    m
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
