//! A fresh PostgreSQL database per run, dropped at the end, and a PostgreSQL cluster of
//! faultline's own for runs that restart the database.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use anyhow::{Context, anyhow, bail};
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

/// A PostgreSQL cluster of faultline's own, for runs that stop and start the database: initdb in
/// a temporary directory, one server on a free loopback port, run as user `postgres` when
/// faultline runs as root (PostgreSQL refuses to run as root). Stopped and removed on drop.
#[derive(Debug)]
pub struct LocalCluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
    running: bool,
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
    /// Times it was stopped and started again.
    pub restarts: u32,
    /// While it is stopped, its port is held here, so that no other listener takes it.
    held_port: Option<idempotency::conformance::HeldPort>,
}

impl LocalCluster {
    /// Makes and starts a fresh cluster.
    pub async fn start() -> anyhow::Result<Self> {
        let bin = pg_bin_dir()?;
        let as_postgres = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let dir = tempfile::Builder::new().prefix("faultline-pg-").tempdir().context("temporary directory")?;
        if as_postgres {
            let uid = id_of("-u")?;
            let gid = id_of("-g")?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).context("handing the cluster to postgres")?;
        }
        let port = crate::cluster::free_port()?;
        let mut cluster = LocalCluster {
            bin,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
            port,
            as_postgres,
            running: false,
            restarts: 0,
            held_port: None,
        };
        let data = cluster.data();
        cluster
            .run("initdb", &["-D", &data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .await
            .context("initdb")?;
        cluster.start_again().await?;
        Ok(cluster)
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn command(&self, tool: &str, args: &[&str]) -> tokio::process::Command {
        let program = self.bin.join(tool);
        let mut command = if self.as_postgres {
            let mut c = tokio::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            tokio::process::Command::new(program)
        };
        command.args(args).current_dir(self.dir.path()).stdin(std::process::Stdio::null());
        command
    }

    async fn run(&self, tool: &str, args: &[&str]) -> anyhow::Result<()> {
        let out = self.command(tool, args).output().await.with_context(|| format!("running {tool}"))?;
        if !out.status.success() {
            bail!("{tool} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// Whether the server is up.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Starts the stopped server (waits until it accepts connections).
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        let (data, socket) = (self.data(), self.dir.path().display().to_string());
        let log = self.dir.path().join("postgres.log").display().to_string();
        let options =
            format!("-p {} -k {socket} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", self.port);
        self.held_port = None;
        self.run("pg_ctl", &["start", "-w", "-t", "60", "-D", &data, "-l", &log, "-o", &options])
            .await
            .context("pg_ctl start")?;
        self.running = true;
        Ok(())
    }

    /// Stops the server at once (`-m immediate`: connections are cut, no checkpoint, as when the
    /// database machine dies; the next start recovers from the WAL).
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        let data = self.data();
        self.run("pg_ctl", &["stop", "-w", "-m", "immediate", "-D", &data]).await.context("pg_ctl stop")?;
        self.running = false;
        self.held_port = idempotency::conformance::HeldPort::hold(self.port);
        Ok(())
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if self.running {
            let mut command = self.command("pg_ctl", &["stop", "-w", "-m", "immediate", "-D", &self.data()]);
            // Drop cannot await: run it to the end on a plain thread's blocking wait.
            let std_command = command.as_std_mut();
            let _ = std_command.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status();
        }
    }
}

/// The newest `/usr/lib/postgresql/<version>/bin` with initdb and pg_ctl in it.
fn pg_bin_dir() -> anyhow::Result<PathBuf> {
    idempotency_sqlx::testing::postgres_bin_dir().ok_or_else(|| {
        anyhow!(
            "no initdb, pg_ctl and pg_basebackup (pg_config --bindir, /usr/lib/postgresql/*/bin): \
             install PostgreSQL's server binaries for --postgres-restarts"
        )
    })
}

/// `id -u postgres` or `id -g postgres`.
fn id_of(flag: &str) -> anyhow::Result<u32> {
    let out = std::process::Command::new("id").args([flag, "postgres"]).output().context("running id")?;
    String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| anyhow!("no user postgres to run PostgreSQL as"))
}
