//! Command-line and environment configuration (SPEC 3.1). Every flag also reads from
//! `LEASEBROKER_<FLAG>`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// leasebroker: hands out worker nodes from a pool, safe to retry with Idempotency-Key.
#[derive(Debug, Parser)]
#[command(name = "leasebroker", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service.
    Serve(ServeArgs),
    /// Run the hypervisor simulator on its own (for several `serve` replicas to share).
    HypervisorSim(SimArgs),
    /// Create or upgrade the database schema, then exit.
    Migrate(MigrateArgs),
}

/// `leasebroker serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "LEASEBROKER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Database URL: `sqlite://PATH` (the embedded default) or `postgres://...`.
    #[arg(long, env = "LEASEBROKER_DATABASE", default_value = "sqlite://leasebroker.db")]
    pub database: String,

    /// An API token and the principal it authenticates, `TOKEN=PRINCIPAL`; repeatable. From the
    /// environment: `LEASEBROKER_TOKENS=TOKEN=PRINCIPAL,TOKEN=PRINCIPAL`. With none, a random
    /// token is generated and printed.
    #[arg(long = "token", env = "LEASEBROKER_TOKENS", value_delimiter = ',', value_parser = parse_token)]
    pub tokens: Vec<(String, String)>,

    /// The token for /admin routes. With none, the admin routes answer 401 to everyone.
    #[arg(long, env = "LEASEBROKER_ADMIN_TOKEN")]
    pub admin_token: Option<String>,

    /// Nodes in the pool.
    #[arg(long, env = "LEASEBROKER_POOL_NODES", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub pool_nodes: u32,

    /// CPUs per node: the largest `cpu` a worker may ask for.
    #[arg(long, env = "LEASEBROKER_NODE_CPU", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub node_cpu: u32,

    /// Memory per node in GB: the largest `memory_gb` a worker may ask for.
    #[arg(long, env = "LEASEBROKER_NODE_MEMORY_GB", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub node_memory_gb: u32,

    /// The hypervisor's base URL. Default: the simulator, run inside this process.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_URL")]
    pub hypervisor_url: Option<String>,

    /// Timeout of each hypervisor call; also the reconcile grace window.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub hypervisor_timeout: Duration,

    /// A PEM file of CA certificates to trust for an https hypervisor, besides the system's roots.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_CA_CERT", value_name = "PATH")]
    pub hypervisor_ca_cert: Option<std::path::PathBuf>,

    /// In-process simulator: probability that a mutating call fails before doing anything.
    #[arg(long, env = "LEASEBROKER_SIM_FAIL_BEFORE", default_value_t = 0.0, value_parser = parse_probability)]
    pub sim_fail_before: f64,

    /// In-process simulator: probability that a call does the work, then drops the connection.
    #[arg(long, env = "LEASEBROKER_SIM_FAIL_AFTER", default_value_t = 0.0, value_parser = parse_probability)]
    pub sim_fail_after: f64,

    /// In-process simulator: latency added before each mutating call, in milliseconds.
    #[arg(long, env = "LEASEBROKER_SIM_LATENCY_MS", default_value_t = 0)]
    pub sim_latency_ms: u64,

    /// How long completed idempotency records are kept (and replayed).
    #[arg(long, env = "LEASEBROKER_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub retention: Duration,

    /// How long an in-flight request owns its key before a retry may reclaim it.
    #[arg(long, env = "LEASEBROKER_IN_FLIGHT_TTL", default_value = "5m", value_parser = parse_duration)]
    pub in_flight_ttl: Duration,

    /// How often expired idempotency records are swept.
    #[arg(long, env = "LEASEBROKER_SWEEP_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub sweep_interval: Duration,

    /// Status for a key reused with a different request: 409 (default), 422 (IETF draft) or 400.
    #[arg(long, env = "LEASEBROKER_MISMATCH_STATUS", default_value_t = 409, value_parser = parse_mismatch_status)]
    pub mismatch_status: u16,
}

/// `leasebroker hypervisor-sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, env = "LEASEBROKER_LISTEN", default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Probability that a mutating call fails before doing anything (503).
    #[arg(long, env = "LEASEBROKER_FAIL_BEFORE", default_value_t = 0.0, value_parser = parse_probability)]
    pub fail_before: f64,
    /// Probability that a mutating call does the work, then drops the connection.
    #[arg(long, env = "LEASEBROKER_FAIL_AFTER", default_value_t = 0.0, value_parser = parse_probability)]
    pub fail_after: f64,
    /// Latency added before each mutating call, in milliseconds.
    #[arg(long, env = "LEASEBROKER_LATENCY_MS", default_value_t = 0)]
    pub latency_ms: u64,
}

/// `leasebroker migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// Database URL: `sqlite://PATH` or `postgres://...`.
    #[arg(long, env = "LEASEBROKER_DATABASE")]
    pub database: String,
}

fn parse_token(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((token, principal)) if !token.is_empty() && !principal.is_empty() => {
            Ok((token.to_owned(), principal.to_owned()))
        }
        // The value is not echoed: it may be a secret typed without its principal.
        _ => Err("expected TOKEN=PRINCIPAL, both non-empty (the value is not shown)".to_owned()),
    }
}

/// Durations as `500ms`, `10s`, `5m`, `7d` (humantime), or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 10s, 5m, 7d)"))
}

fn parse_probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("expected a probability from 0 to 1, got {s:?}")),
    }
}

fn parse_mismatch_status(s: &str) -> Result<u16, String> {
    match s {
        "409" => Ok(409),
        "422" => Ok(422),
        "400" => Ok(400),
        _ => Err(format!("expected 409, 422 or 400, got {s:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn tokens_and_flags() {
        let cli = Cli::try_parse_from([
            "leasebroker",
            "serve",
            "--token",
            "t1=alice",
            "--token",
            "t2=bob",
            "--mismatch-status",
            "422",
        ])
        .unwrap();
        let Command::Serve(s) = cli.command else { panic!("serve") };
        assert_eq!(s.tokens, vec![("t1".into(), "alice".into()), ("t2".into(), "bob".into())]);
        assert_eq!(s.mismatch_status, 422);
        assert_eq!(s.retention, Duration::from_secs(7 * 86400));
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--token", "nope"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--mismatch-status", "418"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--sim-fail-after", "1.5"]).is_err());
    }
}
