//! The `leasebroker` binary: parse the command line, then serve, run the hypervisor simulator,
//! or migrate the database.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use leasebroker::app::{Application, shutdown_signal};
use leasebroker::config::{Cli, Command, LogFormat};
use leasebroker::db::Db;
use leasebroker::hypervisor::sim::{self, SimConfig, Simulator};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        LogFormat::Json => logs.json().init(),
    }
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasebroker: {e:#}");
            std::process::ExitCode::FAILURE
        }
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
            .with_flash_failure(args.flash_fail);
            sim::serve(listener, sim, shutdown_signal()).await.context("simulator")
        }
        Command::Migrate(args) => {
            let db = Db::connect(&args.database).await?;
            db.migrate().await?;
            println!("migrated {}", leasebroker::db::redact(&args.database));
            Ok(())
        }
    }
}
