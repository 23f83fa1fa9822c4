//! The `idempotency-gateway` binary: parse the configuration, build the gateway, serve it until
//! SIGTERM or Ctrl-C.

use clap::Parser;
use idempotency_gateway::config::one_line;
use idempotency_gateway::{Args, Config, ConfigError, Gateway};
use leasebroker::telemetry::{self, OtlpProtocol};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::prelude::*;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            // --help, --version.
            let _ = e.print();
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("idempotency-gateway: {}", one_line(&e));
            return std::process::ExitCode::from(2);
        }
    };
    let config = match Config::resolve(args) {
        Ok(config) => config,
        Err(e) => return refused(&e.into()),
    };
    // Traces (--otlp-endpoint, OTLP/gRPC): made before the subscriber, inside the runtime.
    let provider = match config.otlp_endpoint.as_deref().map(|e| telemetry::provider(e, OtlpProtocol::Grpc)) {
        None => None,
        Some(Ok(provider)) => Some(provider),
        Some(Err(e)) => return refused(&e.context("--otlp-endpoint")),
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter);
    match telemetry::traced(logs, provider, run(config)).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => refused(&e),
    }
}

/// Says why the gateway stopped, in one line: exit 2 for a configuration that cannot run
/// ([`ConfigError`]), 1 otherwise (a store, a file or a port that could not be used).
fn refused(e: &anyhow::Error) -> std::process::ExitCode {
    eprintln!("idempotency-gateway: {e:#}");
    let config = e.chain().any(|cause| cause.is::<ConfigError>());
    std::process::ExitCode::from(if config { 2 } else { 1 })
}

async fn run(config: Config) -> anyhow::Result<()> {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    idempotency_tower::describe_metrics();
    let gateway = Gateway::build(config, metrics).await?;
    // The admin line first: a test (or a supervisor) that reads the first `listening on` line
    // has both addresses by then.
    println!("admin on http://{}", gateway.admin_addr());
    println!("idempotency-gateway listening on http://{}", gateway.local_addr());
    gateway.run_until_stopped(leasebroker::app::shutdown_signal()).await
}
