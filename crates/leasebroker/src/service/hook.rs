//! Named points in a handler where an attempt can be held: what a test needs to interleave two
//! attempts of one record exactly (an attempt that stalls after its reads, as a frozen VM or a
//! database stall makes it, while a retry finishes the operation). A service built by
//! `leasebroker serve` has no hook: [`Hook::default`] does nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// A point in a handler where an attempt may be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A create is about to decide, in its first transaction, whether it starts at all (its
    /// worker exists or was deleted: it finished) and what an earlier attempt holds. (Before
    /// issue 24 the worker and tombstone were read before this point, outside that
    /// transaction.)
    CreateDecide,
    /// A create found its boot intent pending (an earlier attempt's call may have landed) and is
    /// about to reconcile it by tag.
    CreateAdopt,
    /// A reboot read its worker and is about to record its attempt.
    RebootDecide,
    /// A Redfish flash did every read, recorded its intent with its send stamp, and is about to
    /// send its `SimpleUpdate`.
    FlashSend,
}

type HookFn = dyn Fn(Step) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// What runs at each [`Step`]: nothing by default.
#[derive(Clone, Default)]
pub struct Hook(Option<Arc<HookFn>>);

impl Hook {
    /// A hook that awaits `f(step)` at every step.
    pub fn new<F, Fut>(f: F) -> Self
    where
        F: Fn(Step) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Self(Some(Arc::new(move |step| Box::pin(f(step)))))
    }

    /// Runs the hook at `step`, if there is one.
    pub(crate) async fn at(&self, step: Step) {
        if let Some(f) = &self.0 {
            f(step).await;
        }
    }
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Hook(set)" } else { "Hook(none)" })
    }
}
