//! The database both stores share: SQLite (embedded default) or PostgreSQL (several replicas).
//!
//! Domain SQL is written once with `$N` placeholders, which both drivers accept; `with_pool!`
//! runs the same code against whichever pool is configured.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use idempotency::Store;
use idempotency_sqlx::{PostgresStore, SqliteStore, embedded_migrator};
use idempotency_stores::DatabaseUrl;
/// The URL or connection string without its secrets, for messages and logs.
pub use idempotency_stores::redact;
use sqlx::migrate::Migrator;
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

/// SQLite connections by default: one. SQLite commits one writer at a time, and a writer that
/// finds the file locked sleeps and retries (the busy timeout, in steps of up to 100 ms), so
/// several connections that write at once wait in those sleeps rather than in turn: under load
/// a few requests sleep for hundreds of milliseconds while others pass. With one connection the
/// pool's queue (first come, first served) is the writer queue, shared by the domain tables and
/// the idempotency store on the same file; each commit is still `synchronous = FULL`.
/// `leasebroker serve --sqlite-connections` sets it.
pub const DEFAULT_SQLITE_CONNECTIONS: u32 = 1;

/// How long a request waits for a PostgreSQL connection. While the database is unreachable,
/// the pool keeps trying to connect for this long and then fails the statement, so every route
/// answers `503 store-unavailable` within 5 s (docs/protocol.md#running-leasebroker), with time to spare for the answer.
pub const PG_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// The table that records leasebroker's own migrations, apart from the idempotency store's.
const MIGRATIONS_TABLE: &str = "_leasebroker_migrations";

fn leasebroker_migrator(files: &[(&'static str, &'static str)]) -> Migrator {
    let mut migrator = embedded_migrator(files).expect("the file names are checked by a test");
    migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
    migrator
}

/// leasebroker's migrations in `dir`: each store has its own folder with the same file names.
macro_rules! migrations_in {
    ($dir:literal) => {
        idempotency_sqlx::embedded_migrations!(
            $dir,
            "0001_domain.sql",
            "0002_operations.sql",
            "0003_rollback_fence.sql",
            "0004_flash_operations.sql",
            "0005_free_node_index.sql",
            "0006_operation_marks.sql",
            "0030_record_audit.sql",
            "0031_effect_ledger.sql",
            "0032_flash_uncertain.sql",
        )
    };
}

/// leasebroker's own SQLite migrations (`migrations/sqlite/`).
pub(crate) fn sqlite_migrator() -> Migrator {
    leasebroker_migrator(migrations_in!("migrations/sqlite"))
}

/// leasebroker's own PostgreSQL migrations (`migrations/postgres/`).
pub(crate) fn postgres_migrator() -> Migrator {
    leasebroker_migrator(migrations_in!("migrations/postgres"))
}

impl Db {
    /// Connects to `url` (`sqlite://PATH`, `sqlite:PATH` or `postgres://...`), with
    /// [`DEFAULT_SQLITE_CONNECTIONS`] on SQLite.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        Self::connect_with(&url.parse()?, DEFAULT_SQLITE_CONNECTIONS).await
    }

    /// Connects to `url`; a SQLite pool has `sqlite_connections` connections (at least 1).
    pub async fn connect_with(url: &DatabaseUrl, sqlite_connections: u32) -> anyhow::Result<Self> {
        match url {
            DatabaseUrl::Postgres(raw) => {
                let options = idempotency_sqlx::postgres_pool_options(16).acquire_timeout(PG_ACQUIRE_TIMEOUT);
                let pool = idempotency_sqlx::connect_postgres(raw, options)
                    .await
                    .with_context(|| format!("cannot connect to PostgreSQL at {url}"))?;
                Ok(Self::Postgres(pool))
            }
            DatabaseUrl::Sqlite(raw) => {
                let opts = SqliteConnectOptions::from_str(raw)
                    .with_context(|| format!("bad SQLite URL {url}"))?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    // FULL: a commit is on disk before it is acknowledged, so a power cut cannot
                    // lose a completed record or a hypervisor intent (NORMAL in WAL mode can lose
                    // the last commits, and the retry would then boot again). Its cost is in
                    // docs/security.md.
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(Duration::from_secs(10))
                    .foreign_keys(true);
                if !url.is_sqlite_memory() {
                    create_owner_only(opts.get_filename())?;
                }
                let pool = idempotency_sqlx::sqlite_pool_options(sqlite_connections.max(1))
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(opts)
                    .await
                    .with_context(|| format!("cannot open SQLite database {url}"))?;
                Ok(Self::Sqlite(pool))
            }
            _ => anyhow::bail!("unsupported database URL {url}: use sqlite://PATH or postgres://..."),
        }
    }

    /// Creates or upgrades every table: the idempotency store's and leasebroker's own.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        match self {
            Self::Sqlite(p) => {
                SqliteStore::from_pool(p.clone()).migrate().await.context("idempotency store migrations")?;
                idempotency_effects::migrator(true).run(p).await.context("effect ledger migrations")?;
                sqlite_migrator().run(p).await.context("leasebroker migrations")?;
            }
            Self::Postgres(p) => {
                PostgresStore::from_pool(p.clone()).migrate().await.context("idempotency store migrations")?;
                idempotency_effects::migrator(false).run(p).await.context("effect ledger migrations")?;
                postgres_migrator().run(p).await.context("leasebroker migrations")?;
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

    /// The effect ledger (`idempotency-effects`) on the same database: every side effect's
    /// intent and every operation's mark.
    pub fn ledger(&self) -> idempotency_effects::SqlLedger {
        match self {
            Self::Sqlite(p) => idempotency_effects::SqlLedger::sqlite(p.clone()),
            Self::Postgres(p) => idempotency_effects::SqlLedger::postgres(p.clone()),
        }
    }

    /// True for PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }
}

/// Refuses an existing database file, or its WAL or shared-memory file, that group or others
/// may read or write: it holds every tenant's stored responses, and anyone who can write it can
/// plant a record that is then replayed as if it were the service's own answer.
#[cfg(unix)]
fn refuse_exposed(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let file = Path::new(&file);
        let Ok(meta) = std::fs::metadata(file) else { continue };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            anyhow::bail!(
                "{} is readable or writable by group or others (mode {mode:03o}); make it owner-only with \
                 `chmod 600 {}` and start again",
                file.display(),
                file.display()
            );
        }
    }
    Ok(())
}

/// Creates the SQLite file (and any missing directories) readable by its owner only, before
/// SQLite opens it: SQLite gives the WAL and shared-memory files the database file's mode, so they
/// are owner-only too. An existing directory is left as it is; an existing file that group or
/// others can read or write is refused.
fn create_owner_only(path: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("cannot create the directory {}", dir.display()))?;
        }
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => refuse_exposed(path)?,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", path.display())),
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{postgres_migrator, sqlite_migrator};

    /// The compiled-in lists hold every file of their directory, read exactly as sqlx reads it
    /// (a migration added to the directory but not to the list fails here).
    #[tokio::test]
    async fn the_embedded_migrations_are_the_directories() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for (migrator, dir) in [(sqlite_migrator(), "migrations/sqlite"), (postgres_migrator(), "migrations/postgres")]
        {
            let (ours, sqlx) = idempotency_sqlx::compare_with_directory(&migrator, &root.join(dir)).await;
            assert_eq!(ours, sqlx, "{dir}");
        }
    }

    #[tokio::test]
    async fn sqlite_commits_are_synchronous_full() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = super::Db::connect(&format!("sqlite://{}", dir.path().join("s.db").display())).await.expect("db");
        let super::Db::Sqlite(pool) = &db else { panic!("sqlite") };
        let level: i64 = sqlx::query_scalar("PRAGMA synchronous").fetch_one(pool).await.expect("pragma");
        assert_eq!(level, 2, "FULL is 2, NORMAL is 1");
    }
}
