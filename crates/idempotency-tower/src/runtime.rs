//! [`Runtime`]: what the layer keeps while it runs, apart from its settings
//! ([`Config`](crate::config::Config)), shared by every service it makes.

use std::sync::Arc;

use crate::deadline::StoreDeadline;
use crate::detached::DetachedHandlers;
use crate::quota::RecordLimit;
use crate::release::Releases;
use crate::waiters::Waiters;

/// The layer's state: built once with the layer, never configured.
pub(crate) struct Runtime {
    /// The bound on every store call: the store timeouts and the writes the store took.
    pub(crate) deadline: Arc<StoreDeadline>,
    /// Requests of this process waiting for a record in flight.
    pub(crate) waiters: Arc<Waiters>,
    /// Claims whose `fail` waits for the store to answer again.
    pub(crate) releases: Releases,
    /// The layer's work that runs on after its client stopped waiting for it, for a shutdown to
    /// wait for.
    pub(crate) detached: DetachedHandlers,
    /// Each principal's records, counted, when their number is limited.
    pub(crate) record_limit: Option<RecordLimit>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("deadline", &self.deadline)
            .field("detached", &self.detached.len())
            .field("record_limit", &self.record_limit.is_some())
            .finish_non_exhaustive()
    }
}
