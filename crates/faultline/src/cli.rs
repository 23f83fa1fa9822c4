//! The command line: `faultline run` (one client fault rate) and `faultline sweep` (several).

use leasebroker_api::parse;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// faultline: proves against real leasebroker processes that nothing is duplicated or lost.
#[derive(Debug, Parser)]
#[command(name = "faultline", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the workload at one client fault rate (protected clients, then naive ones).
    Run(RunArgs),
    /// Run the protected/naive pair at each of several client fault rates and chart them.
    Sweep(SweepArgs),
}

/// `faultline run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Probability that a client connection (or an lbctl process run) is hit by a client fault.
    #[arg(long, default_value_t = 0.3, value_parser = parse::probability)]
    pub client_faults: f64,
    /// Only the naive clients (a fresh key on every attempt).
    #[arg(long, conflicts_with = "no_naive")]
    pub naive: bool,
    /// Only the protected clients.
    #[arg(long)]
    pub no_naive: bool,
    /// Run the client faults through `idempotency-gateway` in front of a small Python service
    /// that counts its own side effects (protected clients: one key per operation), then the
    /// same clients straight to that service (naive: what it sees without the gateway).
    /// `--ops`, `--concurrency`, `--principals`, `--attempt-timeout`, `--op-max-elapsed`,
    /// `--in-flight-ttl`, `--server-kills` and `--server-down` (gateway replicas), `--postgres`
    /// with `--replicas` (else one gateway on SQLite), `--out` and `--keep-temp` apply; the
    /// leasebroker modes do not. The report is OUT/gateway.json.
    #[arg(long, conflicts_with_all = [
        "hv_fail_before", "hv_fail_after", "hv_latency_ms", "hv_slow", "hv_refuse", "late_landings",
        "pauses", "plant_orphans", "drop_acknowledged", "abandon", "postgres_restarts", "redis_cluster",
        "postgres_ha", "libvirt", "flashes", "lbctl_share", "hypervisor_settle", "pool_nodes",
    ])]
    pub gateway: bool,
    /// The gateway run's options.
    #[command(flatten)]
    pub gateway_options: GatewayOptions,
    /// What the run does besides its client fault rate.
    #[command(flatten)]
    pub scenario: Scenario,
}

impl RunArgs {
    /// The clients the run drives, in order: `--naive` only the naive ones, `--no-naive` only the
    /// protected ones, else both.
    pub fn clients(&self) -> Vec<crate::workload::ClientKind> {
        use crate::workload::ClientKind;
        if self.naive {
            vec![ClientKind::Naive]
        } else if self.no_naive {
            vec![ClientKind::Protected]
        } else {
            vec![ClientKind::Protected, ClientKind::Naive]
        }
    }
}

/// What `faultline run --gateway` does to the gateway and its upstream.
#[derive(Debug, Clone, Args)]
pub struct GatewayOptions {
    /// With --gateway: the idempotency-gateway binary [default: next to this executable].
    #[arg(long, requires = "gateway")]
    pub gateway_binary: Option<PathBuf>,
    /// With --gateway: the Python interpreter that runs the upstream service.
    #[arg(long, default_value = "python3", requires = "gateway")]
    pub python: PathBuf,
    /// With --gateway: probability that an operation's first attempt is answered by the upstream
    /// after it did the work and after the gateway's `--upstream-timeout` (its outcome unknown to
    /// the gateway).
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability, requires = "gateway")]
    pub upstream_slow: f64,
    /// With --gateway: probability that the upstream resets the connection of an operation's
    /// first attempt after doing the work.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability, requires = "gateway")]
    pub upstream_resets: f64,
    /// With --gateway: probability that the upstream answers an operation's first attempt `503`
    /// without doing anything.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability, requires = "gateway")]
    pub upstream_5xx: f64,
    /// With --gateway: the gateway's `--upstream-timeout`.
    #[arg(long, default_value = "500ms", value_parser = parse::duration, requires = "gateway")]
    pub upstream_timeout: Duration,
    /// With --gateway: the gateway's `--on-uncertain`; under `resend` the upstream deduplicates
    /// by the key the gateway forwards (as `resend` asks of an upstream).
    #[arg(long, value_enum, default_value = "hold", requires = "gateway")]
    pub on_uncertain: OnUncertainMode,
    /// With --gateway: no probe route, so an uncertain outcome is held for an operator
    /// (`409 outcome-uncertain`) instead of looked up (`GET /orders/by-key/{key}`).
    #[arg(long, requires = "gateway")]
    pub no_probe: bool,
}

/// The gateway's `--on-uncertain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnUncertainMode {
    /// Held for an operator (or looked up by the route's probe).
    Hold,
    /// Forwarded again with the same derived key.
    Resend,
}

impl OnUncertainMode {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            OnUncertainMode::Hold => "hold",
            OnUncertainMode::Resend => "resend",
        }
    }
}

/// `faultline sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// The client fault rates, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,0.1,0.2,0.3", value_parser = parse::probability)]
    pub rates: Vec<f64>,
    /// What the run does besides its client fault rate.
    #[command(flatten)]
    pub scenario: Scenario,
}

/// Everything a run needs besides its client fault rate.
#[derive(Debug, Clone, Args)]
pub struct Scenario {
    /// The leasebroker binary [default: next to this executable].
    #[arg(long)]
    pub leasebroker: Option<PathBuf>,
    /// The lbctl binary [default: next to the leasebroker binary].
    #[arg(long)]
    pub lbctl: Option<PathBuf>,
    /// Logical operations per run.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub ops: u64,
    /// Operations in flight at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// Kill a random replica with SIGKILL this many times per run (spread over the run), restarting
    /// it on the same port.
    #[arg(long, default_value_t = 0)]
    pub server_kills: u32,
    /// How long a killed replica stays down before it is started again (as a supervisor's restart
    /// delay, or a machine that takes a while to come back, would keep it). Its proxy resets
    /// every connection meanwhile.
    #[arg(long, default_value = "0s", value_parser = parse::duration)]
    pub server_down: Duration,
    /// Hypervisor simulator: probability that a mutating call fails before doing anything.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub hv_fail_before: f64,
    /// Hypervisor simulator: probability that a mutating call does the work, then drops the answer.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub hv_fail_after: f64,
    /// Hypervisor simulator: latency before each mutating call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub hv_latency_ms: u64,
    /// Hypervisor simulator: probability that a mutating call is slow (`--hv-slow-ms` more), so
    /// it lands after the server's `--hypervisor-timeout` gave up on it (late landings).
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub hv_slow: f64,
    /// Hypervisor simulator: the extra latency of a slow call, in milliseconds (make it longer
    /// than `--hypervisor-timeout` for the calls to land late).
    #[arg(long, default_value_t = 2500)]
    pub hv_slow_ms: u64,
    /// Late landings past the settle window: a share `P` of VM boots (the first call of each boot
    /// tag) is held by a proxy of faultline's between the servers and the simulator and delivered
    /// `--late-by` after the servers' `--hypervisor-settle` has passed, whatever the server did
    /// meanwhile (it timed out, answered 503, a retry booted again, the reaper rolled the create
    /// back). What lands then is the service's inventory sweep's to remove.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub late_landings: f64,
    /// How long after the settle window a late landing lands.
    #[arg(long, default_value = "3s", value_parser = parse::duration)]
    pub late_by: Duration,
    /// Pause a random replica with SIGSTOP this many times per run (spread over the run, each
    /// while it has a request open), for `--pause-for`, then SIGCONT it: its attempts outlive
    /// their claims and wake after retries on other replicas went on.
    #[arg(long, default_value_t = 0)]
    pub pauses: u32,
    /// How long each pause lasts [default: --in-flight-ttl plus 2s, past the claims it holds].
    #[arg(long, value_parser = parse::duration)]
    pub pause_for: Option<Duration>,
    /// A check of the checker: after the workload, boot this many VMs on the simulator directly
    /// and start one flash on a BMC, all tagged `faultline-planted-...` (not the service's tag
    /// prefix), so nothing owns them and nothing removes them: the run must report them as
    /// running without an owner.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub plant_orphans: u32,
    /// A check of the checker: after the workload, delete this many records that a success was
    /// answered for straight from the database (SQLite or PostgreSQL; not with --redis-cluster),
    /// behind the service's back: the run must report them as acknowledged records lost.
    #[arg(long, default_value_t = 0, conflicts_with = "redis_cluster",
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub drop_acknowledged: u32,
    /// Hypervisor simulator: probability that a mutating call is refused for good (a 4xx, nothing
    /// done: a definite refusal).
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub hv_refuse: f64,
    /// Probability that an operation's client abandons it for good: one attempt, cut short at a
    /// random point, and no retry after an error or a hang-up. The run then waits out
    /// `--abandon-after` and checks that nothing is held.
    #[arg(long, default_value_t = 0.0, value_parser = parse::probability)]
    pub abandon: f64,
    /// The kinds of operation `--abandon` applies to, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "create,reboot,delete,flash")]
    pub abandon_ops: Vec<crate::workload::OpKind>,
    /// Passed to the servers as --abandon-after (when they have it) if `--abandon` is set.
    #[arg(long, default_value = "3s", value_parser = parse::duration)]
    pub abandon_after: Duration,
    /// Passed to the servers as --sweep-interval if `--abandon`, `--late-landings` or
    /// `--plant-orphans` is set: how often the reaper and the inventory sweep look.
    #[arg(long, default_value = "500ms", value_parser = parse::duration)]
    pub sweep_interval: Duration,
    /// Passed to the servers as --hypervisor-settle (when they have it) [default: the simulator's
    /// latency plus its slow latency plus 2s, and at least --hypervisor-timeout plus 2s].
    #[arg(long, value_parser = parse::duration)]
    pub hypervisor_settle: Option<Duration>,
    /// Stop and start the database this many times during the run (spread over it). Uses a
    /// PostgreSQL cluster of faultline's own (initdb and pg_ctl, run as user `postgres` when
    /// faultline runs as root, on a free port, removed after), never the `--postgres` server.
    #[arg(long, default_value_t = 0)]
    pub postgres_restarts: u32,
    /// Keep the idempotency records on a Redis Cluster of three primaries that faultline starts
    /// for each run (`redis-server` and `redis-cli` from the PATH, on free ports, removed after),
    /// passed to the servers as `--record-store redis+cluster://...`; the domain tables stay in
    /// the database.
    #[arg(long)]
    pub redis_cluster: bool,
    /// Run the database as a highly available PostgreSQL of faultline's own: three members under
    /// Patroni (leader lock in etcd), HAProxy in front sending connections to the primary (Debian
    /// packages patroni, etcd-server, haproxy; on free loopback ports, removed after). Never the
    /// --postgres server.
    #[arg(long, conflicts_with = "postgres_restarts")]
    pub postgres_ha: bool,
    /// With --postgres-ha: `sync` (Patroni's synchronous mode: a commit waits for a standby,
    /// nothing acknowledged is lost in a failover) or `async` (a failover may lose the last
    /// commits).
    #[arg(long, value_enum, default_value = "sync")]
    pub postgres_replication: PgReplication,
    /// With --postgres-ha: fail the primary over this many times during the run (spread over it):
    /// odd ones kill it (Patroni and PostgreSQL, SIGKILL; it rejoins as a replica once another
    /// is promoted), even ones are switchovers.
    #[arg(long, default_value_t = 0, requires = "postgres_ha")]
    pub postgres_failovers: u32,
    /// With --redis-cluster: kill a Redis primary this many times during the run (spread over
    /// it); its replica is promoted and the killed node restarted as a replica, as an operator
    /// would. The cluster then has a replica per primary.
    #[arg(long, default_value_t = 0, requires = "redis_cluster")]
    pub redis_failovers: u32,
    /// With --redis-cluster: passed to the servers as --record-store-replicas (each transition
    /// waits for this many replicas; the cluster has one per primary when this is set).
    #[arg(long, default_value_t = 0, requires = "redis_cluster", value_parser = clap::value_parser!(u32).range(0..=1))]
    pub record_store_replicas: u32,
    /// How long the database stays down at each restart.
    #[arg(long, default_value = "2s", value_parser = parse::duration)]
    pub postgres_down: Duration,
    /// Put the VMs on a real libvirt/QEMU host instead of the simulator: the servers run with
    /// `--hypervisor-url libvirt+URI` (a leasebroker built with its `libvirt` feature) and the
    /// ground truth is read from libvirt (`virsh`: the domains, their metadata, their lifecycle and
    /// reboot events). Each run boots from qcow2 overlays under a directory of its own in
    /// `--libvirt-dir`, which is how its domains are told from anyone else's; they are all
    /// destroyed and undefined at the end (and any an earlier run left, at the start). The
    /// simulator's faults (`--hv-*`), `--late-landings` and `--plant-orphans` do not apply.
    #[arg(long, value_name = "URI", num_args = 0..=1, default_missing_value = "qemu:///system")]
    pub libvirt: Option<String>,
    /// With --libvirt: where each run's base image and overlays go (a directory of its own per
    /// run, readable by libvirt's QEMU).
    #[arg(long, default_value = "/var/tmp/faultline-libvirt")]
    pub libvirt_dir: PathBuf,
    /// How the firmware flashes reach the BMCs: `native` (the simulator's `/v1/bmc`, docs/protocol.md#firmware-operations) or
    /// `redfish` (the simulator runs `--bmc redfish` and the servers get `--bmc-url
    /// redfish+http://...`: `UpdateService.SimpleUpdate` and task monitors).
    #[arg(long, value_enum, default_value = "native")]
    pub bmc: BmcMode,
    /// A PostgreSQL server URL: a fresh database is created in it for each run and dropped after.
    /// Without it, one replica runs on SQLite in a temporary directory.
    #[arg(long, env = "FAULTLINE_POSTGRES", hide_env_values = true)]
    pub postgres: Option<String>,
    /// Replicas sharing the PostgreSQL database (SQLite always runs one).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub replicas: u32,
    /// Share of operations run through real `lbctl` processes (the rest through the SDK in process).
    #[arg(long, default_value_t = 0.1, value_parser = parse::probability)]
    pub lbctl_share: f64,
    /// Share of operations that flash a node's firmware (`POST /admin/v1/nodes/{node_id}/firmware`,
    /// on the first 16 nodes of the pool, so that flashes meet running ones), through the SDK and
    /// lbctl like the rest; each flash writes for the simulator's 3 s.
    #[arg(long, default_value_t = 0.05, value_parser = parse::probability)]
    pub flashes: f64,
    /// Principals (tokens) the operations are spread over.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub principals: u32,
    /// The SDK clients' timeout per attempt; the "gives up mid-flight" fault holds a response past it.
    #[arg(long, default_value = "1s", value_parser = parse::duration)]
    pub attempt_timeout: Duration,
    /// Retry budget of one logical operation, through the SDK and through lbctl: a real caller's,
    /// the default of lbctl's `--max-elapsed` and of the SDK's `RetryPolicy`. An operation that
    /// spends it is sent again with its key once the faults are over.
    #[arg(long, default_value = "10m", value_parser = parse::duration)]
    pub op_max_elapsed: Duration,
    /// Passed to the servers as --in-flight-ttl.
    #[arg(long, default_value = "2s", value_parser = parse::duration)]
    pub in_flight_ttl: Duration,
    /// Passed to the servers as --hypervisor-timeout (each call's timeout).
    #[arg(long, default_value = "2s", value_parser = parse::duration)]
    pub hypervisor_timeout: Duration,
    /// Nodes in the pool [default: enough for every operation to be a create, twice over].
    #[arg(long)]
    pub pool_nodes: Option<u32>,
    /// Stop a run that takes longer than this (it then counts as failed).
    #[arg(long, default_value = "60m", value_parser = parse::duration)]
    pub max_duration: Duration,
    /// Where the JSON report and the chart go.
    #[arg(long, default_value = "faultline-out")]
    pub out: PathBuf,
    /// Keep the temporary directory (server logs, SQLite files, lbctl journal) after the run.
    #[arg(long)]
    pub keep_temp: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// `--bmc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BmcMode {
    /// The simulator's BMC API, `/v1/bmc`.
    Native,
    /// The simulator's Redfish service, through the servers' `--bmc-url redfish+http://...`.
    Redfish,
}

impl Scenario {
    /// Refuses the modes that do not apply together, in one line each: on `--libvirt` the
    /// simulator's VM faults, the late-landing proxy (both sit in front of the simulator's VM
    /// API) and `--plant-orphans` (which plants on the simulator).
    pub fn check_modes(&self) -> Result<(), String> {
        if self.libvirt.is_none() {
            return Ok(());
        }
        let simulator_only = [
            ("--hv-fail-before", self.hv_fail_before > 0.0),
            ("--hv-fail-after", self.hv_fail_after > 0.0),
            ("--hv-latency-ms", self.hv_latency_ms > 0),
            ("--hv-slow", self.hv_slow > 0.0),
            ("--hv-refuse", self.hv_refuse > 0.0),
            ("--late-landings", self.late_landings > 0.0),
            ("--plant-orphans", self.plant_orphans > 0),
        ];
        match simulator_only.iter().find(|(_, on)| *on) {
            Some((flag, _)) => Err(format!(
                "{flag} does not apply with --libvirt: it is a fault of the hypervisor simulator, which the VMs do not go through"
            )),
            None => Ok(()),
        }
    }
}

/// `--postgres-replication`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PgReplication {
    /// Synchronous (Patroni's `synchronous_mode`).
    Sync,
    /// Asynchronous streaming.
    Async,
}

impl PgReplication {
    /// As the HA cluster helper names it.
    pub fn of_cluster(self) -> idempotency_sqlx::testing::ha::Replication {
        match self {
            Self::Sync => idempotency_sqlx::testing::ha::Replication::Synchronous,
            Self::Async => idempotency_sqlx::testing::ha::Replication::Asynchronous,
        }
    }

    /// `sync` or `async`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_sweep() {
        let cli = Cli::try_parse_from(["faultline", "sweep", "--rates", "0,0.2", "--ops", "10"]).unwrap();
        let Command::Sweep(s) = cli.command else { panic!("sweep") };
        assert_eq!(s.rates, vec![0.0, 0.2]);
        assert_eq!(s.scenario.ops, 10);
        assert!(Cli::try_parse_from(["faultline", "sweep", "--rates", "0,1.5"]).is_err());
        assert!(Cli::try_parse_from(["faultline", "run", "--naive", "--no-naive"]).is_err());
    }

    #[test]
    fn parses_the_slow_refusing_abandoning_and_restarting_modes() {
        let cli = Cli::try_parse_from([
            "faultline",
            "run",
            "--hv-slow",
            "0.1",
            "--hv-slow-ms",
            "1500",
            "--hv-refuse",
            "0.05",
            "--abandon",
            "0.1",
            "--abandon-after",
            "2s",
            "--hypervisor-settle",
            "4s",
            "--postgres-restarts",
            "2",
            "--server-down",
            "8s",
        ])
        .unwrap();
        let Command::Run(r) = cli.command else { panic!("run") };
        let s = r.scenario;
        assert_eq!((s.hv_slow, s.hv_slow_ms, s.hv_refuse, s.abandon), (0.1, 1500, 0.05, 0.1));
        assert_eq!((s.abandon_after, s.hypervisor_settle), (Duration::from_secs(2), Some(Duration::from_secs(4))));
        assert_eq!((s.postgres_restarts, s.server_down), (2, Duration::from_secs(8)));
        // Off by default; a killed replica comes back at once; a real caller's retry budget.
        let Command::Run(r) = Cli::try_parse_from(["faultline", "run"]).unwrap().command else { panic!("run") };
        let s = r.scenario;
        assert_eq!((s.hv_slow, s.hv_refuse, s.abandon, s.postgres_restarts), (0.0, 0.0, 0.0, 0));
        assert_eq!((s.server_down, s.op_max_elapsed), (Duration::ZERO, Duration::from_secs(600)));
        assert!(Cli::try_parse_from(["faultline", "run", "--abandon", "1.1"]).is_err());
    }

    #[test]
    fn parses_the_late_landing_pause_and_planting_modes() {
        let run = |args: &[&str]| {
            let cli = Cli::try_parse_from(["faultline", "run"].iter().chain(args)).map_err(|e| e.to_string())?;
            let Command::Run(r) = cli.command else { panic!("run") };
            Ok::<_, String>(r.scenario)
        };
        let s = run(&["--late-landings", "0.2", "--late-by", "5s", "--pauses", "3", "--pause-for", "4s"]).unwrap();
        assert_eq!((s.late_landings, s.late_by, s.pauses), (0.2, Duration::from_secs(5), 3));
        assert_eq!(s.pause_for, Some(Duration::from_secs(4)));
        assert_eq!(run(&["--plant-orphans", "2"]).unwrap().plant_orphans, 2);
        assert_eq!(run(&["--drop-acknowledged", "3"]).unwrap().drop_acknowledged, 3);
        assert!(run(&["--drop-acknowledged", "3", "--redis-cluster"]).is_err());
        // Off by default; the pause defaults to the claim TTL plus 2 s (in the run).
        let s = run(&[]).unwrap();
        assert_eq!((s.late_landings, s.late_by, s.pauses, s.pause_for), (0.0, Duration::from_secs(3), 0, None));
        assert_eq!((s.plant_orphans, s.drop_acknowledged), (0, 0));
        assert!(run(&["--late-landings", "1.5"]).is_err());
        assert!(run(&["--pause-for", "soon"]).is_err());
        assert!(run(&["--plant-orphans", "101"]).is_err());
    }

    #[test]
    fn parses_the_libvirt_and_redfish_modes_and_refuses_the_simulators_faults_on_libvirt() {
        let run = |args: &[&str]| {
            let cli = Cli::try_parse_from(["faultline", "run"].iter().chain(args)).map_err(|e| e.to_string())?;
            let Command::Run(r) = cli.command else { panic!("run") };
            Ok::<_, String>(r.scenario)
        };
        let s = run(&["--libvirt"]).unwrap();
        assert_eq!((s.libvirt.as_deref(), s.bmc), (Some("qemu:///system"), BmcMode::Native));
        assert_eq!(s.libvirt_dir, PathBuf::from("/var/tmp/faultline-libvirt"));
        assert_eq!(run(&["--libvirt", "qemu:///session"]).unwrap().libvirt.as_deref(), Some("qemu:///session"));
        let s = run(&["--bmc", "redfish", "--hv-fail-before", "0.1"]).unwrap();
        assert_eq!((s.libvirt.as_deref(), s.bmc), (None, BmcMode::Redfish));
        assert_eq!(s.check_modes(), Ok(()), "the simulator's faults apply to its Redfish service");
        assert!(run(&["--bmc", "ipmi"]).is_err());
        assert_eq!(run(&["--libvirt", "--bmc", "redfish", "--server-kills", "3"]).unwrap().check_modes(), Ok(()));
        for flag in [
            ["--hv-fail-before", "0.1"],
            ["--hv-fail-after", "0.1"],
            ["--hv-latency-ms", "5"],
            ["--hv-slow", "0.1"],
            ["--hv-refuse", "0.1"],
            ["--late-landings", "0.1"],
            ["--plant-orphans", "1"],
        ] {
            let err = run(&["--libvirt", flag[0], flag[1]]).unwrap().check_modes().unwrap_err();
            assert!(err.starts_with(flag[0]) && err.contains("does not apply with --libvirt"), "{err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[test]
    fn parses_the_failover_modes() {
        let run = |args: &[&str]| {
            let cli = Cli::try_parse_from(["faultline", "run"].iter().chain(args)).map_err(|e| e.to_string())?;
            let Command::Run(r) = cli.command else { panic!("run") };
            Ok::<_, String>(r.scenario)
        };
        let s = run(&["--postgres-ha", "--postgres-failovers", "2", "--postgres-replication", "async"]).unwrap();
        assert_eq!((s.postgres_ha, s.postgres_failovers, s.postgres_replication), (true, 2, PgReplication::Async));
        let s = run(&["--redis-cluster", "--redis-failovers", "3", "--record-store-replicas", "1"]).unwrap();
        assert_eq!((s.redis_failovers, s.record_store_replicas), (3, 1));
        let s = run(&[]).unwrap();
        assert_eq!((s.postgres_ha, s.postgres_replication, s.redis_failovers), (false, PgReplication::Sync, 0));
        // Each needs the cluster it fails over.
        assert!(run(&["--postgres-failovers", "1"]).is_err());
        assert!(run(&["--redis-failovers", "1"]).is_err());
        assert!(run(&["--record-store-replicas", "1"]).is_err());
        assert!(run(&["--postgres-ha", "--postgres-restarts", "1"]).is_err());
    }
}
