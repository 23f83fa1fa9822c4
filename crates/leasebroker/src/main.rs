//! The `leasebroker` binary: parse the command line, then serve, run the hypervisor simulator,
//! or migrate the database.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use leasebroker::app::{Application, shutdown_signal};
use leasebroker::config::{BmcApi, Cli, Command, ConfigError, LogFormat};
use leasebroker::db::Db;
use leasebroker::hypervisor::sim::{self, RedfishOptions, SimConfig, Simulator};
use leasebroker::telemetry;
use tracing_subscriber::{EnvFilter, Layer, Registry};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Traces (serve --otlp-endpoint): made before the subscriber, inside the runtime.
    let provider = match &cli.command {
        Command::Serve(args) => args.otlp_endpoint.as_deref().map(|e| telemetry::provider(e, args.otlp_protocol)),
        _ => None,
    };
    let provider = match provider.transpose() {
        Ok(p) => p,
        Err(e) => return refused(&e),
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs: Box<dyn Layer<Registry> + Send + Sync> = match cli.log_format {
        LogFormat::Text => {
            logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).with_filter(filter).boxed()
        }
        LogFormat::Json => logs.json().with_filter(filter).boxed(),
    };
    match telemetry::traced(logs, provider, run(cli)).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => refused(&e),
    }
}

/// Says why the command failed, in one line, and picks the exit status: 2 for a configuration
/// whose settings contradict each other ([`ConfigError`], like clap's usage errors), 1 otherwise
/// (a database, a file or a port that could not be used).
fn refused(e: &anyhow::Error) -> std::process::ExitCode {
    eprintln!("leasebroker: {e:#}");
    if e.chain().any(|cause| cause.is::<ConfigError>()) {
        std::process::ExitCode::from(2)
    } else {
        std::process::ExitCode::FAILURE
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let app = Application::build(*args).await?;
            if let Some(token) = &app.generated_token {
                println!("no --token configured; generated one for principal \"default\":");
                println!("  token: {token}");
            }
            println!("leasebroker listening on http://{}", app.local_addr());
            app.run_until_stopped(shutdown_signal()).await
        }
        Command::HypervisorSim(args) => {
            let listener = tokio::net::TcpListener::bind(args.listen)
                .await
                .with_context(|| format!("cannot listen on {}", args.listen))?;
            println!("hypervisor simulator listening on http://{}", listener.local_addr()?);
            let sim = Simulator::new(SimConfig {
                fail_before: args.fail_before,
                fail_after: args.fail_after,
                latency: Duration::from_millis(args.latency_ms),
                slow: args.slow,
                slow_latency: Duration::from_millis(args.slow_ms),
                refuse: args.refuse,
            })
            .with_flash_time(Duration::from_millis(args.flash_ms))
            .with_flash_failure(args.flash_fail)
            .with_missing_images(args.missing_image.clone());
            let sim = match args.bmc {
                BmcApi::Native => sim,
                BmcApi::Redfish => sim.with_redfish(RedfishOptions {
                    systems: args.redfish_systems,
                    one_machine: args.redfish_one_machine,
                    keep_payload: !args.redfish_no_payload,
                    terse: args.redfish_terse,
                    list_tasks: !args.redfish_no_task_list,
                    inventory: !args.redfish_no_inventory,
                }),
            };
            sim::serve(listener, sim, shutdown_signal()).await.context("simulator")
        }
        Command::Migrate(args) => {
            let db = Db::connect_with(&args.database, leasebroker::db::DEFAULT_SQLITE_CONNECTIONS).await?;
            db.migrate().await?;
            println!("migrated {}", args.database);
            Ok(())
        }
    }
}
