//! A real highly available PostgreSQL for tests and the fault harness: three PostgreSQL members
//! run by Patroni, their leader lock in a one-member etcd, and HAProxy in front that sends every
//! connection to the current primary (it follows Patroni's REST `GET /primary` health check), all
//! on free loopback ports in a temporary directory, and all killed and removed when dropped.
//!
//! The binaries come from the machine (Debian packages `patroni`, `etcd-server`, `etcd-client`,
//! `haproxy`, and PostgreSQL's server under `/usr/lib/postgresql/*/bin`); [`missing_binaries`]
//! names what is not there. Run as root, PostgreSQL and Patroni run as user `postgres`.
//!
//! ```no_run
//! use idempotency_sqlx::testing::ha::{HaPostgres, Replication};
//!
//! let mut pg = HaPostgres::start(Replication::Synchronous).expect("start");
//! println!("the primary, whichever member it is: {}", pg.url());
//! pg.switchover().expect("switchover");        // a planned change of primary
//! let killed = pg.kill_primary().expect("kill"); // the primary's machine dies
//! pg.wait_until_primary(std::time::Duration::from_secs(60)).expect("a new primary");
//! pg.restart(killed).expect("rejoins as a replica");
//! ```

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod config;

use config::{Shared, haproxy_config, member_config};

/// How a member's commit waits for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// Patroni's `synchronous_mode`: a commit returns once a synchronous standby has its WAL,
    /// and only that standby may be promoted. Nothing acknowledged is lost in a failover.
    Synchronous,
    /// Asynchronous streaming (PostgreSQL's default): a failover may lose the last commits.
    Asynchronous,
}

/// One Patroni member: its PostgreSQL port, REST port and data directory.
#[derive(Debug)]
struct Member {
    name: String,
    pg_port: u16,
    api_port: u16,
    config: PathBuf,
    data: PathBuf,
    child: Option<Child>,
}

/// The cluster; see the module docs.
#[derive(Debug)]
pub struct HaPostgres {
    members: Vec<Member>,
    etcd: Option<Child>,
    haproxy: Option<Child>,
    proxy_port: u16,
    replication: Replication,
    owner: Option<(u32, u32)>,
    /// etcd's data, in memory (`/dev/shm`) where there is one: etcd syncs every write to disk,
    /// and on a busy disk a slow sync makes the leader miss its lock renewal and step down.
    etcd_dir: tempfile::TempDir,
    dir: tempfile::TempDir,
}

/// What is missing of the binaries the cluster needs (empty when all are there).
pub fn missing_binaries() -> Vec<&'static str> {
    let runs = |b: &str, version: &str| {
        Command::new(b).arg(version).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    let mut missing = vec![];
    for (bin, version, package) in
        [("patroni", "--version", "patroni"), ("etcd", "--version", "etcd-server"), ("haproxy", "-v", "haproxy")]
    {
        if !runs(bin, version) {
            missing.push(package);
        }
    }
    if pg_bin_dir().is_none() {
        missing.push("postgresql (server binaries under /usr/lib/postgresql/*/bin)");
    }
    missing
}

fn pg_bin_dir() -> Option<PathBuf> {
    super::postgres_bin_dir()
}

/// The uid and gid of user `postgres` when this process runs as root (PostgreSQL refuses root).
fn postgres_owner() -> Result<Option<(u32, u32)>, String> {
    let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
    if !root {
        return Ok(None);
    }
    let id = |flag: &str| -> Result<u32, String> {
        let out = Command::new("id").args([flag, "postgres"]).output().map_err(|e| format!("id: {e}"))?;
        String::from_utf8_lossy(&out.stdout).trim().parse().map_err(|_| "no user postgres to run PostgreSQL as".into())
    };
    Ok(Some((id("-u")?, id("-g")?)))
}

/// One HTTP/1.0 request to a loopback port: the status and the body.
fn http(port: u16, method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2))
        .map_err(|e| format!("127.0.0.1:{port}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).map_err(|e| e.to_string())?;
    let status = reply.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("bad reply {reply:?}"))?;
    let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// A member as Patroni's `GET /cluster` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    /// Its name (`m0`, `m1`, `m2`).
    pub name: String,
    /// `leader`, `sync_standby` or `replica`.
    pub role: String,
    /// `running`, `streaming`, `starting`, `stopped`, ...
    pub state: String,
}

impl HaPostgres {
    /// Starts etcd, three Patroni members (the first to take the leader lock bootstraps with
    /// `initdb`, the others copy it with `pg_basebackup`) and HAProxy, and returns once a
    /// primary and two running replicas (one of them the synchronous standby, with
    /// [`Replication::Synchronous`]) are there and the proxy sends connections to the primary.
    pub fn start(replication: Replication) -> Result<Self, String> {
        let missing = missing_binaries();
        if !missing.is_empty() {
            return Err(format!("missing: {}", missing.join(", ")));
        }
        let bin = pg_bin_dir().ok_or("no PostgreSQL server binaries")?;
        let owner = postgres_owner()?;
        let dir = tempfile::Builder::new().prefix("ha-pg-").tempdir().map_err(|e| e.to_string())?;
        // Outside the kernel's ephemeral range: the members' PostgreSQL and HAProxy bind theirs
        // only once the members run, minutes later on a loaded machine, and a port let go of in
        // that range can be any socket's by then (HAProxy then never listens).
        let ports = idempotency::conformance::free_ports(9);
        let (etcd_client, etcd_peer, proxy_port) = (ports[0], ports[1], ports[2]);
        let mut members = vec![];
        for i in 0..3 {
            let name = format!("m{i}");
            let (pg_port, api_port) = (ports[3 + 2 * i], ports[4 + 2 * i]);
            let data = dir.path().join(format!("data-{name}"));
            let config = dir.path().join(format!("{name}.yml"));
            members.push(Member { name, pg_port, api_port, config, data, child: None });
        }
        let shared = Shared { etcd_port: etcd_client, bin: &bin, dir: dir.path(), replication };
        for m in &members {
            std::fs::write(&m.config, member_config(m, &shared)).map_err(|e| e.to_string())?;
        }
        std::fs::write(dir.path().join("haproxy.cfg"), haproxy_config(proxy_port, &members, dir.path()))
            .map_err(|e| e.to_string())?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        }
        let shm = Path::new("/dev/shm");
        let etcd_dir = if shm.is_dir() {
            tempfile::Builder::new().prefix("ha-etcd-").tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .map_err(|e| e.to_string())?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(etcd_dir.path(), Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        }
        let mut cluster =
            HaPostgres { members, etcd: None, haproxy: None, proxy_port, replication, owner, etcd_dir, dir };
        let peer = format!("http://127.0.0.1:{etcd_peer}");
        let client = format!("http://127.0.0.1:{etcd_client}");
        let etcd_dir = cluster.etcd_dir.path().join("data");
        let etcd_args = [
            "--name",
            "e0",
            "--data-dir",
            &etcd_dir.display().to_string(),
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("e0={peer}"),
            "--log-level",
            "warn",
        ]
        .map(str::to_owned);
        cluster.etcd = Some(cluster.spawn("etcd", &etcd_args, "etcd.log", true)?);
        wait(Duration::from_secs(30), "etcd to answer", || {
            http(etcd_client, "GET", "/health", "").is_ok_and(|(s, _)| s == 200)
        })?;
        for i in 0..3 {
            cluster.start_member(i)?;
        }
        cluster.wait_until_healthy(Duration::from_secs(120))?;
        let cfg = cluster.dir.path().join("haproxy.cfg").display().to_string();
        cluster.haproxy =
            Some(cluster.spawn("haproxy", &["-f".to_owned(), cfg, "-db".to_owned()], "haproxy.log", false)?);
        // Generous: on a loaded machine Patroni's REST API, which the proxy's checks ask, answers
        // slowly.
        cluster.wait_until_primary(Duration::from_secs(120))?;
        Ok(cluster)
    }

    fn spawn(&self, program: &str, args: &[String], log: &str, as_owner: bool) -> Result<Child, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(log))
            .map_err(|e| e.to_string())?;
        let mut command = Command::new(program);
        command
            .args(args)
            .current_dir(self.dir.path())
            .env("HOME", self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        if let (true, Some((uid, gid))) = (as_owner, self.owner) {
            command.uid(uid).gid(gid);
        }
        command.spawn().map_err(|e| format!("{program}: {e}"))
    }

    fn start_member(&mut self, i: usize) -> Result<(), String> {
        let config = self.members[i].config.display().to_string();
        let log = format!("patroni-{}.log", self.members[i].name);
        let child = self.spawn("patroni", &[config], &log, true)?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// `postgres://postgres@127.0.0.1:PROXY/postgres`: through HAProxy, to the primary.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.proxy_port)
    }

    /// The URL of member `i` itself (primary or replica), for reading what it holds.
    pub fn member_url(&self, i: usize) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.members[i].pg_port)
    }

    /// The replication the cluster was started with.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The members as Patroni lists them (asked of any member whose REST API answers).
    pub fn members(&self) -> Result<Vec<MemberState>, String> {
        let mut last = String::from("no member was asked");
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            match http(m.api_port, "GET", "/cluster", "") {
                Ok((200, body)) => return parse_members(&body),
                Ok((status, body)) => last = format!("{status} {body}"),
                Err(e) => last = e,
            }
        }
        Err(format!("no member answered GET /cluster: {last}"))
    }

    /// The index of the primary (Patroni's leader), if there is one now.
    pub fn primary(&self) -> Option<usize> {
        let members = self.members().ok()?;
        let leader = members.iter().find(|m| m.role == "leader" && m.state == "running")?;
        self.members.iter().position(|m| m.name == leader.name)
    }

    /// Waits until every live member runs, one of them the primary (and one the synchronous
    /// standby, with synchronous replication, when two or more run).
    pub fn wait_until_healthy(&self, within: Duration) -> Result<(), String> {
        let live = self.members.iter().filter(|m| m.child.is_some()).count();
        let sync = self.replication == Replication::Synchronous;
        let mut last = String::from("no answer yet");
        let mut seen = vec![];
        wait(within, "the cluster to be healthy", || {
            let members = match self.members() {
                Ok(members) => members,
                Err(e) => {
                    last = e;
                    return false;
                }
            };
            last = format!("{members:?}");
            seen.clone_from(&members);
            let running = members.iter().filter(|m| matches!(m.state.as_str(), "running" | "streaming")).count();
            let leader = members.iter().any(|m| m.role == "leader" && m.state == "running");
            let standby = members.iter().any(|m| m.role == "sync_standby");
            leader && running == live && (!sync || live < 2 || standby)
        })
        // What the members said last, to tell a slow start from a stuck one, and the logs of
        // the live members that were not running (removed with the cluster).
        .map_err(|e| format!("{e}; the members last: {last}{}", self.logs_of_members_not_running(&seen)))
    }

    /// `; patroni-NAME.log: ...` with the last lines of the log of each live member that `seen`
    /// does not show running (or does not show at all); empty when every one ran.
    fn logs_of_members_not_running(&self, seen: &[MemberState]) -> String {
        let runs =
            |name: &str| seen.iter().any(|m| m.name == name && matches!(m.state.as_str(), "running" | "streaming"));
        let mut out = String::new();
        for member in self.members.iter().filter(|m| m.child.is_some() && !runs(&m.name)) {
            let file = format!("patroni-{}.log", member.name);
            let log = std::fs::read_to_string(self.dir.path().join(&file)).unwrap_or_default();
            let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            let _ = write!(out, "; {file}: {}", lines[lines.len().saturating_sub(8)..].join(" | "));
        }
        out
    }

    /// Waits until there is a primary and HAProxy sends connections to it.
    pub fn wait_until_primary(&self, within: Duration) -> Result<usize, String> {
        let mut found = None;
        let mut last = String::from("no answer yet");
        wait(within, "a primary behind the proxy", || {
            let primary = self.primary();
            let proxy = self.proxy_view();
            last = format!("primary {primary:?}, the proxy's checks {proxy:?}");
            found = primary.filter(|&i| sends_only_to(&proxy, &self.members, i));
            found.is_some()
        })
        // What Patroni and HAProxy said last, to tell a slow start from a stuck one, and the
        // proxy's own log (removed with the cluster) when its stats socket never answered.
        .map_err(|e| format!("{e}; last: {last}{}", self.proxy_log_when_silent()))?;
        found.ok_or_else(|| "no primary".into())
    }

    /// Each member's status in HAProxy's health checks (`UP`, `DOWN`, `UP 1/2`...), as its
    /// stats socket tells; empty when the proxy does not answer.
    fn proxy_view(&self) -> Vec<(String, String)> {
        let socket = self.dir.path().join("haproxy.sock");
        let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else { return vec![] };
        if s.write_all(b"show stat\n").is_err() {
            return vec![];
        }
        let mut csv = String::new();
        let _ = s.read_to_string(&mut csv);
        csv.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                let ours = f.len() > 17 && f[0] == "primary" && self.members.iter().any(|m| m.name == f[1]);
                ours.then(|| (f[1].to_owned(), f[17].to_owned()))
            })
            .collect()
    }

    /// `; haproxy.log: ...` with the log's last lines when the proxy's stats socket does not
    /// answer (the proxy exited, or never listened); empty otherwise.
    fn proxy_log_when_silent(&self) -> String {
        if !self.proxy_view().is_empty() {
            return String::new();
        }
        let log = std::fs::read_to_string(self.dir.path().join("haproxy.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        format!("; haproxy.log: {}", lines[lines.len().saturating_sub(5)..].join(" | "))
    }

    /// A planned change of primary (Patroni's `POST /switchover`, to any healthy replica; with
    /// synchronous replication, to the synchronous standby). Returns once the new primary is
    /// behind the proxy and every member runs again.
    pub fn switchover(&mut self) -> Result<usize, String> {
        let old = self.wait_until_primary(Duration::from_secs(60))?;
        let body = format!("{{\"leader\": \"{}\"}}", self.members[old].name);
        let (status, reply) = http(self.members[old].api_port, "POST", "/switchover", &body)?;
        if status != 200 {
            return Err(format!("switchover: {status} {reply}"));
        }
        let new = self.wait_until_new_primary(old)?;
        self.wait_until_healthy(Duration::from_secs(120))?;
        Ok(new)
    }

    /// Waits until a member other than `old` is the primary and HAProxy sends connections to
    /// it (after a kill, Patroni lists the dead leader until its lock expires).
    pub fn wait_until_new_primary(&self, old: usize) -> Result<usize, String> {
        let mut found = None;
        let mut last = String::from("no answer yet");
        wait(Duration::from_secs(120), "a new primary behind the proxy", || {
            let primary = self.primary();
            let proxy = self.proxy_view();
            last = format!("primary {primary:?}, the proxy's checks {proxy:?}");
            found = primary.filter(|&i| i != old && sends_only_to(&proxy, &self.members, i));
            found.is_some()
        })
        .map_err(|e| format!("{e}; last: {last}{}", self.proxy_log_when_silent()))?;
        found.ok_or_else(|| "no primary".into())
    }

    /// The primary's machine dies: its Patroni and its PostgreSQL are killed (SIGKILL), so its
    /// leader lock expires (after the `ttl`, 20 s) and a replica is promoted. Returns the killed
    /// member's index; [`HaPostgres::restart`] brings it back as a replica.
    pub fn kill_primary(&mut self) -> Result<usize, String> {
        let old = self.wait_until_primary(Duration::from_secs(60))?;
        self.kill_member(old);
        Ok(old)
    }

    /// Kills member `i` (Patroni and PostgreSQL, SIGKILL).
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let pid = std::fs::read_to_string(self.members[i].data.join("postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()));
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
        }
    }

    /// After [`HaPostgres::kill_primary`], once a new primary runs: starts member `i` again; it
    /// rejoins as a replica (rewound with `pg_rewind` where its timeline went on alone). Returns
    /// once every member runs.
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        // Not before another member took over: restarted while its lock lives, it would take
        // its own place back.
        self.wait_until_new_primary(i)?;
        self.start_member(i)?;
        self.wait_until_healthy(Duration::from_secs(120))
    }

    /// The directory holding every member's data and logs (`patroni-m0.log`, `haproxy.log`, ...).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for HaPostgres {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
        for child in [self.haproxy.take(), self.etcd.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether HAProxy's health checks (`proxy`, [`HaPostgres::proxy_view`]) have member `i` up and
/// every other member down, so that it sends every connection to `i` (at its start HAProxy takes
/// every server for up until its checks say otherwise, and a server failing its checks stays up
/// until the second).
fn sends_only_to(proxy: &[(String, String)], members: &[Member], i: usize) -> bool {
    let status = |name: &str| proxy.iter().find(|(n, _)| n == name).map(|(_, s)| s.as_str()).unwrap_or_default();
    // "UP 1/2" is a server on its way down that still gets connections: only "DOWN" is down.
    members.iter().enumerate().all(|(j, m)| {
        let status = status(&m.name);
        if j == i { status == "UP" } else { status.starts_with("DOWN") }
    })
}

fn wait(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {within:?} waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn parse_members(body: &str) -> Result<Vec<MemberState>, String> {
    let v: serde_json::Value = serde_json::from_str(body).map_err(|e| format!("GET /cluster: {e}"))?;
    let field = |m: &serde_json::Value, k: &str| m[k].as_str().unwrap_or_default().to_owned();
    Ok(v["members"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .map(|m| MemberState { name: field(m, "name"), role: field(m, "role"), state: field(m, "state") })
                .collect()
        })
        .unwrap_or_default())
}
