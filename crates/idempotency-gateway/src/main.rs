//! The `idempotency-gateway` binary: parse the configuration, build the gateway, serve it until
//! SIGTERM or Ctrl-C.

use clap::Parser;
use idempotency_gateway::config::one_line;
use idempotency_gateway::{Args, Config, ConfigError, Gateway};
use tracing_subscriber::EnvFilter;

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
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter).init();
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idempotency-gateway: {e:#}");
            let config = e.chain().any(|cause| cause.is::<ConfigError>());
            std::process::ExitCode::from(if config { 2 } else { 1 })
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let config = Config::resolve(args)?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    idempotency_tower::describe_metrics();
    let gateway = Gateway::build(config, metrics).await?;
    // The admin line first: a test (or a supervisor) that reads the first `listening on` line
    // has both addresses by then.
    println!("admin on http://{}", gateway.admin_addr());
    println!("idempotency-gateway listening on http://{}", gateway.local_addr());
    gateway.run_until_stopped(leasebroker::app::shutdown_signal()).await
}
