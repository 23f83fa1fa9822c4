//! The pooled upstream client: hyper-util's `legacy::Client` over rustls (the system's roots and
//! `--upstream-ca-cert`), HTTP/1.1, and HTTP/2 where an `https://` upstream offers it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Body;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The client the gateway forwards with.
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, Body>;

/// How long an idle pooled connection to the upstream is kept.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// The client, trusting the system's roots and the PEM certificates of `ca_cert`. A connection
/// attempt gives up after `connect_timeout` (reported as never reached, docs/protocol.md#gateway).
pub fn build(ca_cert: Option<&Path>, connect_timeout: Duration) -> anyhow::Result<UpstreamClient> {
    let roots = roots(ca_cert)?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(TokioTimer::new())
        .build(connector))
}

/// The system's roots (those that load; a bad one is logged and skipped) and `ca_cert`'s.
fn roots(ca_cert: Option<&Path>) -> anyhow::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!(error = %e, "a system root certificate did not load");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    tracing::debug!(added, ignored, "system root certificates");
    if let Some(path) = ca_cert {
        let shown = path.display();
        let pem = std::fs::read(path).with_context(|| format!("--upstream-ca-cert: cannot read {shown}"))?;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--upstream-ca-cert: {shown} is not PEM certificates: {e}"))?;
        anyhow::ensure!(!certs.is_empty(), "--upstream-ca-cert: {shown} holds no certificate");
        for cert in certs {
            roots.add(cert).map_err(|e| anyhow::anyhow!("--upstream-ca-cert: {shown}: {e}"))?;
        }
    }
    Ok(roots)
}
