//! Test helpers (feature `testing`): a PostgreSQL database of one's own per test.
//!
//! Tests read the server's URL from `TEST_POSTGRES_URL` (for example
//! `postgres://postgres@127.0.0.1:5432/postgres`) and create a uniquely named database in it.
//! Without the variable a test prints a loud `SKIPPED` line and passes, except under `CI=true`,
//! where a missing database is a failure.
//!
//! ```no_run
//! # async fn demo() {
//! use idempotency_sqlx::testing::TestDatabase;
//!
//! let Some(db) = TestDatabase::create().await else { return }; // skipped, loudly
//! let store = idempotency_sqlx::PostgresStore::connect(db.url()).await.unwrap();
//! store.migrate().await.unwrap();
//! // ... the database is dropped when `db` goes out of scope.
//! # }
//! ```

use std::io::Write;

pub mod ha;
#[cfg(unix)]
mod server;
#[cfg(unix)]
pub use server::LocalServer;

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};

/// PostgreSQL's server binaries (`initdb`, `pg_ctl`, `pg_basebackup`): `pg_config --bindir`,
/// else the newest `/usr/lib/postgresql/<version>/bin`; `None` when there are none. What the
/// tests that start their own servers (and faultline's restarts) run.
pub fn postgres_bin_dir() -> Option<std::path::PathBuf> {
    use std::path::{Path, PathBuf};
    let has_tools = |dir: &Path| ["initdb", "pg_ctl", "pg_basebackup"].iter().all(|t| dir.join(t).is_file());
    let from_pg_config = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|d| has_tools(d));
    let newest = || {
        let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let version = e.file_name().to_str()?.split('.').next()?.parse::<u32>().ok()?;
                let bin = e.path().join("bin");
                has_tools(&bin).then_some((version, bin))
            })
            .collect();
        found.sort();
        found.pop().map(|(_, bin)| bin)
    };
    from_pg_config.or_else(newest)
}

/// The environment variable that holds the PostgreSQL server URL.
pub const TEST_POSTGRES_URL: &str = "TEST_POSTGRES_URL";

/// The server URL from `TEST_POSTGRES_URL`.
///
/// When it is missing: with `CI=true` this panics (CI must run every test); otherwise it
/// prints a loud `SKIPPED` line naming the current test to stderr and returns `None`.
pub fn postgres_server_url() -> Option<String> {
    match std::env::var(TEST_POSTGRES_URL) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let test = std::thread::current().name().unwrap_or("<unnamed>").to_owned();
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!(
                    "{test}: {TEST_POSTGRES_URL} is not set and CI=true: PostgreSQL tests must run in CI \
                     (e.g. {TEST_POSTGRES_URL}=postgres://postgres@127.0.0.1:5432/postgres)"
                );
            }
            // Straight to the stderr handle, not `eprintln!`: the test harness captures the
            // macro's output of passing tests, and a skip must be seen.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {test}: the PostgreSQL test did not run because {TEST_POSTGRES_URL} is not set"
            );
            None
        }
    }
}

/// A freshly created PostgreSQL database with a unique random name, dropped (`WITH (FORCE)`)
/// when this value is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    url: String,
    server_url: String,
}

impl TestDatabase {
    /// Creates a database on the `TEST_POSTGRES_URL` server; `None` when the test is skipped
    /// (see [`postgres_server_url`]).
    ///
    /// # Panics
    ///
    /// When the variable is set but the server cannot be reached or refuses `CREATE DATABASE`:
    /// a test that was asked to use PostgreSQL must fail then, not skip.
    pub async fn create() -> Option<TestDatabase> {
        let server_url = postgres_server_url()?;
        let name = format!("idem_test_{:032x}", rand::random::<u128>());
        let mut conn = PgConnection::connect(&server_url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {TEST_POSTGRES_URL}={server_url}: {e}"));
        conn.execute(AssertSqlSafe(format!(r#"CREATE DATABASE "{name}""#)))
            .await
            .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
        let _ = conn.close().await;
        let url = database_url(&server_url, &name);
        Some(TestDatabase { name, url, server_url })
    }

    /// The database's URL: the server URL with the database name replaced.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop is synchronous and may run inside a tokio runtime, where blocking on that
        // runtime would panic: a plain thread with a small runtime of its own does the work.
        let (server_url, name) = (self.server_url.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(async {
                let mut conn = PgConnection::connect(&server_url).await?;
                conn.execute(AssertSqlSafe(format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#))).await?;
                conn.close().await
            })
            .map_err(std::io::Error::other)
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("WARNING: could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("WARNING: dropping test database {} panicked", self.name),
        }
    }
}

/// `server_url` with its database (the path) replaced by `name`, keeping any query string.
fn database_url(server_url: &str, name: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let path = base[authority..].find('/').map_or(base.len(), |i| authority + i);
    let mut url = format!("{}/{name}", &base[..path]);
    if let Some(query) = query {
        url.push('?');
        url.push_str(query);
    }
    url
}

#[cfg(test)]
mod tests {
    use super::database_url;

    #[test]
    fn database_url_replaces_only_the_path() {
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(database_url("postgres://u:p@h/db?sslmode=disable", "t1"), "postgres://u:p@h/t1?sslmode=disable");
        assert_eq!(database_url("postgres://h:5432", "t1"), "postgres://h:5432/t1");
    }
}
