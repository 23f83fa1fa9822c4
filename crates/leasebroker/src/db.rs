//! The database both stores share: SQLite (embedded default) or PostgreSQL (several replicas).
//!
//! Domain SQL is written once with `$N` placeholders, which both drivers accept; [`with_pool!`]
//! runs the same code against whichever pool is configured.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use idempotency::Store;
use idempotency_sqlx::{PostgresStore, SqliteStore};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

/// A connection pool on one of the two supported databases.
#[derive(Debug, Clone)]
pub enum Db {
    /// SQLite, one file.
    Sqlite(SqlitePool),
    /// PostgreSQL, possibly shared by several replicas.
    Postgres(PgPool),
}

/// Runs `$body` with `$p` bound to the concrete pool.
macro_rules! with_pool {
    ($db:expr, $p:ident => $body:expr) => {
        match $db {
            $crate::db::Db::Sqlite($p) => $body,
            $crate::db::Db::Postgres($p) => $body,
        }
    };
}
pub(crate) use with_pool;

/// The table that records leasebroker's own migrations, apart from the idempotency store's.
const MIGRATIONS_TABLE: &str = "_leasebroker_migrations";

impl Db {
    /// Connects to `url` (`sqlite://PATH`, `sqlite:PATH` or `postgres://...`).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = idempotency_sqlx::postgres_pool_options(16)
                .acquire_timeout(Duration::from_secs(5))
                .connect(url)
                .await
                .with_context(|| format!("cannot connect to PostgreSQL at {}", redact(url)))?;
            Ok(Self::Postgres(pool))
        } else if url.starts_with("sqlite:") {
            let opts = SqliteConnectOptions::from_str(url)
                .with_context(|| format!("bad SQLite URL {url:?}"))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                // NORMAL in WAL mode survives a process crash (SIGKILL), which is the failure
                // this service is built for; FULL would add an fsync per commit for power loss.
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10))
                .foreign_keys(true);
            let pool = idempotency_sqlx::sqlite_pool_options(8)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(opts)
                .await
                .with_context(|| format!("cannot open SQLite database {url:?}"))?;
            Ok(Self::Sqlite(pool))
        } else {
            anyhow::bail!("unsupported database URL {:?}: use sqlite://PATH or postgres://...", redact(url))
        }
    }

    /// Creates or upgrades every table: the idempotency store's and leasebroker's own.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        match self {
            Self::Sqlite(p) => {
                SqliteStore::from_pool(p.clone()).migrate().await.context("idempotency store migrations")?;
                let mut m = sqlx::migrate!("./migrations/sqlite");
                m.dangerous_set_table_name(MIGRATIONS_TABLE);
                m.run(p).await.context("leasebroker migrations")?;
            }
            Self::Postgres(p) => {
                PostgresStore::from_pool(p.clone()).migrate().await.context("idempotency store migrations")?;
                let mut m = sqlx::migrate!("./migrations/postgres");
                m.dangerous_set_table_name(MIGRATIONS_TABLE);
                m.run(p).await.context("leasebroker migrations")?;
            }
        }
        Ok(())
    }

    /// The idempotency store on the same database.
    pub fn idempotency_store(&self) -> Arc<dyn Store> {
        match self {
            Self::Sqlite(p) => Arc::new(SqliteStore::from_pool(p.clone())),
            Self::Postgres(p) => Arc::new(PostgresStore::from_pool(p.clone())),
        }
    }

    /// True for PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(super::redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(super::redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(super::redact("sqlite://x.db"), "sqlite://x.db");
    }
}
