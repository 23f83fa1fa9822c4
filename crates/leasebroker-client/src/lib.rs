//! A leasebroker client that keeps one `Idempotency-Key` per logical operation across retries
//! and restarts.
//!
//! Three parts:
//! - [`Client`]: the typed API of SPEC 3.2 (workers and the admin fleet view), reporting whether
//!   a success was a replay of an earlier attempt ([`Response::replayed`]); `https` is verified
//!   with rustls against the system's roots, and [`ClientBuilder::ca_certificates_pem`] adds a
//!   private CA;
//! - [`retry`]: the retry core, usable for any HTTP request made idempotent by a key: the key is
//!   made once per logical operation and sent on every attempt, with backoff and full jitter;
//! - [`journal`]: a durable SQLite journal of op id -> key, so a process killed mid-request reruns
//!   with the same key and gets the original result instead of a second worker.
//!
//! ```no_run
//! use leasebroker_client::{Client, CreateWorker, OpKey};
//! # async fn demo() -> Result<(), leasebroker_client::Error> {
//! let client = Client::new("http://127.0.0.1:8080", "secret-token")?;
//! let key = OpKey::new_v4(); // once per logical operation, before the first attempt
//! let created = client.create_worker(&CreateWorker::new("worker-base:2025.11", 16, 64), &key).await?;
//! println!("{} (replayed: {}, attempts: {})", created.value.id, created.replayed, created.attempts);
//! # Ok(()) }
//! ```

mod client;
mod error;
pub mod journal;
pub mod retry;
mod types;

pub use client::{Client, ClientBuilder, Mutation, Response};
pub use error::{Error, IN_PROGRESS, KEY_REUSED, Problem, retry_after};
pub use retry::{OpKey, RetryPolicy};
pub use types::{CreateWorker, Fleet, InvalidWorkerId, RebootResult, Worker, WorkerId, WorkerPage, WorkerState};
