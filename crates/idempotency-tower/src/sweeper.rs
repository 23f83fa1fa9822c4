//! The sweeper of the layer's store, counting what it deletes in
//! [`RECORDS_SWEPT_TOTAL`](crate::RECORDS_SWEPT_TOTAL) (with the `metrics` feature).

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Store, Sweeper};
use tokio::task::JoinHandle;

/// A core [`Sweeper`] over `store`, every `interval`, that adds what it deletes to
/// `idempotency_records_swept_total` (with the `metrics` feature) and logs it. Adjust it
/// (`.batch(n)`) and `.spawn()` it; calling `.on_swept` again replaces the metric hook.
pub fn sweeper(store: Arc<dyn Store>, interval: Duration) -> Sweeper {
    Sweeper::new(store, interval).on_swept(|n| {
        #[cfg(feature = "metrics")]
        metrics::counter!(crate::metrics::RECORDS_SWEPT_TOTAL).increment(n);
        tracing::debug!(swept = n, "expired idempotency records deleted");
    })
}

/// Spawns [`sweeper`] on the current tokio runtime. Abort the handle to stop it.
pub fn spawn_sweeper(store: Arc<dyn Store>, interval: Duration) -> JoinHandle<()> {
    sweeper(store, interval).spawn()
}
