//! A bound on every store call the layer makes (SPEC 3.1: with the store unreachable, a request
//! is answered `503 store-unavailable` within 5 s, whatever way the store fails).
//!
//! A store that refuses connections fails fast on its own; one whose packets are dropped (a
//! network partition, a host that froze) or whose file is locked does not: the call waits for
//! TCP's retransmission timeout (many minutes) or a busy timeout. So each call is given
//! [`store_timeout`](crate::IdempotencyLayerBuilder::store_timeout) and fails as unavailable
//! after it. What a call that timed out may still have done is handled where it is made: a
//! claim may land after its caller gave up on it, and is then released
//! ([`crate::release::Releases::push_unknown`]); a completion is retried; a `fail` is tried again
//! until the store takes it.

use std::fmt;
use std::time::Duration;

use idempotency::StoreError;

use crate::config::Config;
use crate::metrics::timed;

/// A store call that did not answer within the layer's store timeout.
#[derive(Debug)]
pub(crate) struct StoreTimedOut {
    op: &'static str,
    after: Duration,
}

impl fmt::Display for StoreTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the store did not answer `{}` within {:?}", self.op, self.after)
    }
}

impl std::error::Error for StoreTimedOut {}

/// Runs one store call (timed as `op`), failing it as unavailable after the store timeout.
pub(crate) async fn bounded<T>(
    cfg: &Config,
    op: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(cfg.store_timeout, timed(op, call)).await {
        Ok(out) => out,
        Err(_) => Err(StoreError::unavailable(StoreTimedOut { op, after: cfg.store_timeout })),
    }
}

/// Whether `e` is a call [`bounded`] gave up on: what it asked may still happen in the store.
pub(crate) fn timed_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(source) if source.is::<StoreTimedOut>())
}
