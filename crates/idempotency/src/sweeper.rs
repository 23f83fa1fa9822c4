//! The background sweeper: deletes expired records in bounded batches.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::{ErrorChain, Store, StoreError, now};

/// Deletes expired records, `batch` at a time, every `interval`.
///
/// Each pass deletes batches until one comes back short, so a backlog drains without one huge
/// statement holding locks; between batches it pauses (default 10 ms), so that draining a large
/// backlog does not crowd out the claims that share the database and the connection pool.
///
/// ```no_run
/// # async fn demo() {
/// use std::{sync::Arc, time::Duration};
/// use idempotency::{MemoryStore, Sweeper};
///
/// let store = Arc::new(MemoryStore::new());
/// let handle = Sweeper::new(store, Duration::from_secs(60))
///     .on_swept(|n| tracing::info!(swept = n, "expired idempotency records deleted"))
///     .spawn();
/// # handle.abort();
/// # }
/// ```
pub struct Sweeper {
    store: Arc<dyn Store>,
    interval: Duration,
    batch: u32,
    pause: Duration,
    on_swept: Box<dyn Fn(u64) + Send + Sync>,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper")
            .field("interval", &self.interval)
            .field("batch", &self.batch)
            .field("pause", &self.pause)
            .finish()
    }
}

/// The default number of records deleted per statement.
pub const DEFAULT_SWEEP_BATCH: u32 = 1000;

/// The default pause between two batches of one pass.
pub const DEFAULT_SWEEP_PAUSE: Duration = Duration::from_millis(10);

impl Sweeper {
    /// A sweeper over `store` that runs every `interval`.
    pub fn new(store: Arc<dyn Store>, interval: Duration) -> Self {
        Self { store, interval, batch: DEFAULT_SWEEP_BATCH, pause: DEFAULT_SWEEP_PAUSE, on_swept: Box::new(|_| {}) }
    }

    /// Sets the batch size (at least 1).
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Sets the pause between two batches of one pass (zero: only yield).
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Calls `f` with the count after every pass that deleted something.
    pub fn on_swept(mut self, f: impl Fn(u64) + Send + Sync + 'static) -> Self {
        self.on_swept = Box::new(f);
        self
    }

    /// Runs one pass now: deletes batches until one comes back short. Returns the total.
    pub async fn run_once(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let n = self.store.sweep_expired(now(), self.batch).await?;
            total += n;
            if n < u64::from(self.batch) {
                break;
            }
            if self.pause.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.pause).await;
            }
        }
        if total > 0 {
            (self.on_swept)(total);
        }
        Ok(total)
    }

    /// Spawns the sweeper on the current tokio runtime. Abort the handle to stop it.
    pub fn spawn(self) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = self.run_once().await {
                    tracing::warn!(
                        error = %ErrorChain(&e),
                        "idempotency sweeper pass failed; retrying next interval"
                    );
                }
            }
        })
    }
}
