#![doc = include_str!("../README.md")]

pub mod api;
mod binaries;
pub mod gateway;
pub mod leasebroker;
pub mod ports;
mod process;
pub mod tokens;

pub use binaries::{Binary, FAULTLINE, GATEWAY, IDEMCHECK, LBCTL, LEASEBROKER, example, target_dir};
pub use leasebroker::{serve, sim, sqlite_url, start};
pub use ports::{HeldPort, closed_port, closed_url, free_port, free_port_with, free_ports};
pub use process::{Launch, Proc, TEST_LOG};
pub use tempfile::{TempDir, tempdir};

/// PostgreSQL for tests: a database of one's own on `TEST_POSTGRES_URL`
/// ([`TestDatabase`](postgres::TestDatabase)), a private server ([`LocalServer`](postgres::LocalServer)), and a
/// highly available cluster behind HAProxy ([`ha`](postgres::ha)); `idempotency_sqlx::testing`.
pub mod postgres {
    pub use idempotency_sqlx::testing::*;
}

/// Redis for tests: one `redis-server` ([`start_server`](redis::start_server)) or a cluster
/// ([`Cluster`](redis::Cluster)), each on free ports; `idempotency_redis::testing`.
pub mod redis {
    pub use idempotency_redis::testing::*;
}
