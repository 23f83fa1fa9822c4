//! leasebroker: hands out worker nodes from a pool, safe to retry with `Idempotency-Key`.
//!
//! The reference service of the idempotency layer. Every worker's side effects (the node
//! allocation, the lease, the VM boot) are keyed off sub-keys derived from the request's
//! idempotency record, so a retry after a partial failure resumes and never allocates, leases
//! or boots twice. See [`service`] for the resumable handlers.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use clap::Parser;
//! use leasebroker::{app::Application, config::{Cli, Command}};
//!
//! let Command::Serve(args) = Cli::parse_from(["leasebroker", "serve", "--listen", "127.0.0.1:0"]).command
//! else { unreachable!() };
//! let app = Application::build(*args).await?;
//! println!("listening on port {}", app.port());
//! app.run_until_stopped(leasebroker::app::shutdown_signal()).await
//! # }
//! ```

pub mod activity;
pub mod api;
pub mod app;
pub mod audit;
pub mod background;
pub mod config;
pub mod console;
pub mod db;
pub mod domain;
pub mod firmware;
pub mod head;
pub mod hypervisor;
pub mod keyed;
pub mod limits;
pub mod metric;
pub mod openapi;
pub mod outage;
pub mod places;
pub mod reaper;
pub mod routes;
pub mod serve;
pub mod service;
pub mod telemetry;
