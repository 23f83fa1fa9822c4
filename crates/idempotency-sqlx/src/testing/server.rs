//! A PostgreSQL server of a test's own, for tests that stop, start, replicate or promote it.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A private PostgreSQL server: `initdb` in a temporary directory, one server on a free loopback
/// port, trust authentication, run as user `postgres` when the test runs as root (PostgreSQL
/// refuses to run as root). Stopped (immediately) and removed when dropped.
///
/// [`LocalServer::start`] returns `None` when PostgreSQL's server binaries are not installed:
/// it prints a loud `SKIPPED` line, or panics under `CI=true`, like
/// [`postgres_server_url`](super::postgres_server_url).
#[derive(Debug)]
pub struct LocalServer {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
    running: bool,
    /// While the server is stopped, its port is held here, so that no other test's listener
    /// (they take free ports from the same range) takes it before the server starts again.
    held_port: Option<idempotency::conformance::HeldPort>,
}

impl LocalServer {
    /// Makes and starts a fresh server; `None` (skipped) without the binaries.
    ///
    /// # Panics
    ///
    /// When the binaries are there but the server cannot be made or started.
    pub fn start() -> Option<Self> {
        let mut server = Self::empty()?;
        let data = server.data();
        server.run("initdb", &["-D", &data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]);
        server.start_again();
        Some(server)
    }

    /// Like [`LocalServer::start`], with TLS on (`ssl = on`): `cert_pem` is the server's
    /// certificate (chain), `key_pem` its private key, both PEM, kept in the server's directory
    /// with the modes PostgreSQL demands (the key owner-only). Clients may still connect without
    /// TLS unless they ask for it (`sslmode=require` or stricter).
    ///
    /// # Panics
    ///
    /// When the binaries are there but the server cannot be made or started.
    pub fn start_with_tls(cert_pem: &str, key_pem: &str) -> Option<Self> {
        let mut server = Self::empty()?;
        let data = server.data();
        server.run("initdb", &["-D", &data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]);
        let dir = server.dir.path().join("data");
        for (name, pem, mode) in [("server.crt", cert_pem, 0o644), ("server.key", key_pem, 0o600)] {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap_or_else(|e| panic!("writing {name}: {e}"));
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .unwrap_or_else(|e| panic!("chmod {name}: {e}"));
            if server.as_postgres {
                std::os::unix::fs::chown(&path, Some(id_of("-u")), Some(id_of("-g")))
                    .unwrap_or_else(|e| panic!("chown {name}: {e}"));
            }
        }
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join("postgresql.conf"))
            .expect("opening postgresql.conf");
        writeln!(conf, "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'")
            .expect("writing postgresql.conf");
        server.start_again();
        Some(server)
    }

    /// A standby of `primary`, copied with `pg_basebackup -R` (streaming replication) and
    /// started; `None` (skipped) without the binaries.
    ///
    /// # Panics
    ///
    /// When the copy or the start fails.
    pub fn standby_of(primary: &LocalServer) -> Option<Self> {
        let mut server = Self::empty()?;
        let (data, port) = (server.data(), primary.port.to_string());
        server.run(
            "pg_basebackup",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", "-D", &data, "-R", "-X", "stream", "--no-sync"],
        );
        server.start_again();
        Some(server)
    }

    fn empty() -> Option<Self> {
        let bin = bin_dir()?;
        let as_postgres = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let dir = tempfile::Builder::new().prefix("pg-test-").tempdir().expect("a temporary directory");
        if as_postgres {
            let (uid, gid) = (id_of("-u"), id_of("-g"));
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("handing the directory to postgres");
        }
        // Outside the ephemeral range: the server binds it only after initdb.
        let port = idempotency::conformance::free_ports(1)[0];
        Some(Self { bin, dir, port, as_postgres, running: false, held_port: None })
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/DB`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Whether the server was left running.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Whether the stopped server's port is held for it (see [`LocalServer::stop`]).
    pub fn holds_its_port(&self) -> bool {
        self.held_port.is_some()
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn command(&self, tool: &str, args: &[&str]) -> Command {
        let program = self.bin.join(tool);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        command.args(args).current_dir(self.dir.path()).stdin(Stdio::null());
        command
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self.command(tool, args).output().unwrap_or_else(|e| panic!("running {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }

    /// Starts the stopped server and waits until it accepts connections.
    pub fn start_again(&mut self) {
        let (data, socket) = (self.data(), self.dir.path().display().to_string());
        let log = self.dir.path().join("postgres.log").display().to_string();
        let options =
            format!("-p {} -k {socket} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100", self.port);
        self.held_port = None;
        self.run("pg_ctl", &["start", "-w", "-t", "120", "-D", &data, "-l", &log, "-o", &options]);
        self.running = true;
    }

    /// Stops the server at once (`-m immediate`: connections are cut with no checkpoint, as when
    /// the database machine dies; the next start recovers from the WAL).
    pub fn stop(&mut self) {
        let data = self.data();
        self.run("pg_ctl", &["stop", "-w", "-t", "120", "-m", "immediate", "-D", &data]);
        self.running = false;
        self.held_port = idempotency::conformance::HeldPort::hold(self.port);
    }

    /// Promotes a standby to primary and waits until it is one.
    pub fn promote(&self) {
        let data = self.data();
        self.run("pg_ctl", &["promote", "-w", "-t", "120", "-D", &data]);
    }

    /// The server's log so far, for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if self.running {
            let data = self.data();
            let _ = self
                .command("pg_ctl", &["stop", "-w", "-m", "immediate", "-D", &data])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// PostgreSQL's server binaries ([`postgres_bin_dir`](super::postgres_bin_dir)); `None`
/// (skipped, loudly) when there are none.
fn bin_dir() -> Option<PathBuf> {
    let found = super::postgres_bin_dir();
    if found.is_none() {
        let test = std::thread::current().name().unwrap_or("<unnamed>").to_owned();
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true" || v == "1"),
            "{test}: PostgreSQL's server binaries (initdb, pg_ctl, pg_basebackup) are not installed and CI=true"
        );
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: {test}: the test did not run because PostgreSQL's server binaries (initdb, pg_ctl, \
             pg_basebackup) are not installed"
        );
    }
    found
}

/// `id -u postgres` or `id -g postgres`.
fn id_of(flag: &str) -> u32 {
    let out = Command::new("id").args([flag, "postgres"]).output().expect("running id");
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("a user postgres to run PostgreSQL as")
}
