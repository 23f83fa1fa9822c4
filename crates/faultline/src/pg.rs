//! A fresh PostgreSQL database per run, dropped at the end.

use anyhow::{Context, bail};
use reqwest::Url;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

/// A database created for one run. Call [`TempDatabase::drop_now`] when the replicas are gone.
#[derive(Debug)]
pub struct TempDatabase {
    server_url: String,
    name: String,
    /// The URL of the new database, for `leasebroker serve --database`.
    pub url: String,
}

impl TempDatabase {
    /// Creates `faultline_<random>` on the server at `server_url` (any database URL on it).
    pub async fn create(server_url: &str) -> anyhow::Result<Self> {
        let name = format!("faultline_{}_{:08x}", std::process::id(), rand::random::<u32>());
        let mut url = Url::parse(server_url).with_context(|| format!("--postgres {server_url:?} is not a URL"))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            bail!("--postgres must be a postgres:// URL");
        }
        if !matches!(url.host_str(), Some("127.0.0.1" | "localhost" | "::1" | "[::1]")) {
            bail!("--postgres must point at a loopback address");
        }
        let mut conn = PgConnection::connect(server_url).await.context("connecting to PostgreSQL")?;
        // The name is ours (letters, digits, underscores): safe to put in the statement.
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .with_context(|| format!("creating database {name}"))?;
        conn.close().await.ok();
        url.set_path(&format!("/{name}"));
        Ok(TempDatabase { server_url: server_url.to_owned(), name, url: url.to_string() })
    }

    /// Drops the database (forcing out any connection still open).
    pub async fn drop_now(self) -> anyhow::Result<()> {
        let mut conn = PgConnection::connect(&self.server_url).await.context("connecting to PostgreSQL")?;
        sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)))
            .execute(&mut conn)
            .await
            .with_context(|| format!("dropping database {}", self.name))?;
        conn.close().await.ok();
        Ok(())
    }
}
