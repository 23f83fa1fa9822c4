//! Command-line and environment configuration (docs/protocol.md#running-leasebroker). Every flag also reads from
//! `LEASEBROKER_<FLAG>`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idempotency_stores::clap::UrlParser;
use idempotency_stores::{DatabaseUrl, StoreUrl};
use idempotency_tower::MismatchStatus;
use leasebroker_api::parse;

use crate::hypervisor::url::{BmcUrl, HypervisorUrl, UnsupportedUrl};

/// leasebroker: hands out worker nodes from a pool, safe to retry with Idempotency-Key.
#[derive(Debug, Parser)]
#[command(name = "leasebroker", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
    /// How log lines are written to stderr: `text` for people, `json` (one object per line) for
    /// log shippers. The level comes from `RUST_LOG` (default `info`).
    #[arg(long, env = "LEASEBROKER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (colored on a terminal).
    Text,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service.
    Serve(Box<ServeArgs>),
    /// Run the hypervisor simulator on its own, for tests: several `serve` replicas can share it.
    /// It has no authentication; do not expose it.
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
    #[arg(long, env = "LEASEBROKER_DATABASE", hide_env_values = true, default_value = "sqlite://leasebroker.db",
          value_parser = UrlParser::<DatabaseUrl>::new())]
    pub database: DatabaseUrl,

    /// Connections to a SQLite database (ignored on PostgreSQL). 1, the default, puts every
    /// database call of the service in one queue: SQLite commits one writer at a time, and
    /// writers on several connections busy-wait for its lock (sleeping up to 100 ms a try)
    /// instead of taking turns.
    #[arg(long, env = "LEASEBROKER_SQLITE_CONNECTIONS", default_value_t = crate::db::DEFAULT_SQLITE_CONNECTIONS,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub sqlite_connections: u32,

    /// An API token and the principal it authenticates, `TOKEN=PRINCIPAL`; repeatable. From the
    /// environment: `LEASEBROKER_TOKENS=TOKEN=PRINCIPAL,TOKEN=PRINCIPAL`. With none, a random
    /// token is generated and printed.
    /// Each token is at least 16 characters and is split from its principal at the last `=`.
    #[arg(long = "token", env = "LEASEBROKER_TOKENS", hide_env_values = true, value_delimiter = ',', value_parser = TokenParser)]
    pub tokens: Vec<(String, String)>,

    /// The token for /admin routes (at least 16 characters, and not also a tenant's token). With
    /// none, the admin routes answer 401 to everyone.
    #[arg(long, env = "LEASEBROKER_ADMIN_TOKEN", hide_env_values = true, value_parser = AdminTokenParser)]
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
    /// `libvirt+qemu:///system` (any libvirt URI after `libvirt+`) puts the VMs on a real
    /// libvirt/QEMU host (a build with the `libvirt` feature); the BMCs are then the in-process
    /// simulator's.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_URL", hide_env_values = true, value_name = "URL",
          value_parser = UrlFlag(hypervisor_url))]
    pub hypervisor_url: Option<HypervisorUrl>,

    /// Timeout of each hypervisor call.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_TIMEOUT", default_value = "10s", value_parser = parse::duration)]
    pub hypervisor_timeout: Duration,

    /// How long a sent hypervisor call may still take effect after its caller gave up (longer
    /// than the timeout). Until it has passed since the last call was sent, a retry that finds nothing
    /// answers 503 + Retry-After instead of calling again.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_SETTLE", default_value = "30s", value_parser = parse::duration)]
    pub hypervisor_settle: Duration,

    /// Roll back a create nobody retried for this long (its record failed or its claim went
    /// stale): VM deleted, lease and node freed, record removed. Checked every --sweep-interval.
    /// Never sooner than the longest Retry-After a waiting retry is told (--hypervisor-settle plus
    /// 1 s, rounded up to whole seconds) plus 2 s after the last attempt, so that a client doing
    /// what it was told finds its create still there.
    #[arg(long, env = "LEASEBROKER_ABANDON_AFTER", default_value = "1h", value_parser = parse::duration)]
    pub abandon_after: Duration,

    /// A PEM file of CA certificates to trust for an https hypervisor, besides the system's roots.
    #[arg(long, env = "LEASEBROKER_HYPERVISOR_CA_CERT", value_name = "PATH")]
    pub hypervisor_ca_cert: Option<std::path::PathBuf>,

    /// With a libvirt hypervisor: the directory of base images (`<image>.qcow2`); a VM boots
    /// from a qcow2 overlay of its image made under `DIR/vms/`, or without a disk when the image
    /// has no file there.
    #[arg(long, env = "LEASEBROKER_LIBVIRT_IMAGES", value_name = "DIR")]
    pub libvirt_images: Option<std::path::PathBuf>,

    /// Where firmware flashes go: `redfish+http://HOST:PORT` or `redfish+https://HOST:PORT` (with
    /// `USER:PASSWORD@` for basic authentication) drives a Redfish BMC's
    /// `UpdateService.SimpleUpdate`. Default: the BMC API beside the hypervisor's (docs/protocol.md#firmware-operations).
    #[arg(long, env = "LEASEBROKER_BMC_URL", hide_env_values = true, value_name = "URL",
          value_parser = UrlFlag(bmc_url))]
    pub bmc_url: Option<BmcUrl>,

    /// A PEM file of CA certificates to trust for a `redfish+https` BMC, besides the system's roots.
    #[arg(long, env = "LEASEBROKER_BMC_CA_CERT", value_name = "PATH")]
    pub bmc_ca_cert: Option<std::path::PathBuf>,

    /// With a Redfish BMC: where the BMC fetches firmware images; a flash's `ImageURI` is
    /// `URL/VERSION?tag=TAG`.
    #[arg(
        long,
        env = "LEASEBROKER_FIRMWARE_IMAGES",
        value_name = "URL",
        default_value = "http://firmware.invalid/images"
    )]
    pub firmware_images: String,

    /// In-process simulator: probability that a mutating call fails before doing anything.
    #[arg(long, env = "LEASEBROKER_SIM_FAIL_BEFORE", default_value_t = 0.0, value_parser = parse::probability)]
    pub sim_fail_before: f64,

    /// In-process simulator: probability that a call does the work, then drops the connection.
    #[arg(long, env = "LEASEBROKER_SIM_FAIL_AFTER", default_value_t = 0.0, value_parser = parse::probability)]
    pub sim_fail_after: f64,

    /// In-process simulator: latency added before each mutating call, in milliseconds.
    #[arg(long, env = "LEASEBROKER_SIM_LATENCY_MS", default_value_t = 0)]
    pub sim_latency_ms: u64,

    /// In-process simulator: an image the hypervisor does not have (may repeat): a create of it
    /// is refused downstream (`502` `upstream-refused`, node and lease given back).
    #[arg(long, env = "LEASEBROKER_SIM_MISSING_IMAGE", value_name = "IMAGE", value_delimiter = ',')]
    pub sim_missing_image: Vec<String>,

    /// In-process simulator: how long a BMC firmware flash writes, in milliseconds.
    #[arg(long, env = "LEASEBROKER_SIM_FLASH_MS", default_value_t = 3000)]
    pub sim_flash_ms: u64,

    /// In-process simulator: probability that a BMC flash fails its verification at the end.
    #[arg(long, env = "LEASEBROKER_SIM_FLASH_FAIL", default_value_t = 0.0, value_parser = parse::probability)]
    pub sim_flash_fail: f64,

    /// How often the watcher of running operations (firmware flashes) polls the BMC of each.
    #[arg(long, env = "LEASEBROKER_OPERATION_POLL", default_value = "1s", value_parser = parse::positive_duration)]
    pub operation_poll: Duration,

    /// Where the idempotency records live: the --database (the default), one Redis server
    /// (`redis://[USER:PASSWORD@]HOST:PORT[/DB]`) or a Redis Cluster
    /// (`redis+cluster://HOST:PORT[,HOST:PORT]...`). The domain tables stay in --database. Redis
    /// must run with `maxmemory-policy noeviction` (anything else is refused at start); see the
    /// idempotency-redis crate for the persistence settings each guarantee needs.
    #[arg(long, env = "LEASEBROKER_RECORD_STORE", hide_env_values = true, value_name = "URL",
          value_parser = UrlFlag(record_store_url))]
    pub record_store: Option<StoreUrl>,

    /// The most bytes of completed responses kept in memory to answer replays without a round
    /// trip to the record store (`64MiB`, `512KiB`, a number of bytes), on a store that announces
    /// its changes (PostgreSQL, Redis): a forget on any replica drops every replica's copy. `0`
    /// turns it off; on SQLite there is none.
    #[arg(long, env = "LEASEBROKER_REPLAY_CACHE", default_value = "64MiB", value_name = "SIZE",
          value_parser = parse_size)]
    pub replay_cache: u64,

    /// Redis record store: after each transition, wait until this many replicas of the record's
    /// primary have it (`WAIT`); a transition fewer replicas acknowledge in time fails as 503
    /// `store-unavailable`. 0: no wait (a failover may lose the last acknowledged writes).
    #[arg(long, env = "LEASEBROKER_RECORD_STORE_REPLICAS", default_value_t = 0)]
    pub record_store_replicas: u32,

    /// Redis record store: how long a transition waits for --record-store-replicas replicas.
    #[arg(long, env = "LEASEBROKER_RECORD_STORE_REPLICA_TIMEOUT", default_value = "1s",
        value_parser = parse::positive_duration)]
    pub record_store_replica_timeout: Duration,

    /// A PEM file of CA certificates that alone are trusted for a `rediss://` --record-store
    /// (TLS), for a Redis whose certificate a private CA issued. Default: the system's roots.
    #[arg(long, env = "LEASEBROKER_REDIS_CA_CERT", value_name = "PATH")]
    pub redis_ca_cert: Option<std::path::PathBuf>,

    /// How long completed idempotency records are kept (and replayed).
    #[arg(long, env = "LEASEBROKER_RETENTION", default_value = "7d", value_parser = parse::duration)]
    pub retention: Duration,

    /// The largest response stored for replay, in bytes. A larger one still reaches its client
    /// whole, but a retry with its key gets `410 response-too-large` instead of the response.
    #[arg(long, env = "LEASEBROKER_MAX_STORED_RESPONSE", default_value_t = 1024 * 1024)]
    pub max_stored_response: usize,

    /// How long an in-flight request owns its key before a retry may reclaim it.
    #[arg(long, env = "LEASEBROKER_IN_FLIGHT_TTL", default_value = "5m", value_parser = parse::duration)]
    pub in_flight_ttl: Duration,

    /// The longest a request with `Prefer: wait=N` waits for the request in flight with its key
    /// (it waits min(N, this), then gets the replay with `Preference-Applied`, or the usual 409).
    /// 0: the preference is ignored.
    #[arg(long, env = "LEASEBROKER_MAX_WAIT", default_value = "30s", value_parser = parse::duration)]
    pub max_wait: Duration,

    /// How often expired idempotency records are swept (and abandoned operations reaped).
    #[arg(long, env = "LEASEBROKER_SWEEP_INTERVAL", default_value = "60s", value_parser = parse::duration)]
    pub sweep_interval: Duration,

    /// Status for a key reused with a different request: 409 (default), 422 (IETF draft) or 400.
    #[arg(long, env = "LEASEBROKER_MISMATCH_STATUS", value_enum, default_value_t = MismatchStatus::Conflict)]
    pub mismatch_status: MismatchStatus,

    /// Where a request's key may come from besides `Idempotency-Key` (comma-separated; none by
    /// default): `repeatability` (`Repeatability-Request-ID` with `Repeatability-First-Sent`, on
    /// every protected route), `request-id` (the JSON body field `request_id`, AIP-155, on the
    /// routes with a body: `POST /v1/workers` and the firmware flash).
    #[arg(long, env = "LEASEBROKER_KEY_SOURCES", value_enum, value_delimiter = ',')]
    pub key_sources: Vec<KeySource>,

    // Tenants: quotas, rate limits, connection timeouts and the shutdown drain (docs/protocol.md#running-leasebroker, #leasebroker-api).
    /// The most workers one principal may hold; a create beyond it answers 403 `quota-exceeded`.
    /// 0: no limit.
    #[arg(long, env = "LEASEBROKER_MAX_WORKERS_PER_PRINCIPAL", default_value_t = 0)]
    pub max_workers_per_principal: u32,

    /// Mutating /v1 requests per second allowed to each principal (429 `too-many-requests` +
    /// Retry-After beyond, nothing stored). 0: no limit.
    #[arg(long, env = "LEASEBROKER_RATE_LIMIT", default_value_t = 50)]
    pub rate_limit: u32,

    /// How many mutating requests a principal may send at once. Default: twice `--rate-limit`.
    #[arg(long, env = "LEASEBROKER_RATE_LIMIT_BURST")]
    pub rate_limit_burst: Option<u32>,

    /// The most live idempotency records one principal may hold; a request with a new key
    /// beyond it answers 429 `too-many-requests` + Retry-After and stores nothing. 0: no limit.
    #[arg(long, env = "LEASEBROKER_MAX_RECORDS_PER_PRINCIPAL", default_value_t = 100_000)]
    pub max_records_per_principal: u64,

    /// The most connections served at once; one accepted beyond it is closed at once.
    #[arg(long, env = "LEASEBROKER_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// The most connections served at once from one source address (an IPv4 address, or an
    /// IPv6 /64); one accepted beyond it is closed at once, so one source's idle connections
    /// never take every slot. Behind a proxy that sends every client from its own address, raise
    /// it to --max-connections. 0: no per-source cap.
    #[arg(long, env = "LEASEBROKER_MAX_CONNECTIONS_PER_SOURCE", default_value_t = 256)]
    pub max_connections_per_source: u32,

    /// The most requests one principal may have in progress at once, those waiting under
    /// `Prefer: wait` and those whose body is still arriving included (429 `too-many-requests`
    /// + Retry-After beyond, nothing stored). 0: no limit.
    #[arg(long, env = "LEASEBROKER_MAX_CONCURRENT_PER_PRINCIPAL", default_value_t = 64)]
    pub max_concurrent_per_principal: u32,

    /// A request body must arrive whole within this, however slowly it drips (408
    /// `body-timeout` beyond, nothing stored).
    #[arg(long, env = "LEASEBROKER_BODY_TIMEOUT", default_value = "30s", value_parser = parse::positive_duration)]
    pub body_timeout: Duration,

    /// A connection whose request headers have not all arrived within this is closed.
    #[arg(long, env = "LEASEBROKER_HEADER_TIMEOUT", default_value = "10s", value_parser = parse::positive_duration)]
    pub header_timeout: Duration,

    /// A connection with no traffic for this long is shut down; a request body that stalls this
    /// long is cut.
    #[arg(long, env = "LEASEBROKER_IDLE_TIMEOUT", default_value = "60s", value_parser = parse::positive_duration)]
    pub idle_timeout: Duration,

    /// On SIGTERM, how long to wait for requests in flight, including handlers whose client
    /// already hung up, before exiting anyway.
    #[arg(long, env = "LEASEBROKER_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse::duration)]
    pub shutdown_timeout: Duration,

    /// Export traces over OTLP to this collector (`http://127.0.0.1:4317` for gRPC,
    /// `http://127.0.0.1:4318` for `--otlp-protocol http/protobuf`). Off the request path: a
    /// collector that is down or hung changes no answer.
    #[arg(long, env = "LEASEBROKER_OTLP_ENDPOINT", hide_env_values = true)]
    pub otlp_endpoint: Option<String>,

    /// The OTLP transport.
    #[arg(long, env = "LEASEBROKER_OTLP_PROTOCOL", value_enum, default_value = "grpc")]
    pub otlp_protocol: crate::telemetry::OtlpProtocol,
}

/// The shortest token accepted: shorter ones are guessable, or a typo.
pub const MIN_TOKEN_LEN: usize = 16;

/// A configuration `serve` refuses at start: settings that contradict each other (what no
/// single flag's parser can see). Its message is one line that names the flags; the binary exits
/// with status 2, as for clap's own usage errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    /// Checks what no single flag can: flags that depend on each other.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(admin) = &self.admin_token
            && self.tokens.iter().any(|(t, _)| t == admin)
        {
            return Err("the admin token must not also be a tenant's --token".to_owned());
        }
        if self.record_store_replicas > 0 && self.record_store.is_none() {
            return Err(
                "--record-store-replicas applies to a Redis --record-store only (the records are in --database)"
                    .to_owned(),
            );
        }
        if self.retention <= self.in_flight_ttl {
            return Err(format!(
                "--retention ({}) must be longer than --in-flight-ttl ({}): a record in flight is kept at least the TTL \
                 past its claim, and a dead attempt's record must outlive its claim for the retry after the TTL to \
                 resume it",
                humantime::format_duration(self.retention),
                humantime::format_duration(self.in_flight_ttl)
            ));
        }
        if self.hypervisor_settle <= self.hypervisor_timeout {
            return Err(format!(
                "--hypervisor-settle ({}) must be longer than --hypervisor-timeout ({}): a call may take effect \
                 until its timeout, so a settle window no longer than it would let a retry call twice",
                humantime::format_duration(self.hypervisor_settle),
                humantime::format_duration(self.hypervisor_timeout)
            ));
        }
        Ok(())
    }
}

/// `leasebroker hypervisor-sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Address to listen on. The simulator has no authentication: anyone who can reach this
    /// address can list every VM and switch faults on.
    #[arg(long, env = "LEASEBROKER_LISTEN", default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Probability that a mutating call fails before doing anything (503).
    #[arg(long, env = "LEASEBROKER_FAIL_BEFORE", default_value_t = 0.0, value_parser = parse::probability)]
    pub fail_before: f64,
    /// Probability that a mutating call does the work, then drops the connection.
    #[arg(long, env = "LEASEBROKER_FAIL_AFTER", default_value_t = 0.0, value_parser = parse::probability)]
    pub fail_after: f64,
    /// Latency added before each mutating call, in milliseconds.
    #[arg(long, env = "LEASEBROKER_LATENCY_MS", default_value_t = 0)]
    pub latency_ms: u64,
    /// Probability that a mutating call is slow: `--slow-ms` more latency, so a caller with a
    /// shorter timeout gives up and the call lands after it.
    #[arg(long, env = "LEASEBROKER_SLOW", default_value_t = 0.0, value_parser = parse::probability)]
    pub slow: f64,
    /// The extra latency of a slow call, in milliseconds.
    #[arg(long, env = "LEASEBROKER_SLOW_MS", default_value_t = 0)]
    pub slow_ms: u64,
    /// Probability that a mutating call is refused for good: `409`, nothing done.
    #[arg(long, env = "LEASEBROKER_REFUSE", default_value_t = 0.0, value_parser = parse::probability)]
    pub refuse: f64,
    /// An image the hypervisor does not have (may repeat): a boot of it is refused with `422`.
    #[arg(long, env = "LEASEBROKER_MISSING_IMAGE", value_name = "IMAGE", value_delimiter = ',')]
    pub missing_image: Vec<String>,
    /// How long a BMC firmware flash writes, in milliseconds (a second flash of a node while
    /// one writes bricks it).
    #[arg(long, env = "LEASEBROKER_FLASH_MS", default_value_t = 3000)]
    pub flash_ms: u64,
    /// Probability that a BMC flash fails its verification when the write ends: the node keeps
    /// the firmware it ran before.
    #[arg(long, env = "LEASEBROKER_FLASH_FAIL", default_value_t = 0.0, value_parser = parse::probability)]
    pub flash_fail: f64,
    /// How the BMCs are served: `native` (`/v1/bmc`, docs/protocol.md#firmware-operations) or `redfish` (a Redfish service
    /// under `/redfish/v1`: one `Systems` member per node, `UpdateService.SimpleUpdate`, tasks).
    #[arg(long, env = "LEASEBROKER_BMC", value_enum, default_value_t = BmcApi::Native)]
    pub bmc: BmcApi,
    /// Redfish: the systems listed, `node-0001` to `node-NNNN`.
    #[arg(long, env = "LEASEBROKER_REDFISH_SYSTEMS", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub redfish_systems: u32,
    /// Redfish: serve one machine (`Systems/1`), flashed without `Targets`, like most real BMCs.
    #[arg(long, env = "LEASEBROKER_REDFISH_ONE_MACHINE")]
    pub redfish_one_machine: bool,
    /// Redfish: keep no request payload in the tasks (as many BMCs do), so a lost answer can
    /// only be settled from the firmware inventory.
    #[arg(long, env = "LEASEBROKER_REDFISH_NO_PAYLOAD")]
    pub redfish_no_payload: bool,
    /// Redfish: answer a `SimpleUpdate` with `204` and the task's `Location`, no body.
    #[arg(long, env = "LEASEBROKER_REDFISH_TERSE")]
    pub redfish_terse: bool,
    /// Redfish: serve no task list (`TaskService/Tasks` answers 404; each task and monitor is
    /// still served), as sushy-tools.
    #[arg(long, env = "LEASEBROKER_REDFISH_NO_TASK_LIST")]
    pub redfish_no_task_list: bool,
    /// Redfish: serve no firmware inventory (`UpdateService/FirmwareInventory` answers 404), as
    /// sushy-tools.
    #[arg(long, env = "LEASEBROKER_REDFISH_NO_INVENTORY")]
    pub redfish_no_inventory: bool,
}

/// `serve --key-sources`: a source of the request's key besides `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeySource {
    /// `Repeatability-Request-ID` + `Repeatability-First-Sent` (OASIS Repeatable Requests).
    Repeatability,
    /// The JSON body field `request_id` (AIP-155).
    RequestId,
}

/// `hypervisor-sim --bmc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BmcApi {
    /// The BMC API of docs/protocol.md#firmware-operations, `/v1/bmc`.
    Native,
    /// A Redfish service under `/redfish/v1`.
    Redfish,
}

/// `leasebroker migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// Database URL: `sqlite://PATH` or `postgres://...`.
    #[arg(long, env = "LEASEBROKER_DATABASE", hide_env_values = true, value_parser = UrlParser::<DatabaseUrl>::new())]
    pub database: DatabaseUrl,
}

/// `TOKEN=PRINCIPAL`, split at the last `=` (a token may contain `=`, a principal may not).
fn parse_token(s: &str) -> Result<(String, String), String> {
    match s.rsplit_once('=') {
        Some((token, principal)) if !token.is_empty() && !principal.is_empty() => {
            check_token_len("--token", token)?;
            Ok((token.to_owned(), principal.to_owned()))
        }
        _ => Err("--token: expected TOKEN=PRINCIPAL, both non-empty (the value is not shown)".to_owned()),
    }
}

fn check_token_len(flag: &str, token: &str) -> Result<(), String> {
    if token.chars().count() < MIN_TOKEN_LEN {
        return Err(format!("{flag}: a token must be at least {MIN_TOKEN_LEN} characters (the value is not shown)"));
    }
    Ok(())
}

/// Parses `--token` without ever putting the value in the error: clap's own error for a failed
/// value parser quotes the value, which here may be a secret.
#[derive(Debug, Clone, Copy)]
struct TokenParser;

impl clap::builder::TypedValueParser for TokenParser {
    type Value = (String, String);

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        let value = value.to_str().ok_or_else(|| secret_error("--token: not valid UTF-8 (the value is not shown)"))?;
        parse_token(value).map_err(|m| secret_error(&m))
    }
}

/// Parses `--admin-token`, never echoing the value.
#[derive(Debug, Clone, Copy)]
struct AdminTokenParser;

impl clap::builder::TypedValueParser for AdminTokenParser {
    type Value = String;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        let value =
            value.to_str().ok_or_else(|| secret_error("--admin-token: not valid UTF-8 (the value is not shown)"))?;
        check_token_len("--admin-token", value).map_err(|m| secret_error(&m))?;
        Ok(value.to_owned())
    }
}

/// Parses a URL flag with the function it holds. Its error is one line, `--FLAG URL: REASON`, the
/// URL [redacted](idempotency_stores::redact): clap's own message for a failed parser quotes the
/// value, password and all.
#[derive(Clone, Copy)]
struct UrlFlag<T>(fn(&str) -> Result<T, String>);

impl<T: Clone + Send + Sync + 'static> clap::builder::TypedValueParser for UrlFlag<T> {
    type Value = T;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        let flag = arg.and_then(clap::Arg::get_long).map_or_else(|| "the URL".to_owned(), |l| format!("--{l}"));
        let value =
            value.to_str().ok_or_else(|| secret_error(&format!("{flag}: not valid UTF-8 (the value is not shown)")))?;
        (self.0)(value)
            .map_err(|reason| secret_error(&format!("{flag} {}: {reason}", idempotency_stores::redact(value))))
    }
}

/// `--record-store`: a Redis server or cluster (without the flag the records stay in
/// `--database`, so a SQL or memory URL here is refused).
fn record_store_url(url: &str) -> Result<StoreUrl, String> {
    match url.parse() {
        Ok(url @ (StoreUrl::Redis(_) | StoreUrl::RedisCluster(_))) => Ok(url),
        _ => Err("unsupported URL; use redis://HOST:PORT or redis+cluster://HOST:PORT[,HOST:PORT]... \
                  (without it the records stay in --database)"
            .to_owned()),
    }
}

/// `--hypervisor-url`.
fn hypervisor_url(url: &str) -> Result<HypervisorUrl, String> {
    url.parse().map_err(|e: UnsupportedUrl| e.to_string())
}

/// `--bmc-url`.
fn bmc_url(url: &str) -> Result<BmcUrl, String> {
    url.parse().map_err(|e: UnsupportedUrl| e.to_string())
}

/// A usage error whose text is `message` alone.
fn secret_error(message: &str) -> clap::Error {
    clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{message}\n"))
}

/// A size as `--replay-cache` takes it: `64MiB`, `512KiB`, `1 MB`, or a number of bytes.
fn parse_size(s: &str) -> Result<u64, String> {
    s.trim().parse::<bytesize::ByteSize>().map(|b| b.as_u64()).map_err(|_| "expected a size such as 64MiB".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_every_tool_reads_them() {
        let serve = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["leasebroker", "serve"].iter().chain(extra)).map_err(|e| e.to_string())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            Ok::<_, String>(s.retention)
        };
        assert_eq!(serve(&["--retention", "7d"]), Ok(Duration::from_secs(7 * 86400)));
        assert_eq!(serve(&["--retention", "30"]), Ok(Duration::from_secs(30)));
        assert!(serve(&["--retention", "soon"]).is_err_and(|e| e.contains("examples")));
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--header-timeout", "0s"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--sim-fail-before", "1.5"]).is_err());
    }

    #[test]
    fn record_store_replicas_need_a_redis_record_store() {
        let serve = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["leasebroker", "serve"].iter().chain(extra)).map_err(|e| e.to_string())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            s.validate()?;
            Ok::<_, String>((s.record_store_replicas, s.record_store_replica_timeout))
        };
        assert_eq!(serve(&[]), Ok((0, Duration::from_secs(1))), "the defaults");
        let redis = ["--record-store", "redis://127.0.0.1:6379", "--record-store-replicas", "1"];
        assert_eq!(serve(&redis), Ok((1, Duration::from_secs(1))));
        let with_timeout = [&redis[..], &["--record-store-replica-timeout", "250ms"]].concat();
        assert_eq!(serve(&with_timeout), Ok((1, Duration::from_millis(250))));
        let err = serve(&["--record-store-replicas", "1"]).expect_err("no record store");
        assert!(err.contains("--record-store-replicas"), "{err}");
        assert!(serve(&[&redis[..], &["--record-store-replica-timeout", "0s"]].concat()).is_err());
        assert!(serve(&["--record-store-replicas", "-1"]).is_err());
    }

    #[test]
    fn key_sources_are_a_comma_separated_list_and_none_by_default() {
        let serve = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["leasebroker", "serve"].iter().chain(extra)).map_err(|e| e.to_string())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            Ok::<_, String>(s.key_sources)
        };
        assert_eq!(serve(&[]), Ok(vec![]), "only Idempotency-Key by default");
        assert_eq!(
            serve(&["--key-sources", "repeatability,request-id"]),
            Ok(vec![KeySource::Repeatability, KeySource::RequestId])
        );
        let err = serve(&["--key-sources", "cookie"]).unwrap_err();
        assert!(err.contains("repeatability") && err.contains("request-id"), "names the choices: {err}");
    }

    #[test]
    fn mismatch_status_takes_the_three_numbers() {
        let serve = |extra: &[&str]| {
            let cli = Cli::try_parse_from(["leasebroker", "serve"].iter().chain(extra)).map_err(|e| e.to_string())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            Ok::<_, String>(s.mismatch_status)
        };
        assert_eq!(serve(&[]), Ok(MismatchStatus::Conflict), "the default");
        for (flag, expected) in [
            ("409", MismatchStatus::Conflict),
            ("422", MismatchStatus::UnprocessableContent),
            ("400", MismatchStatus::BadRequest),
        ] {
            assert_eq!(serve(&["--mismatch-status", flag]), Ok(expected), "{flag}");
            assert_eq!(expected.to_string(), flag);
        }
        for refused in ["418", "conflict", "Conflict"] {
            let err = serve(&["--mismatch-status", refused]).expect_err(refused);
            assert!(err.contains("409, 422, 400"), "{refused:?}: {err}");
        }
    }

    #[test]
    fn tokens_and_flags() {
        let cli = Cli::try_parse_from([
            "leasebroker",
            "serve",
            "--token",
            "token-one-0123456789=alice",
            "--token",
            "token=two-0123456789=bob",
            "--mismatch-status",
            "422",
        ])
        .unwrap();
        let Command::Serve(s) = cli.command else { panic!("serve") };
        assert_eq!(
            s.tokens,
            vec![("token-one-0123456789".into(), "alice".into()), ("token=two-0123456789".into(), "bob".into())],
            "split at the last '='"
        );
        assert_eq!(s.mismatch_status, MismatchStatus::UnprocessableContent);
        assert_eq!(s.retention, Duration::from_secs(7 * 86400));
        assert_eq!(s.max_stored_response, 1024 * 1024);
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--token", "nope"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--token", "short=alice"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--admin-token", "short"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--header-timeout", "0s"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--mismatch-status", "418"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "serve", "--sim-fail-after", "1.5"]).is_err());

        let cli = Cli::try_parse_from([
            "leasebroker",
            "hypervisor-sim",
            "--slow",
            "0.2",
            "--slow-ms",
            "1500",
            "--refuse",
            "0.1",
        ])
        .unwrap();
        let Command::HypervisorSim(s) = cli.command else { panic!("hypervisor-sim") };
        assert_eq!((s.slow, s.slow_ms, s.refuse), (0.2, 1500, 0.1));
        assert_eq!(s.bmc, BmcApi::Native);
        assert!(Cli::try_parse_from(["leasebroker", "hypervisor-sim", "--refuse", "2"]).is_err());
        assert!(Cli::try_parse_from(["leasebroker", "hypervisor-sim", "--bmc", "ipmi"]).is_err());
    }

    #[test]
    fn bmc_url_takes_redfish_urls_only() {
        let serve = |args: &[&str]| {
            let cli = Cli::try_parse_from([&["leasebroker", "serve"], args].concat()).map_err(|e| e.to_string())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            s.validate()?;
            Ok::<_, String>(s.bmc_url)
        };
        let url = "redfish+http://127.0.0.1:8000";
        assert_eq!(serve(&["--bmc-url", url]), Ok(Some(BmcUrl::Redfish(url.to_owned()))));
        assert!(serve(&["--bmc-url", "redfish+https://admin:secret@bmc.example"]).is_ok());
        let err = serve(&["--bmc-url", "https://admin:secret@bmc.example"]).unwrap_err();
        assert!(err.contains("redfish+http://") && !err.contains("secret"), "{err}");
        assert_eq!(
            err.trim(),
            "error: --bmc-url https://admin:***@bmc.example: unsupported URL; use redfish+http://HOST:PORT or \
             redfish+https://HOST:PORT (without it the BMCs are the hypervisor's)"
        );
    }

    /// The backend URLs are typed when the flag is read: a URL of the wrong kind is a usage error
    /// (exit 2), one line that names the flag and the forms it takes, never the password.
    #[test]
    fn backend_urls_are_parsed_once_when_read() {
        let serve = |args: &[&str]| {
            let cli = Cli::try_parse_from([&["leasebroker", "serve"], args].concat())?;
            let Command::Serve(s) = cli.command else { panic!("serve") };
            Ok::<_, clap::Error>(*s)
        };
        let s = serve(&[]).expect("the defaults");
        assert_eq!(s.database, DatabaseUrl::Sqlite("sqlite://leasebroker.db".to_owned()));
        assert_eq!((s.record_store, s.hypervisor_url, s.bmc_url), (None, None, None));
        let s = serve(&[
            "--database",
            "postgres://lb:secret@db/lb",
            "--record-store",
            "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
            "--hypervisor-url",
            "libvirt+qemu:///system",
        ])
        .expect("typed");
        assert!(s.database.is_postgres() && s.database.to_string() == "postgres://lb:***@db/lb");
        assert!(matches!(s.record_store, Some(StoreUrl::RedisCluster(_))));
        assert!(matches!(s.hypervisor_url, Some(HypervisorUrl::Libvirt(_))));
        let s = serve(&["--hypervisor-url", "http://127.0.0.1:8090"]).expect("http");
        assert_eq!(s.hypervisor_url, Some(HypervisorUrl::Http("http://127.0.0.1:8090".to_owned())));
        for (flag, url, names) in [
            ("--database", "mysql://u:secret@h/db", "use sqlite://PATH or postgres://"),
            ("--record-store", "memcached://u:secret@h:11211", "use redis://HOST:PORT"),
            ("--record-store", "postgres://u:secret@h/db", "without it the records stay in --database"),
            ("--record-store", "memory", "use redis://HOST:PORT"),
            ("--hypervisor-url", "ftp://u:secret@h", "use http://HOST:PORT"),
            ("--hypervisor-url", "libvirt+", "libvirt+URI"),
            ("--bmc-url", "redfish+ftp://u:secret@h", "use redfish+http://"),
        ] {
            let err = serve(&[flag, url]).expect_err(url);
            assert_eq!(err.exit_code(), 2, "{flag} {url}");
            let text = err.to_string();
            assert!(text.starts_with(&format!("error: {flag}")) && text.contains(names), "{flag} {url}: {text}");
            assert_eq!(text.trim().lines().count(), 1, "{text}");
            assert!(!text.contains("secret"), "{text}");
        }
    }

    #[test]
    fn settle_defaults_and_must_outlast_the_timeout() {
        let serve = |args: &[&str]| {
            let Command::Serve(s) = Cli::try_parse_from([&["leasebroker", "serve"], args].concat()).unwrap().command
            else {
                panic!("serve")
            };
            s
        };
        let s = serve(&[]);
        assert_eq!((s.hypervisor_settle, s.abandon_after), (Duration::from_secs(30), Duration::from_secs(3600)));
        assert!(s.validate().is_ok());
        assert!(serve(&["--hypervisor-timeout", "2s", "--hypervisor-settle", "2001ms"]).validate().is_ok());
        for settle in ["1s", "2s"] {
            let err = serve(&["--hypervisor-timeout", "2s", "--hypervisor-settle", settle]).validate().unwrap_err();
            assert!(err.contains("--hypervisor-settle") && err.contains("--hypervisor-timeout"), "{err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
        let err = serve(&["--retention", "2s", "--in-flight-ttl", "60s"]).validate().unwrap_err();
        assert!(err.contains("--retention (2s)") && err.contains("--in-flight-ttl (1m)"), "{err}");
        assert!(serve(&["--retention", "1m", "--in-flight-ttl", "60s"]).validate().is_err(), "equal is refused too");
        assert!(serve(&["--retention", "61s", "--in-flight-ttl", "60s"]).validate().is_ok());
    }
}
