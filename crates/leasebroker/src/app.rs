//! Building and running the service: `Application::build`, `port()`, `run_until_stopped()`.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::IntoResponse;
use idempotency::{Principal, ReplayCache, ResponsePolicy, Store};
use idempotency_stores::StoreUrl;
use idempotency_tower::{DetachedHandlers, IdempotencyLayer, KeySources};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use rand::RngCore;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::api::{self, AppState, BODY_LIMIT, token_digest};
use crate::background::Background;
use crate::config::{ConfigError, KeySource, ServeArgs};
use crate::db::{Db, redact};
use crate::domain::Domain;
use crate::firmware::{ApiBmc, Bmc, Firmware, WatchSettings, Watcher};
use crate::hypervisor::client::HypervisorClient;
use crate::hypervisor::redfish::RedfishBmc;
use crate::hypervisor::sim::{SimConfig, Simulator};
use crate::hypervisor::url::{BmcUrl, HypervisorUrl};
use crate::reaper::Reaper;
use crate::serve::{self, Timeouts};
use crate::service::{Limits, Workers};

/// A built, listening service.
#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    background: Background,
    /// The idempotency layer's handlers whose clients hung up: waited for on shutdown.
    detached: DetachedHandlers,
    timeouts: Timeouts,
    db: Db,
    /// The token generated at start when none was configured.
    pub generated_token: Option<String>,
}

/// The Prometheus recorder is process-global: install it once.
fn metrics_handle() -> anyhow::Result<PrometheusHandle> {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let h = PrometheusBuilder::new()
        .set_buckets(&[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        .context("metrics buckets")?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    crate::metric::describe();
    crate::metric::start_at_zero();
    Ok(HANDLE.get_or_init(|| h).clone())
}

impl Application {
    /// Connects and migrates the database, seeds the node pool, starts the in-process
    /// hypervisor simulator when no URL is given, and binds the listener.
    pub async fn build(args: ServeArgs) -> anyhow::Result<Self> {
        Self::build_with_store(args, |store| store).await
    }

    /// [`build`](Self::build), with the idempotency store passed through `wrap` first (tests
    /// wrap it in a fault-injecting store).
    pub async fn build_with_store(
        args: ServeArgs,
        wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>,
    ) -> anyhow::Result<Self> {
        args.validate().map_err(ConfigError)?;
        let metrics = metrics_handle()?;
        let db = Db::connect_with(&args.database, args.sqlite_connections).await?;
        db.migrate().await?;
        let domain = Domain::new(db.clone());
        domain
            .seed_nodes(args.pool_nodes, args.node_cpu, args.node_memory_gb)
            .await
            .context("seeding the node pool")?;

        let mut background = Background::new();
        let timeouts = timeouts(&args);
        let (hypervisor, bmc) = hypervisor(&args, timeouts, &mut background).await?;
        let hypervisor_shown =
            args.hypervisor_url.as_ref().map_or_else(|| "in-process simulator".to_owned(), |u| u.to_string());
        let store = wrap(ReplayCache::over(
            match &args.record_store {
                None => db.idempotency_store(),
                Some(url) => record_store(url, &args).await?,
            },
            args.replay_cache,
        ));
        let layer = idempotency_layer(store.clone(), &args)?;
        start_reaper_and_watcher(&mut background, &store, &domain, &hypervisor, &bmc, &args);

        let (tokens, generated_token) = tokens(&args);
        let probe = crate::outage::StoreProbe::new(db.clone());
        let state = AppState::new(api::AppStateInner {
            firmware: Firmware {
                domain: domain.clone(),
                bmc,
                settle: args.hypervisor_settle,
                hook: Default::default(),
            },
            workers: Workers {
                domain,
                hypervisor: hypervisor.clone(),
                settle: args.hypervisor_settle,
                limits: Limits { node_cpu: i64::from(args.node_cpu), node_memory_gb: i64::from(args.node_memory_gb) },
                quota: args.max_workers_per_principal,
                hook: Default::default(),
            },
            tokens: Arc::new(tokens),
            admin_token: args.admin_token.as_deref().map(token_digest),
            store,
            metrics,
            hypervisor,
            rate_limiter: api::rate_limiter(args.rate_limit, args.rate_limit_burst),
            shares: api::Shares::new(args.max_concurrent_per_principal, args.max_records_per_principal > 0),
            audit: crate::audit::Audit::new(db.clone()),
            probe,
            body_key_field: args
                .key_sources
                .contains(&KeySource::RequestId)
                .then_some(idempotency_tower::AIP_155_REQUEST_ID),
        });
        let console = crate::console::Console::default();
        background.every(
            "console-sampler",
            crate::console::chart::SAMPLE_EVERY,
            crate::console::chart::Sampler { history: console.history.clone(), metrics: state.metrics.clone() },
        );
        let detached = layer.detached();
        let router = with_edge_layers(crate::routes::router(state, layer, console), &args);
        let listener =
            TcpListener::bind(args.listen).await.with_context(|| format!("cannot listen on {}", args.listen))?;
        let bmc_shown = args.bmc_url.as_ref().map_or_else(|| "the hypervisor's".to_owned(), |u| u.to_string());
        tracing::info!(database = %args.database, hypervisor = %hypervisor_shown, bmc = %bmc_shown, "leasebroker ready");
        Ok(Self { listener, router, background, detached, generated_token, timeouts, db })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// The service's database pool (the one its handlers and its record store use).
    pub fn database(&self) -> &Db {
        &self.db
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.local_addr().port()
    }

    /// Serves until `shutdown` resolves, then drains: requests in flight, and handlers whose
    /// client already hung up, within `--shutdown-timeout`.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let drained = serve::serve(self.listener, self.router, self.timeouts, Some(self.detached), shutdown).await;
        self.background.stop();
        if !drained {
            tracing::warn!("exiting with requests unfinished: their keys stay in flight until --in-flight-ttl");
        }
        Ok(())
    }
}

/// How connections are limited, timed out and drained.
fn timeouts(args: &ServeArgs) -> Timeouts {
    Timeouts {
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        max_connections_per_source: match args.max_connections_per_source {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        },
        header: args.header_timeout,
        idle: args.idle_timeout,
        body: args.body_timeout,
        shutdown: args.shutdown_timeout,
    }
}

/// The one place the backends are chosen: the VMs behind an HTTP API, on libvirt (BMCs from the
/// in-process simulator) or in the simulator; the BMCs beside them or on Redfish.
async fn hypervisor(
    args: &ServeArgs,
    timeouts: Timeouts,
    background: &mut Background,
) -> anyhow::Result<(HypervisorClient, Arc<dyn Bmc>)> {
    let hypervisor = match &args.hypervisor_url {
        Some(HypervisorUrl::Http(url)) => {
            HypervisorClient::with_ca_cert(url, args.hypervisor_timeout, args.hypervisor_ca_cert.as_deref())
                .map_err(|e| anyhow::anyhow!("hypervisor client: {}", redact(&e.to_string())))?
        }
        Some(HypervisorUrl::Libvirt(url)) => {
            with_libvirt(private_simulator(args, timeouts, background).await?, url, args).await?
        }
        None => private_simulator(args, timeouts, background).await?,
    };
    let bmc: Arc<dyn Bmc> = match &args.bmc_url {
        Some(BmcUrl::Redfish(url)) => Arc::new(
            RedfishBmc::new(url, args.hypervisor_timeout, args.bmc_ca_cert.as_deref(), &args.firmware_images)
                .map_err(|e| anyhow::anyhow!("{}", redact(&e.to_string())))?,
        ),
        None => Arc::new(ApiBmc::new(hypervisor.clone())),
    };
    Ok((hypervisor, bmc))
}

/// The idempotency layer, with the settings the flags give it.
fn idempotency_layer(store: Arc<dyn Store>, args: &ServeArgs) -> Result<IdempotencyLayer, ConfigError> {
    IdempotencyLayer::builder(store)
        .response_policy(ResponsePolicy::default())
        .mismatch_status(args.mismatch_status)
        .in_flight_ttl(args.in_flight_ttl)
        .max_wait(args.max_wait)
        .retention(args.retention)
        .body_limit(BODY_LIMIT)
        .max_stored_response(args.max_stored_response)
        .max_records_per_principal(Some(args.max_records_per_principal).filter(|&n| n > 0))
        // A Redis transition waits for its replicas up to --record-store-replica-timeout: the
        // bound on a store call leaves it that long and a second more.
        .store_timeout(
            idempotency_tower::DEFAULT_STORE_TIMEOUT
                .max(args.record_store_replica_timeout + std::time::Duration::from_secs(1)),
        )
        .operation_link(crate::firmware::operation_link)
        .key_sources(key_sources(&args.key_sources))
        .try_build()
        .map_err(|e| ConfigError(format!("--retention, --in-flight-ttl: {e}")))
}

/// Starts the sweeper with the reaper, and the firmware operations' watcher.
fn start_reaper_and_watcher(
    background: &mut Background,
    store: &Arc<dyn Store>,
    domain: &Domain,
    hypervisor: &HypervisorClient,
    bmc: &Arc<dyn Bmc>,
    args: &ServeArgs,
) {
    let reaper = Reaper::new(
        store.clone(),
        domain.clone(),
        hypervisor.clone(),
        crate::reaper::ReaperSettings {
            settle: args.hypervisor_settle,
            abandon_after: args.abandon_after,
            retry_grace: crate::reaper::RETRY_GRACE,
            in_flight_ttl: args.in_flight_ttl,
            retention: args.retention,
        },
    );
    background.every(
        "reaper",
        args.sweep_interval,
        crate::reaper::SweepAndReap { sweeper: idempotency_tower::sweeper(store.clone(), args.sweep_interval), reaper },
    );
    let watcher = Watcher::new(
        domain.clone(),
        bmc.clone(),
        store.clone(),
        watcher_name(),
        WatchSettings {
            poll: args.operation_poll,
            settle: args.hypervisor_settle,
            abandon_after: args.abandon_after,
            in_flight_ttl: args.in_flight_ttl,
        },
    );
    background.every("watcher", args.operation_poll, watcher);
}

/// The API tokens and their principals; without any configured, one generated (and returned, to
/// be shown once).
fn tokens(args: &ServeArgs) -> (Vec<([u8; 32], Principal)>, Option<String>) {
    let mut generated_token = None;
    let mut tokens: Vec<([u8; 32], Principal)> =
        args.tokens.iter().map(|(t, p)| (token_digest(t), Principal::new(p.clone()))).collect();
    if tokens.is_empty() {
        let mut b = [0u8; 24];
        rand::rng().fill_bytes(&mut b);
        let token = format!("lb_{}", hex::encode(b));
        tokens.push((token_digest(&token), Principal::new("default")));
        generated_token = Some(token);
    }
    (tokens, generated_token)
}

/// The layers every request passes before the routes, outermost last.
fn with_edge_layers(router: axum::Router, args: &ServeArgs) -> axum::Router {
    router
        // Each frame of a request body must arrive within the idle timeout: a stalled upload
        // fails its handler instead of holding it.
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(args.idle_timeout))
        // Then the head: too many or too large header fields, a path that does not decode.
        .layer(axum::middleware::from_fn(crate::head::check_head))
        // Checked before any other limit: a long path is refused before it is authenticated.
        .layer(axum::middleware::from_fn(crate::limits::path_length))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        // Outermost: each request in its span (exported with --otlp-endpoint).
        .layer(axum::middleware::from_fn(crate::telemetry::request_span))
}

/// The key sources of each protected route (`--key-sources`): `Repeatability-Request-ID` on
/// every one, the body's `request_id` on the two with a JSON body (creating a worker, flashing a
/// node).
fn key_sources(sources: &[KeySource]) -> impl Fn(&axum::http::Method, &str) -> KeySources + Send + Sync + 'static {
    let repeatability = sources.contains(&KeySource::Repeatability);
    let request_id = sources.contains(&KeySource::RequestId);
    move |method, path| {
        let mut ks = KeySources::default();
        if repeatability {
            ks = ks.repeatability();
        }
        // The keyed routes with a JSON body: a create and a flash.
        if request_id && crate::keyed::KeyedRoute::of(method, path).is_some() {
            ks = ks.body_field(idempotency_tower::AIP_155_REQUEST_ID);
        }
        ks
    }
}

/// This process's name on the watch leases it holds: the host, the pid and a random part, so a
/// restarted process (same pid, maybe) never takes itself for its predecessor.
fn watcher_name() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_owned());
    format!("{host}/{}/{:08x}", std::process::id(), rand::random::<u32>())
}

/// The header that carries the in-process simulator's secret.
const SIM_SECRET_HEADER: &str = "x-leasebroker-sim-secret";

/// Serves the in-process simulator on a loopback port that answers only requests carrying a
/// random secret this process holds, so no other local process can list VMs or switch faults
/// on. Returns its URL, the headers the client must send, and the task.
///
/// Its port has the same connection limits and timeouts as the service's, but for the
/// per-source cap: all its clients are this process.
async fn spawn_private_simulator(
    sim: Simulator,
    timeouts: Timeouts,
) -> anyhow::Result<(String, HeaderMap, JoinHandle<()>)> {
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    let secret = hex::encode(secret);
    let digest = token_digest(&secret);
    let router = sim.router().layer(axum::middleware::from_fn(move |req: Request, next: Next| async move {
        let presented =
            req.headers().get(SIM_SECRET_HEADER).map(|v| token_digest(&String::from_utf8_lossy(v.as_bytes())));
        if presented.is_some_and(|p| bool::from(p.ct_eq(&digest))) {
            next.run(req).await
        } else {
            StatusCode::NOT_FOUND.into_response()
        }
    }));
    let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the in-process hypervisor")?;
    let url = format!("http://{}", listener.local_addr()?);
    // Every connection that carries the secret is this process's own: one source, never capped.
    let timeouts = Timeouts { max_connections_per_source: usize::MAX, ..timeouts };
    let task = tokio::spawn(async move {
        // The simulator has no idempotency layer: nothing is detached.
        serve::serve(listener, router, timeouts, None, std::future::pending()).await;
    });
    let mut headers = HeaderMap::new();
    headers.insert(SIM_SECRET_HEADER, HeaderValue::from_str(&secret).context("simulator secret")?);
    Ok((url, headers, task))
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { () = ctrl_c => {}, () = term => {} }
    tracing::info!("shutting down: draining in-flight requests");
}

/// The simulator, run inside this process on a private port (`--sim-*`), and a client for it.
async fn private_simulator(
    args: &ServeArgs,
    timeouts: Timeouts,
    background: &mut Background,
) -> anyhow::Result<HypervisorClient> {
    let sim = Simulator::new(SimConfig {
        fail_before: args.sim_fail_before,
        fail_after: args.sim_fail_after,
        latency: Duration::from_millis(args.sim_latency_ms),
        ..SimConfig::default()
    })
    .with_flash_time(Duration::from_millis(args.sim_flash_ms))
    .with_flash_failure(args.sim_flash_fail)
    .with_missing_images(args.sim_missing_image.clone());
    let (url, headers, task) = spawn_private_simulator(sim, timeouts).await?;
    background.adopt("simulator", task);
    HypervisorClient::with_headers(&url, args.hypervisor_timeout, headers, args.header_timeout / 2)
        .map_err(|e| anyhow::anyhow!("hypervisor client: {}", redact(&e.to_string())))
}

/// The record store at `url` (`--record-store`), with the Redis settings of `args`.
async fn record_store(url: &StoreUrl, args: &ServeArgs) -> anyhow::Result<Arc<dyn Store>> {
    let mut redis = idempotency_stores::RedisStoreOptions::default()
        .replicas(args.record_store_replicas)
        .replica_timeout(args.record_store_replica_timeout);
    if let Some(path) = &args.redis_ca_cert {
        let pem = std::fs::read(path).with_context(|| format!("--redis-ca-cert: cannot read {}", path.display()))?;
        redis = redis.root_certificates_pem(pem);
    }
    let options = idempotency_stores::Options::default().redis(redis);
    Ok(idempotency_stores::connect(url, &options).await?)
}

/// The hypervisor client with its VMs on the libvirt host at `url` (`libvirt+URI`).
#[cfg(feature = "libvirt")]
async fn with_libvirt(hypervisor: HypervisorClient, url: &str, args: &ServeArgs) -> anyhow::Result<HypervisorClient> {
    let vms =
        crate::hypervisor::libvirt::LibvirtVms::connect(url, args.libvirt_images.clone(), args.hypervisor_timeout)
            .await
            .map_err(|e| anyhow::anyhow!("libvirt at {}: {e}", redact(url)))?;
    Ok(hypervisor.with_libvirt(vms))
}

/// Without the `libvirt` feature a libvirt URL is refused at start, in one line.
#[cfg(not(feature = "libvirt"))]
async fn with_libvirt(_: HypervisorClient, url: &str, _: &ServeArgs) -> anyhow::Result<HypervisorClient> {
    anyhow::bail!(
        "--hypervisor-url {}: this leasebroker was built without libvirt support (build it with `--features libvirt`)",
        redact(url)
    )
}
