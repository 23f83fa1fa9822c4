//! Building the gateway from its [`Config`] and running it: the route matcher in front of one
//! idempotency layer per route, in front of the proxy; and the admin listener.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Body;
use futures::future::BoxFuture;
use http::{HeaderName, Request, Response};
use idempotency::Store;
use idempotency_tower::{
    DetachedHandlers, IdempotencyLayer, IdempotencyService, OnUncertain, OversizeResponse, StaleClaims,
};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tower::{Layer, ServiceExt};

use crate::admin::{self, AdminState};
use crate::config::{Config, ConfigError};
use crate::proxy::{Proxy, ProxySettings, RouteOutcomes};
use crate::routes::RouteTable;
use crate::settings::{Fingerprint, Policy, PrincipalSource, UncertainMode};

/// How often expired records are deleted.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// Response headers a replay carries besides `Content-Type` and `Location`: those that say how
/// to read the stored body (its encoding, language, disposition) and what it is (validators,
/// caching, links). An upstream's own headers beyond these are not replayed.
const REPLAYED: [&str; 8] = [
    "content-encoding",
    "content-language",
    "content-disposition",
    "etag",
    "last-modified",
    "cache-control",
    "link",
    "vary",
];

/// A built gateway: its listeners bound, its store connected.
#[derive(Debug)]
pub struct Gateway {
    listener: TcpListener,
    admin_listener: TcpListener,
    router: axum::Router,
    admin_router: axum::Router,
    detached: Vec<DetachedHandlers>,
    limits: crate::config::ConnectionLimits,
}

impl Gateway {
    /// Connects the store, builds the layers, the proxy and the admin routes, binds both
    /// listeners. `metrics` renders the process's Prometheus registry on `/metrics`.
    pub async fn build(config: Config, metrics: PrometheusHandle) -> anyhow::Result<Self> {
        let store = crate::store::connect(&config.record_store, config.replay_cache).await?;
        let connect_timeout = (config.upstream_timeout / 2).min(Duration::from_secs(10));
        let client = crate::proxy::client::build(config.upstream_ca_cert.as_deref(), connect_timeout)?;
        let proxy = Proxy::new(
            client,
            ProxySettings {
                upstream: config.upstream.clone(),
                forward_key: config.forward_key,
                timeout: config.upstream_timeout,
                max_read: config.max_stored_response,
            },
        );
        let (service, detached) = GatewayService::new(&config, store.clone(), proxy)?;
        let admin_layer = layer(&config, store.clone(), &PrincipalSource::Bearer, Policy::Required, Fingerprint::Raw)
            // The admin routes' principal is put in the request's extensions by the token check.
            .principal(|parts| parts.extensions.get::<idempotency::Principal>().cloned())
            .try_build()
            .map_err(|e| ConfigError(format!("--retention, --in-flight-ttl: {e}")))?;
        let mut detached = detached;
        detached.push(admin_layer.detached());
        let admin_state = AdminState {
            store: store.clone(),
            metrics,
            token: config.admin_token.as_deref().map(Arc::from),
            retention: config.retention,
        };
        let admin_router = admin::router(admin_state, admin_layer);
        idempotency_tower::spawn_sweeper(store, SWEEP_INTERVAL);
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("--listen: cannot listen on {}", config.listen))?;
        let admin_listener = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("--admin-listen: cannot listen on {}", config.admin_listen))?;
        let router = axum::Router::new().fallback_service(service);
        Ok(Self { listener, admin_listener, router, admin_router, detached, limits: config.limits })
    }

    /// Where clients connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Where the admin listener is.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_listener.local_addr().expect("a bound listener has an address")
    }

    /// Serves both listeners until `shutdown`, then drains: connections finish their requests,
    /// and forwarded requests whose clients hung up are waited for so their answers are stored.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let timeouts = leasebroker::serve::Timeouts {
            max_connections: self.limits.max_connections,
            max_connections_per_source: usize::MAX,
            header: self.limits.header,
            idle: self.limits.idle,
            body: self.limits.body,
            shutdown: Duration::from_secs(30),
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let admin =
            leasebroker::serve::serve(self.admin_listener, self.admin_router, timeouts, None, stopped(stop_rx.clone()));
        let admin = tokio::spawn(admin);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let mut detached = self.detached.into_iter();
        let first = detached.next();
        let drained = leasebroker::serve::serve(self.listener, self.router, timeouts, first, stopped(stop_rx)).await;
        for handlers in detached {
            handlers.close();
            let _ = tokio::time::timeout(timeouts.shutdown, handlers.wait()).await;
        }
        let _ = admin.await;
        if !drained {
            tracing::warn!("shutdown: some forwarded requests did not finish in time");
        }
        Ok(())
    }
}

/// A layer builder over `store` with the gateway's settings for one route.
fn layer(
    config: &Config,
    store: Arc<dyn Store>,
    principal: &PrincipalSource,
    policy: Policy,
    fingerprint: Fingerprint,
) -> idempotency_tower::IdempotencyLayerBuilder {
    let principal = principal.clone();
    let builder = IdempotencyLayer::builder(store)
        .principal(move |parts| principal.principal_of(parts))
        .policy(move |_, _| policy.into())
        .fingerprint_mode(fingerprint.into())
        .mismatch_status(config.mismatch_status)
        .in_flight_ttl(config.in_flight_ttl)
        .retention(config.retention)
        .max_wait(config.max_wait)
        .body_limit(config.max_body)
        .max_stored_response(config.max_stored_response)
        .oversize_response(OversizeResponse::HeadersOnly);
    REPLAYED.iter().fold(builder, |b, name| b.replay_header(HeaderName::from_static(name)))
}

/// The layer's retry of an uncertain record under `mode`.
fn retry_of(mode: UncertainMode) -> OnUncertain {
    match mode {
        UncertainMode::Hold => OnUncertain::Hold,
        UncertainMode::Resend => OnUncertain::Resend,
    }
}

/// The route matcher in front of the layers: finds the request's `[[route]]` (the first match,
/// on the normalized path), puts the route's options into the request's extensions, and hands
/// it to that route's layer (or the default one).
#[derive(Clone)]
pub struct GatewayService {
    routes: Arc<RouteTable>,
    /// One per route, in order, then the default.
    layered: Arc<[IdempotencyService<Proxy>]>,
    outcomes: Arc<[RouteOutcomes]>,
    /// What a retry of an uncertain record gets, per route, then the default.
    retries: Arc<[OnUncertain]>,
}

impl std::fmt::Debug for GatewayService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayService").field("routes", &self.routes).finish_non_exhaustive()
    }
}

impl GatewayService {
    /// The matcher of `config`'s routes, each behind its own layer over `store`, and the layers'
    /// detached handlers (for the shutdown to wait for).
    pub fn new(
        config: &Config,
        store: Arc<dyn Store>,
        proxy: Proxy,
    ) -> Result<(Self, Vec<DetachedHandlers>), ConfigError> {
        let routes = RouteTable::new(&config.routes)?;
        let mut layered = Vec::with_capacity(config.routes.len() + 1);
        let mut outcomes = Vec::with_capacity(config.routes.len() + 1);
        let mut detached = Vec::with_capacity(config.routes.len() + 1);
        let mut retries = Vec::with_capacity(config.routes.len() + 1);
        for (i, route) in config.routes.iter().enumerate() {
            let built = layer(config, store.clone(), &config.principal, route.policy, route.fingerprint)
                .retention(route.retention)
                .stale_claims(StaleClaims::Uncertain)
                .try_build()
                .map_err(|e| ConfigError(format!("retention of route {} / --in-flight-ttl: {e}", i + 1)))?;
            detached.push(built.detached());
            layered.push(built.layer(proxy.clone()));
            outcomes.push(RouteOutcomes { uncertain_on_5xx: route.uncertain_on_5xx });
            retries.push(match (&route.probe, route.on_uncertain) {
                (Some(probe), _) => OnUncertain::Probe(proxy.probe(probe.clone())),
                (None, mode) => retry_of(mode),
            });
        }
        // The gateway's rule for a claim whose process died: uncertain, never free (docs/protocol.md#gateway). The
        // layer's default (take it over and run again) suits a handler that resumes through its
        // sub-keys; a proxy cannot resume, and its dead attempt may have reached the upstream.
        let default = layer(config, store, &config.principal, Policy::Required, Fingerprint::Raw)
            .stale_claims(StaleClaims::Uncertain)
            .try_build()
            .map_err(|e| ConfigError(format!("--retention, --in-flight-ttl: {e}")))?;
        detached.push(default.detached());
        layered.push(default.layer(proxy));
        outcomes.push(RouteOutcomes::default());
        retries.push(retry_of(config.on_uncertain));
        let service = Self {
            routes: Arc::new(routes),
            layered: layered.into(),
            outcomes: outcomes.into(),
            retries: retries.into(),
        };
        Ok((service, detached))
    }
}

impl tower::Service<Request<Body>> for GatewayService {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let path = idempotency::normalize_path(req.uri().path());
        let index = self.routes.find(req.method(), &path).map_or(self.layered.len() - 1, |m| m.index);
        req.extensions_mut().insert(self.outcomes[index]);
        req.extensions_mut().insert(self.retries[index].clone());
        let service = self.layered[index].clone();
        Box::pin(service.oneshot(req))
    }
}
