//! Building and running the service: `Application::build`, `port()`, `run_until_stopped()`.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::http::StatusCode;
use idempotency::{Principal, ResponsePolicy};
use idempotency_tower::IdempotencyLayer;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use rand::RngCore;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::api::{self, AppState, BODY_LIMIT, token_digest};
use crate::config::ServeArgs;
use crate::db::{Db, redact};
use crate::domain::Domain;
use crate::hypervisor::client::HypervisorClient;
use crate::hypervisor::sim::{SimConfig, Simulator};
use crate::service::{Limits, Workers};

/// A built, listening service.
#[derive(Debug)]
pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    background: Vec<JoinHandle<()>>,
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
    Ok(HANDLE.get_or_init(|| h).clone())
}

impl Application {
    /// Connects and migrates the database, seeds the node pool, starts the in-process
    /// hypervisor simulator when no URL is given, and binds the listener.
    pub async fn build(args: ServeArgs) -> anyhow::Result<Self> {
        let metrics = metrics_handle()?;
        let db = Db::connect(&args.database).await?;
        db.migrate().await?;
        let domain = Domain::new(db.clone());
        domain
            .seed_nodes(args.pool_nodes, args.node_cpu, args.node_memory_gb)
            .await
            .context("seeding the node pool")?;

        let mut background = Vec::new();
        let hypervisor_url = match &args.hypervisor_url {
            Some(url) => url.clone(),
            None => {
                let sim = Simulator::new(SimConfig {
                    fail_before: args.sim_fail_before,
                    fail_after: args.sim_fail_after,
                    latency: Duration::from_millis(args.sim_latency_ms),
                });
                let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the in-process hypervisor")?;
                let addr = listener.local_addr()?;
                background.push(tokio::spawn(async move {
                    if let Err(e) = crate::hypervisor::sim::serve(listener, sim, std::future::pending()).await {
                        tracing::error!(error = %e, "in-process hypervisor simulator stopped");
                    }
                }));
                format!("http://{addr}")
            }
        };
        let hypervisor = HypervisorClient::with_ca_cert(
            &hypervisor_url,
            args.hypervisor_timeout,
            args.hypervisor_ca_cert.as_deref(),
        )
        .map_err(|e| anyhow::anyhow!("hypervisor client: {e}"))?;

        let store = db.idempotency_store();
        let mismatch = StatusCode::from_u16(args.mismatch_status).context("mismatch status")?;
        let layer = IdempotencyLayer::builder(store.clone())
            .response_policy(ResponsePolicy::default())
            .mismatch_status(mismatch)
            .in_flight_ttl(args.in_flight_ttl)
            .retention(args.retention)
            .body_limit(BODY_LIMIT)
            .build();
        background.push(idempotency_tower::spawn_sweeper(store.clone(), args.sweep_interval));

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

        let state = AppState {
            workers: Workers {
                domain,
                hypervisor: hypervisor.clone(),
                grace: args.hypervisor_timeout,
                limits: Limits { node_cpu: i64::from(args.node_cpu), node_memory_gb: i64::from(args.node_memory_gb) },
            },
            tokens: Arc::new(tokens),
            admin_token: args.admin_token.as_deref().map(token_digest),
            store,
            metrics,
            hypervisor,
        };
        let router = api::router(state, layer).layer(tower_http::trace::TraceLayer::new_for_http());
        let listener =
            TcpListener::bind(args.listen).await.with_context(|| format!("cannot listen on {}", args.listen))?;
        tracing::info!(database = %redact(&args.database), hypervisor = %hypervisor_url, "leasebroker ready");
        Ok(Self { listener, router, background, generated_token })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.local_addr().port()
    }

    /// Serves until `shutdown` resolves, then drains in-flight requests.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let result = axum::serve(self.listener, self.router).with_graceful_shutdown(shutdown).await;
        // Handlers run in their own tasks (so a disconnect cannot cut them short); give the ones
        // still finishing a moment to store their responses.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for h in self.background {
            h.abort();
        }
        result.context("server error")
    }
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
