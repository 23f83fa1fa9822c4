//! Answering within SPEC 3.1's 5 s when the database stops answering.
//!
//! A database that refuses connections fails every statement at once, and the pool's acquire
//! timeout ([`crate::db::PG_ACQUIRE_TIMEOUT`]) bounds the wait for a new connection. Neither
//! bounds a database that does not answer at all: a network partition that drops packets leaves
//! a pooled connection waiting for TCP's retransmission timeout (many minutes), and a SQLite file
//! locked by another process keeps a writer in its busy timeout while every other request queues
//! for the connection. The idempotency layer bounds its own store calls
//! ([`idempotency_tower::IdempotencyLayerBuilder::store_timeout`]); the service's own statements
//! (the handlers' domain reads and writes, on every route) are bounded here, by one middleware:
//!
//! - a request answered within [`STORE_DEADLINE`] (3 s) is untouched;
//! - a request still running then is given a probe of the database of at most [`PROBE_TIMEOUT`]:
//!   one `SELECT 1` through the service's own pool. When the pool cannot run it in time (every
//!   connection waits on a database that does not answer, or on a locked SQLite file), the request
//!   is answered `503 store-unavailable` with `Retry-After`, at most 4 s after it came;
//! - when the probe succeeds, the request is slow for another reason (a slow hypervisor) and
//!   keeps running, probed again every [`RECHECK`].
//!
//! Dropping the request's future cuts nothing that must finish: a claimed request runs in the
//! idempotency layer's own detachable future, which finishes in a task of its own when dropped
//! (exactly as when a client hangs up), and its record is released as soon as the store answers
//! again if its handler fails meanwhile. What is dropped otherwise is a read, or work before a
//! claim.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotency::ErrorChain;
use idempotency_tower::Problem;

use crate::db::Db;

/// How long a request runs before the database is probed on its behalf.
pub const STORE_DEADLINE: Duration = Duration::from_secs(3);
/// The longest a probe may take: [`STORE_DEADLINE`] plus this is under SPEC 3.1's 5 s, with
/// room for the answer. A pool so busy that a `SELECT 1` waits longer than this for a request
/// that already waited [`STORE_DEADLINE`] is answered `503` too (with `Retry-After`: retry).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a request that is slow for another reason is probed again.
pub const RECHECK: Duration = Duration::from_secs(1);
/// How long a probe's result is reused by other waiting requests.
const PROBE_REUSED_FOR: Duration = Duration::from_secs(1);

/// Probes whether the database answers now, for [`store_deadline`].
///
/// Only the service's own database: the idempotency layer bounds its calls to the record store
/// itself, so a record store that is down (Redis) never holds a request, and a request that is
/// slow for another reason while it is down (a slow hypervisor) keeps running.
#[derive(Clone)]
pub struct StoreProbe {
    db: Db,
    last: Arc<Mutex<Option<(Instant, bool)>>>,
}

impl std::fmt::Debug for StoreProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreProbe").finish_non_exhaustive()
    }
}

impl StoreProbe {
    /// Probes `db`.
    pub fn new(db: Db) -> Self {
        Self { db, last: Arc::default() }
    }

    /// Whether the database (and the record store) answer within [`PROBE_TIMEOUT`]; a result
    /// at most [`PROBE_REUSED_FOR`] old is reused.
    pub async fn answers(&self) -> bool {
        let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, ok)) = last
            && at.elapsed() < PROBE_REUSED_FOR
        {
            return ok;
        }
        let ok = match tokio::time::timeout(PROBE_TIMEOUT, self.probe()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(error = %ErrorChain(&e), "the database does not answer a probe");
                false
            }
            Err(_) => {
                tracing::warn!(timeout = ?PROBE_TIMEOUT, "the database did not answer a probe in time");
                false
            }
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), ok));
        ok
    }

    /// `SELECT 1` through the service's pool: what every handler's statement waits for. A
    /// write-locked SQLite file still reads, so the probe passes unless the pool's connection is
    /// held by a writer waiting on the lock, which is exactly when reads queue behind it.
    async fn probe(&self) -> Result<(), sqlx::Error> {
        match &self.db {
            Db::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
            Db::Sqlite(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
        }
    }
}

/// The middleware: see the module docs.
pub async fn store_deadline(State(probe): State<StoreProbe>, req: Request, next: Next) -> Response {
    let work = next.run(req);
    tokio::pin!(work);
    let mut wait = STORE_DEADLINE;
    loop {
        match tokio::time::timeout(wait, &mut work).await {
            Ok(response) => return response,
            Err(_) if !probe.answers().await => {
                tracing::warn!("a request waited on a store that does not answer; it is answered 503");
                return store_unavailable();
            }
            Err(_) => wait = RECHECK,
        }
    }
}

/// `503 store-unavailable` with `Retry-After`, the one answer of SPEC 3.1.
pub(crate) fn store_unavailable() -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "Store unavailable",
        "the store does not answer; a retry with the same key replays or resumes the request",
    )
    .with_retry_after(1)
    .into_response()
}
