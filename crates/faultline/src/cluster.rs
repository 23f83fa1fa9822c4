//! The real processes: a standalone hypervisor simulator and one or more replicas, each a
//! `leasebroker serve` or (`faultline run --gateway`) an `idempotency-gateway`. A replica first listens on a port the kernel gives it (never one picked up front
//! and let go of, which another process can take in between) and comes back on that same port
//! after a kill.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use rustix::process::{Pid, Signal, kill_process};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long a process may take to print its `listening on` line.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The admin token every replica is started with.
pub const ADMIN_TOKEN: &str = "faultline-admin-token";

/// A principal's name and bearer token.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The principal.
    pub name: String,
    /// Its token.
    pub token: String,
}

/// The principals `p0`, `p1`, ... with tokens `faultline-token-p0`, ...
pub fn principals(n: u32) -> Vec<Principal> {
    (0..n).map(|i| Principal { name: format!("p{i}"), token: format!("faultline-token-p{i}") }).collect()
}

/// A free loopback port for a server that binds it later (faultline's own PostgreSQL, which
/// cannot be started on port 0): outside the kernel's ephemeral range, where no other socket is
/// given it meanwhile (see [`idempotency::conformance::free_ports`]).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(idempotency::conformance::free_ports(1)[0])
}

/// How many of a log's last lines an error about its process quotes.
const LOG_LINES: usize = 5;

/// The last `n` non-blank lines of `log`, joined by " | ": an error quotes them because the
/// log's folder is removed with the run, before anyone reads the error.
fn last_lines(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(n)..].join(" | ");
    if tail.is_empty() { "its log is empty".to_owned() } else { tail }
}

/// A child process that printed `listening on http://ADDR`; killed when dropped.
#[derive(Debug)]
pub(crate) struct Running {
    child: Child,
}

/// Sends `which` (`Signal::STOP`, `Signal::CONT`) to process `pid`.
fn signal(pid: u32, which: Signal) -> anyhow::Result<()> {
    let target = i32::try_from(pid).ok().and_then(Pid::from_raw).with_context(|| format!("{pid} is not a pid"))?;
    kill_process(target, which).with_context(|| format!("sending {which:?} to {pid}"))
}

/// Starts `command` (stdout piped, stderr appended to `log`), waits for its `listening on` line and
/// returns the process and the address it printed.
pub(crate) async fn start(mut command: Command, log: &Path) -> anyhow::Result<(Running, SocketAddr)> {
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("{}", log.display()))?;
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log_file)).kill_on_drop(true);
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "warn");
    }
    let mut child = command.spawn().context("spawning")?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(READY_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let addr = rest.split_whitespace().next().unwrap_or_default();
                return addr.parse::<SocketAddr>().with_context(|| format!("bad address in {line:?}"));
            }
        }
        bail!("exited before it was ready (see {}): {}", log.display(), last_lines(log, LOG_LINES))
    })
    .await
    .map_err(|_| anyhow!("not ready within {READY_TIMEOUT:?} (see {})", log.display()))??;
    // Keep draining stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((Running { child }, addr))
}

/// The simulator's faults (`leasebroker hypervisor-sim` flags).
#[derive(Debug, Clone, Copy, Default)]
pub struct SimFaults {
    /// `--fail-before`.
    pub fail_before: f64,
    /// `--fail-after`.
    pub fail_after: f64,
    /// `--latency-ms`.
    pub latency_ms: u64,
    /// `--slow`.
    pub slow: f64,
    /// `--slow-ms`.
    pub slow_ms: u64,
    /// `--refuse`.
    pub refuse: f64,
    /// `--bmc redfish`: the BMCs served as a Redfish service.
    pub redfish: bool,
}

/// The standalone hypervisor simulator.
#[derive(Debug)]
pub struct Hypervisor {
    _process: Running,
    /// Its base URL.
    pub url: String,
}

impl Hypervisor {
    /// Starts `leasebroker hypervisor-sim` on a free port.
    pub async fn start(binary: &Path, dir: &Path, faults: SimFaults) -> anyhow::Result<Self> {
        let mut command = Command::new(binary);
        command.args(["hypervisor-sim", "--listen", "127.0.0.1:0"]);
        command.args(["--fail-before", &faults.fail_before.to_string()]);
        command.args(["--fail-after", &faults.fail_after.to_string()]);
        command.args(["--latency-ms", &faults.latency_ms.to_string()]);
        // Only when asked for, so a simulator without these flags still runs the other modes.
        if faults.slow > 0.0 {
            command.args(["--slow", &faults.slow.to_string(), "--slow-ms", &faults.slow_ms.to_string()]);
        }
        if faults.refuse > 0.0 {
            command.args(["--refuse", &faults.refuse.to_string()]);
        }
        if faults.redfish {
            command.args(["--bmc", "redfish"]);
        }
        let (process, addr) = start(command, &dir.join("hypervisor-sim.log")).await.context("hypervisor-sim")?;
        Ok(Hypervisor { _process: process, url: format!("http://{addr}") })
    }
}

/// What every replica is started with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The leasebroker binary.
    pub binary: PathBuf,
    /// `sqlite://...` or `postgres://...`.
    pub database: String,
    /// The principals and their tokens.
    pub principals: Vec<Principal>,
    /// `--pool-nodes`.
    pub pool_nodes: u32,
    /// `--hypervisor-url`.
    pub hypervisor_url: String,
    /// `--hypervisor-timeout`.
    pub hypervisor_timeout: Duration,
    /// `--in-flight-ttl`.
    pub in_flight_ttl: Duration,
    /// More `serve` flags (`--hypervisor-settle`, `--abandon-after`, `--sweep-interval`).
    pub extra: Vec<String>,
    /// Where the logs go.
    pub dir: PathBuf,
}

/// What every gateway replica is started with (`faultline run --gateway`).
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The idempotency-gateway binary.
    pub binary: PathBuf,
    /// `--upstream`.
    pub upstream: String,
    /// `--record-store`.
    pub record_store: String,
    /// More flags (`--in-flight-ttl`, `--upstream-timeout`, `--config`, ...).
    pub extra: Vec<String>,
    /// Where the logs go.
    pub dir: PathBuf,
}

/// What a replica runs.
#[derive(Debug, Clone)]
pub enum Program {
    /// `leasebroker serve`.
    Serve(ServeConfig),
    /// `idempotency-gateway` in front of an upstream.
    Gateway(GatewayConfig),
}

impl From<ServeConfig> for Program {
    fn from(config: ServeConfig) -> Self {
        Program::Serve(config)
    }
}

impl From<GatewayConfig> for Program {
    fn from(config: GatewayConfig) -> Self {
        Program::Gateway(config)
    }
}

impl Program {
    /// The command that starts it on `addr`, and its log file.
    fn command(&self, index: usize, addr: SocketAddr) -> (Command, PathBuf) {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        match self {
            Program::Serve(c) => {
                let mut command = Command::new(&c.binary);
                command.args(["serve", "--listen", &addr.to_string(), "--database", &c.database]);
                for p in &c.principals {
                    command.args(["--token", &format!("{}={}", p.token, p.name)]);
                }
                command.args(["--admin-token", ADMIN_TOKEN, "--pool-nodes", &c.pool_nodes.to_string()]);
                command.args(["--hypervisor-url", &c.hypervisor_url]);
                command.args(["--hypervisor-timeout", &ms(c.hypervisor_timeout)]);
                command.args(["--in-flight-ttl", &ms(c.in_flight_ttl)]);
                command.args(&c.extra);
                (command, c.dir.join(format!("replica-{index}.log")))
            }
            Program::Gateway(c) => {
                let mut command = Command::new(&c.binary);
                command.args(["--upstream", &c.upstream, "--record-store", &c.record_store]);
                command.args(["--listen", &addr.to_string(), "--admin-listen", "127.0.0.1:0"]);
                command.args(["--admin-token", ADMIN_TOKEN]);
                command.args(&c.extra);
                (command, c.dir.join(format!("gateway-{index}.log")))
            }
        }
    }
}

/// How a replica's start went: the processes that exited (or never got ready) before one did,
/// and why the last of them did not start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Started {
    /// Processes started in vain first.
    pub failed_starts: u32,
    /// Why the last of them did not start.
    pub last_failure: Option<String>,
}

/// One `leasebroker serve` (or `idempotency-gateway`) process, on the same port across restarts.
#[derive(Debug)]
pub struct Replica {
    /// Its index (0-based).
    pub index: usize,
    /// Its address: port 0 until its first start, the port the kernel gave it after.
    pub addr: SocketAddr,
    config: Program,
    process: Option<Running>,
    /// Times it was killed and restarted.
    pub restarts: u32,
    /// Times it was paused (SIGSTOP, then SIGCONT).
    pub pauses: u32,
}

impl Replica {
    /// Starts replica `index` on a loopback port the kernel picks; its restarts keep that port.
    pub async fn start(index: usize, config: impl Into<Program>) -> anyhow::Result<Self> {
        let mut replica = Replica {
            index,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            config: config.into(),
            process: None,
            restarts: 0,
            pauses: 0,
        };
        replica.spawn().await?;
        Ok(replica)
    }

    /// Its base URL (direct, not through the proxy).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts the process and waits until it listens. A process that exits first (a port not free
    /// yet after a SIGKILL, a database that does not answer: `serve` does not start without its
    /// database) is started again, up to 20 times, a quarter of a second apart.
    async fn spawn(&mut self) -> anyhow::Result<Started> {
        let mut last = None;
        for failed_starts in 0..20 {
            let (command, log) = self.config.command(self.index, self.addr);
            match start(command, &log).await {
                Ok((process, addr)) if self.addr.port() == 0 || addr == self.addr => {
                    self.addr = addr;
                    self.process = Some(process);
                    let last_failure = last.map(|e: anyhow::Error| format!("{e:#}"));
                    return Ok(Started { failed_starts, last_failure });
                }
                Ok((_, addr)) => bail!("replica {} listens on {addr}, not {}", self.index, self.addr),
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow!("no attempt made"))).with_context(|| format!("replica {}", self.index))
    }

    /// SIGKILLs the process: no drain, no cleanup, whatever it was doing is cut off.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut p) = self.process.take() {
            p.child.start_kill().context("SIGKILL")?;
            p.child.wait().await.context("waiting for the killed replica")?;
        }
        self.restarts += 1;
        Ok(())
    }

    /// Starts the killed process again on the same port.
    pub async fn start_again(&mut self) -> anyhow::Result<Started> {
        self.spawn().await
    }

    /// Pauses the process with SIGSTOP for `pause`, then resumes it with SIGCONT: it keeps its
    /// sockets and its in-memory state but runs nothing, as a frozen VM or a long GC pause would,
    /// so the claims it holds go stale and its attempts wake after others went on. `stopped` is
    /// called once it is stopped. Returns whether there was a process to pause.
    pub async fn pause_for(&mut self, pause: Duration, stopped: impl FnOnce()) -> anyhow::Result<bool> {
        let Some(pid) = self.pid() else { return Ok(false) };
        signal(pid, Signal::STOP)?;
        stopped();
        self.pauses += 1;
        tokio::time::sleep(pause).await;
        signal(pid, Signal::CONT)?;
        Ok(true)
    }

    /// Sends SIGCONT (whether it was paused or not), so that no replica stays stopped when a
    /// pause is cut short.
    pub async fn resume(&self) {
        if let Some(pid) = self.pid() {
            let _ = signal(pid, Signal::CONT);
        }
    }

    /// The process id of the running child (none once it was reaped).
    fn pid(&self) -> Option<u32> {
        self.process.as_ref()?.child.id()
    }

    /// Stops the process (SIGKILL: the run is over, its state is in the database).
    pub async fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            let _ = p.child.start_kill();
            let _ = p.child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI once failed a run with only "replica 0: exited before it was ready (see
    /// /tmp/faultline-.../replica-0.log)", a log removed with the run.
    #[tokio::test]
    async fn a_process_that_exits_before_it_is_ready_is_reported_with_its_last_log_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("child.log");
        let mut command = Command::new("sh");
        command.args(["-c", "echo starting >&2; echo >&2; echo 'error: 127.0.0.1:1 is taken' >&2; exit 3"]);
        let err = start(command, &log).await.expect_err("the process exits without a listening line");
        let message = format!("{err:#}");
        assert!(message.contains("exited before it was ready"), "{message}");
        assert!(message.ends_with("starting | error: 127.0.0.1:1 is taken"), "{message}");
    }

    #[test]
    fn an_empty_log_is_said_to_be_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(last_lines(&dir.path().join("none.log"), LOG_LINES), "its log is empty");
    }
}
