//! The gateway's configuration (docs/protocol.md#gateway): flags (each also `IDEMPOTENCY_GATEWAY_<FLAG>`), a TOML
//! file (`--config`) with the same names and `[[route]]` tables, and the defaults. A flag
//! overrides the file; a route without an option takes the global one. A bad setting is a
//! [`ConfigError`]: one line naming it (the binary exits 2).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use idempotency_stores::StoreUrl;
use idempotency_stores::clap::UrlParser;
use idempotency_tower::MismatchStatus;

use crate::settings::{
    Bytes, Fingerprint, ForwardKey, MethodPath, Policy, PrincipalSource, UncertainMode, Upstream, duration,
};

/// A configuration that cannot run, in one line naming the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The command line. Every flag also reads `IDEMPOTENCY_GATEWAY_<FLAG>` and may be set in the
/// `--config` file under its name without the dashes in front (`upstream = "..."`); a flag
/// overrides the file.
#[derive(Debug, Default, Parser)]
#[command(name = "idempotency-gateway", version, about = "Idempotency-Key semantics in front of any HTTP service")]
pub struct Args {
    /// The service behind the gateway: `http://HOST:PORT[/PREFIX]` or `https://...` (required, here or in the file).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_UPSTREAM")]
    pub upstream: Option<Upstream>,
    /// Where clients connect [default: 127.0.0.1:8081].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// The admin listener (health, readiness, metrics, records API); never proxied [default: 127.0.0.1:9091].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Where records are kept: `memory`, `sqlite://PATH`, `postgres://...`, `redis://HOST:PORT` or
    /// `redis+cluster://HOST:PORT[,HOST:PORT]...` [default: sqlite://gateway.db].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_RECORD_STORE", hide_env_values = true,
          value_parser = UrlParser::<StoreUrl>::new())]
    pub record_store: Option<StoreUrl>,
    /// Who a request runs as: `bearer` (SHA-256 of the Authorization header) or `header:NAME` [default: bearer].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_PRINCIPAL")]
    pub principal: Option<PrincipalSource>,
    /// A TOML file with these settings and `[[route]]` tables.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// The `Idempotency-Key` the upstream receives [default: derived].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_FORWARD_KEY", value_enum)]
    pub forward_key: Option<ForwardKey>,
    /// What a retry of a record whose outcome is unknown gets [default: hold].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_ON_UNCERTAIN", value_enum)]
    pub on_uncertain: Option<UncertainMode>,
    /// How long the upstream may take to answer (and between two parts of its answer) [default: 30s].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_UPSTREAM_TIMEOUT", value_parser = duration)]
    pub upstream_timeout: Option<Duration>,
    /// A PEM file of CA certificates trusted for an https:// upstream, besides the system's.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_UPSTREAM_CA_CERT")]
    pub upstream_ca_cert: Option<PathBuf>,
    /// How long a completed response is replayed [default: 24h].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_RETENTION", value_parser = duration)]
    pub retention: Option<Duration>,
    /// How long a claim is honoured without renewal before it counts as dead [default: 5m].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_IN_FLIGHT_TTL", value_parser = duration)]
    pub in_flight_ttl: Option<Duration>,
    /// The longest `Prefer: wait=N` honoured [default: 30s].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_WAIT", value_parser = duration)]
    pub max_wait: Option<Duration>,
    /// The status of `idempotency-key-reused` [default: 409].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MISMATCH_STATUS", value_enum)]
    pub mismatch_status: Option<MismatchStatus>,
    /// The largest request body of a protected request (`413` beyond) [default: 1MiB].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_BODY")]
    pub max_body: Option<Bytes>,
    /// The largest response body stored for replay; larger ones are streamed and replayed without
    /// body (`Idempotency-Body-Omitted: true`) [default: 1MiB].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_STORED_RESPONSE")]
    pub max_stored_response: Option<Bytes>,
    /// The most bytes of completed responses kept in memory to answer replays without the
    /// record store, on a store that announces its changes (PostgreSQL, Redis); 0 turns it off
    /// [default: 64MiB].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_REPLAY_CACHE")]
    pub replay_cache: Option<Bytes>,
    /// The bearer token of the admin records API (without one, it answers 401).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Export traces over OTLP to this endpoint.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// A client's request headers must arrive within this [default: 10s].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_HEADER_TIMEOUT", value_parser = duration)]
    pub header_timeout: Option<Duration>,
    /// A client connection without traffic for this long is closed [default: 60s].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_IDLE_TIMEOUT", value_parser = duration)]
    pub idle_timeout: Option<Duration>,
    /// A request body must arrive whole within this (`408`) [default: 30s].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_BODY_TIMEOUT", value_parser = duration)]
    pub body_timeout: Option<Duration>,
    /// The most client connections at once [default: 1024].
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
}

/// One `[[route]]`: options for the requests whose method and path match its template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConfig {
    /// Method and path template (`match`).
    pub matches: MethodPath,
    /// `policy`.
    pub policy: Policy,
    /// `fingerprint`.
    pub fingerprint: Fingerprint,
    /// `on-uncertain`; the global one when absent.
    pub on_uncertain: UncertainMode,
    /// `probe`: how to ask the upstream whether an uncertain request happened (`{key}` is the
    /// forwarded key).
    pub probe: Option<MethodPath>,
    /// `uncertain-on-5xx`: a 5xx may have acted, so it makes the record uncertain.
    pub uncertain_on_5xx: bool,
    /// `retention`; the global one when absent.
    pub retention: Duration,
}

/// Client connection limits (those of leasebroker, docs/protocol.md#leasebroker-api).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// `--header-timeout`.
    pub header: Duration,
    /// `--idle-timeout`.
    pub idle: Duration,
    /// `--body-timeout`.
    pub body: Duration,
    /// `--max-connections`.
    pub max_connections: usize,
}

/// The whole configuration, every setting resolved.
#[derive(Debug, Clone)]
pub struct Config {
    /// `--upstream`.
    pub upstream: Upstream,
    /// `--listen`.
    pub listen: SocketAddr,
    /// `--admin-listen`.
    pub admin_listen: SocketAddr,
    /// `--record-store`.
    pub record_store: StoreUrl,
    /// `--principal`.
    pub principal: PrincipalSource,
    /// `--forward-key`.
    pub forward_key: ForwardKey,
    /// `--on-uncertain`.
    pub on_uncertain: UncertainMode,
    /// `--upstream-timeout`.
    pub upstream_timeout: Duration,
    /// `--upstream-ca-cert`.
    pub upstream_ca_cert: Option<PathBuf>,
    /// `--retention`.
    pub retention: Duration,
    /// `--in-flight-ttl`.
    pub in_flight_ttl: Duration,
    /// `--max-wait`.
    pub max_wait: Duration,
    /// `--mismatch-status`.
    pub mismatch_status: MismatchStatus,
    /// `--max-body`.
    pub max_body: usize,
    /// `--max-stored-response`.
    pub max_stored_response: usize,
    /// `--replay-cache`.
    pub replay_cache: usize,
    /// `--admin-token`.
    pub admin_token: Option<String>,
    /// `--otlp-endpoint`.
    pub otlp_endpoint: Option<String>,
    /// The client connection limits.
    pub limits: ConnectionLimits,
    /// The `[[route]]`s, in order: the first match wins.
    pub routes: Vec<RouteConfig>,
}

const MIB: usize = 1024 * 1024;

impl Config {
    /// Resolves `args` over the `--config` file (when given) over the defaults.
    pub fn resolve(args: Args) -> Result<Self, ConfigError> {
        let mut file = match &args.config {
            Some(path) => FileValues::read(path)?,
            None => FileValues::default(),
        };
        let config = Self::merge(args, &mut file)?;
        file.finish()?;
        Ok(config)
    }

    fn merge(a: Args, f: &mut FileValues) -> Result<Self, ConfigError> {
        let retention = pick(a.retention, f.take("retention", duration)?, Duration::from_secs(24 * 3600));
        let on_uncertain = pick(a.on_uncertain, f.take("on-uncertain", enum_value)?, UncertainMode::Hold);
        let upstream = a.upstream.or(f.take("upstream", parse)?).ok_or_else(|| {
            ConfigError("--upstream: missing (the service behind the gateway, e.g. http://127.0.0.1:8000)".into())
        })?;
        let config = Self {
            upstream,
            listen: pick(a.listen, f.take("listen", parse)?, SocketAddr::from(([127, 0, 0, 1], 8081))),
            admin_listen: pick(
                a.admin_listen,
                f.take("admin-listen", parse)?,
                SocketAddr::from(([127, 0, 0, 1], 9091)),
            ),
            record_store: pick(a.record_store, f.take("record-store", parse)?, default_record_store()),
            principal: pick(a.principal, f.take("principal", parse)?, PrincipalSource::Bearer),
            forward_key: pick(a.forward_key, f.take("forward-key", enum_value)?, ForwardKey::Derived),
            on_uncertain,
            upstream_timeout: pick(a.upstream_timeout, f.take("upstream-timeout", duration)?, Duration::from_secs(30)),
            upstream_ca_cert: a.upstream_ca_cert.or(f.take("upstream-ca-cert", parse)?),
            retention,
            in_flight_ttl: pick(a.in_flight_ttl, f.take("in-flight-ttl", duration)?, Duration::from_secs(300)),
            max_wait: pick(a.max_wait, f.take("max-wait", duration)?, Duration::from_secs(30)),
            mismatch_status: pick(a.mismatch_status, f.take("mismatch-status", enum_value)?, MismatchStatus::Conflict),
            max_body: pick(a.max_body, f.take("max-body", parse)?, Bytes(MIB)).0,
            max_stored_response: pick(a.max_stored_response, f.take("max-stored-response", parse)?, Bytes(MIB)).0,
            replay_cache: pick(a.replay_cache, f.take("replay-cache", parse)?, Bytes(64 * MIB)).0,
            admin_token: a.admin_token.or(f.take("admin-token", parse)?),
            otlp_endpoint: a.otlp_endpoint.or(f.take("otlp-endpoint", parse)?),
            limits: ConnectionLimits {
                header: pick(a.header_timeout, f.take("header-timeout", duration)?, Duration::from_secs(10)),
                idle: pick(a.idle_timeout, f.take("idle-timeout", duration)?, Duration::from_secs(60)),
                body: pick(a.body_timeout, f.take("body-timeout", duration)?, Duration::from_secs(30)),
                max_connections: pick(a.max_connections, f.take("max-connections", parse)?, 1024),
            },
            routes: f.routes(on_uncertain, retention)?,
        };
        config.check()
    }

    /// The rules between settings.
    fn check(self) -> Result<Self, ConfigError> {
        if self.upstream_timeout.is_zero() {
            return Err(ConfigError("--upstream-timeout: must be longer than zero".into()));
        }
        for (i, route) in self.routes.iter().enumerate() {
            if route.probe.is_some() && self.forward_key == ForwardKey::None {
                return Err(ConfigError(format!(
                    "probe of route {} ({}): a probe asks by the forwarded key, and --forward-key is none",
                    i + 1,
                    route.matches.template
                )));
            }
            if route.retention <= self.in_flight_ttl {
                return Err(ConfigError(format!(
                    "route {} ({}) retention / --in-flight-ttl: the retention ({}) must be longer than the in-flight TTL ({})",
                    i + 1,
                    route.matches.template,
                    humantime::format_duration(route.retention),
                    humantime::format_duration(self.in_flight_ttl)
                )));
            }
        }
        if self.retention <= self.in_flight_ttl {
            return Err(ConfigError(format!(
                "--retention, --in-flight-ttl: the retention ({}) must be longer than the in-flight TTL ({})",
                humantime::format_duration(self.retention),
                humantime::format_duration(self.in_flight_ttl)
            )));
        }
        if self.max_connections() == 0 {
            return Err(ConfigError("--max-connections: must be at least 1".into()));
        }
        Ok(self)
    }

    fn max_connections(&self) -> usize {
        self.limits.max_connections
    }
}

/// The flag's value, else the file's, else the default.
/// `sqlite://gateway.db`: a file beside the gateway, as leasebroker's embedded default.
fn default_record_store() -> StoreUrl {
    "sqlite://gateway.db".parse().expect("the default record store URL parses")
}

fn pick<T>(flag: Option<T>, file: Option<T>, default: T) -> T {
    flag.or(file).unwrap_or(default)
}

fn parse<T: FromStr>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    T::from_str(s).map_err(|e| e.to_string())
}

fn enum_value<T: ValueEnum>(s: &str) -> Result<T, String> {
    T::from_str(s, false).map_err(|_| {
        let names: Vec<String> =
            T::value_variants().iter().filter_map(|v| v.to_possible_value()).map(|v| v.get_name().to_owned()).collect();
        format!("expected one of {}", names.join(", "))
    })
}

/// The settings of the `--config` file not yet taken.
#[derive(Debug, Default)]
struct FileValues {
    path: Option<PathBuf>,
    table: toml::Table,
}

impl FileValues {
    fn read(path: &Path) -> Result<Self, ConfigError> {
        let shown = path.display();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError(format!("--config {shown}: {e}")))?;
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let line = e.span().map_or(0, |s| text[..s.start].lines().count().max(1));
            ConfigError(format!("--config {shown}: line {line}: {}", e.message().trim()))
        })?;
        Ok(Self { path: Some(path.to_path_buf()), table })
    }

    fn name(&self) -> String {
        self.path.as_deref().map_or_else(|| "the config file".to_owned(), |p| p.display().to_string())
    }

    /// The setting `name`, parsed; an error names it and the file.
    fn take<T>(&mut self, name: &str, parse: impl Fn(&str) -> Result<T, String>) -> Result<Option<T>, ConfigError> {
        let Some(value) = self.table.remove(name) else { return Ok(None) };
        let text = scalar(&value).ok_or_else(|| ConfigError(format!("{name} in {}: expected a value", self.name())))?;
        parse(&text).map(Some).map_err(|e| ConfigError(format!("{name} in {}: {e}", self.name())))
    }

    /// The `[[route]]` tables, in order.
    fn routes(&mut self, on_uncertain: UncertainMode, retention: Duration) -> Result<Vec<RouteConfig>, ConfigError> {
        let Some(value) = self.table.remove("route") else { return Ok(Vec::new()) };
        let file = self.name();
        let toml::Value::Array(tables) = value else {
            return Err(ConfigError(format!("route in {file}: expected [[route]] tables")));
        };
        tables
            .into_iter()
            .enumerate()
            .map(|(i, t)| match t {
                toml::Value::Table(table) => {
                    let mut values = FileValues { path: Some(format!("{file}, route {}", i + 1).into()), table };
                    let route = values.route(on_uncertain, retention)?;
                    values.finish().map(|()| route)
                }
                _ => Err(ConfigError(format!("route {} in {file}: expected a table", i + 1))),
            })
            .collect()
    }

    fn route(&mut self, on_uncertain: UncertainMode, retention: Duration) -> Result<RouteConfig, ConfigError> {
        let matches =
            self.take("match", parse)?.ok_or_else(|| ConfigError(format!("match in {}: missing", self.name())))?;
        Ok(RouteConfig {
            matches,
            policy: self.take("policy", enum_value)?.unwrap_or_default(),
            fingerprint: self.take("fingerprint", enum_value)?.unwrap_or_default(),
            on_uncertain: self.take("on-uncertain", enum_value)?.unwrap_or(on_uncertain),
            probe: self.take("probe", parse)?,
            uncertain_on_5xx: self.take("uncertain-on-5xx", parse)?.unwrap_or(false),
            retention: self.take("retention", duration)?.unwrap_or(retention),
        })
    }

    /// Refuses what is left: a setting the gateway does not know.
    fn finish(self) -> Result<(), ConfigError> {
        match self.table.keys().next() {
            Some(key) => Err(ConfigError(format!("{key} in {}: no such setting", self.name()))),
            None => Ok(()),
        }
    }
}

/// A TOML scalar as the text a flag would hold.
fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Renders a clap error as one line (clap's own spans several): what the binary prints before it
/// exits 2.
pub fn one_line(e: &clap::Error) -> String {
    e.render()
        .to_string()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .collect::<Vec<_>>()
        .join(" ")
}
