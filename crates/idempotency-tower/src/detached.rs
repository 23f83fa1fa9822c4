//! Work that outlives its request: [`Detach`], which moves a protected request to a task of its
//! own when its client hangs up, and [`DetachedHandlers`], the layer's set of such tasks, which a
//! server waits for on shutdown.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::Instrument;

/// The work of one [`IdempotencyLayer`](crate::IdempotencyLayer) that runs on after its client
/// stopped waiting for it: handlers whose client hung up after their key was claimed, finishing
/// in tasks of their own so their responses are stored; completions retried in the background
/// after the store failed to take them; and records waiting for the store to answer again to be
/// released. Get it with [`IdempotencyLayer::detached`](crate::IdempotencyLayer::detached);
/// clones share one set, and every service the layer makes adds to it.
///
/// A server that shuts down, once it has stopped accepting requests and its connections have
/// finished, [`close`](Self::close)s the set and [`wait`](Self::wait)s for it, bounded by its own
/// timeout: a retry after the restart then replays the stored response instead of finding the
/// key in flight until the in-flight TTL. Work still running at the timeout is cut, and its key
/// is taken over once its claim goes stale.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idempotency_tower::{IdempotencyLayer, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()));
/// let detached = layer.detached();
/// // ... serve a router with `layer` until a shutdown signal, and let its connections finish ...
/// detached.close();
/// if tokio::time::timeout(Duration::from_secs(30), detached.wait()).await.is_err() {
///     tracing::warn!(unfinished = detached.len(), "exiting with detached handlers unfinished");
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct DetachedHandlers {
    tracker: TaskTracker,
}

impl DetachedHandlers {
    pub(crate) fn new() -> Self {
        Self { tracker: TaskTracker::new() }
    }

    /// How many are running now: a gauge for a log line or a metric.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    /// Whether none is running now.
    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Lets [`wait`](Self::wait) finish once none is running; until then it never does. Closing
    /// stops nothing: work detached after it is still run, counted and waited for.
    pub fn close(&self) {
        self.tracker.close();
    }

    /// Finishes once the set is [closed](Self::close) and none is running. Bound it with the
    /// server's shutdown timeout: a handler may run for as long as its own work takes.
    pub async fn wait(&self) {
        self.tracker.wait().await;
    }

    /// Spawns `task` on the current runtime, counted until it ends.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task);
    }

    /// Counts one more piece of detached work while the token lives.
    pub(crate) fn token(&self) -> TaskTrackerToken {
        self.tracker.token()
    }
}

/// What a [`Detach`] yields: the future's output, or the panic that ended it.
pub(crate) type Caught<T> = Result<T, Box<dyn std::any::Any + Send>>;

/// Runs a future in place, inside the task that awaits it, and hands whatever is left of it to
/// a task of its own, counted in the layer's [`DetachedHandlers`], if it is dropped before it
/// finishes.
///
/// This is how the claimed part of a request survives a client that hangs up: hyper drops the
/// response future, and the handler carries on in the background to store its response. While
/// the client waits, nothing is spawned: a task per request would cost a wake-up of another
/// worker thread and a task allocation on every request for the rare case of a disconnect.
///
/// A panic inside is caught and yielded as `Err`, so a panicked future is never polled again,
/// in place or detached.
///
/// In place, the future runs inside whatever span its caller is in; detached, it runs in the
/// span that was current when it was made. (Instrumenting it up front would enter and leave
/// that span once more on every poll of every request, for the rare one that detaches.)
pub(crate) struct Detach<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = Caught<T>> + Send>>>,
    span: tracing::Span,
    detached: DetachedHandlers,
}

impl<T: Send + 'static> Detach<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static, detached: &DetachedHandlers) -> Self {
        use futures::FutureExt;
        Self {
            future: Some(Box::pin(std::panic::AssertUnwindSafe(future).catch_unwind())),
            span: tracing::Span::current(),
            detached: detached.clone(),
        }
    }
}

impl<T: Send + 'static> Future for Detach<T> {
    type Output = Caught<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Polled again after completion: a caller bug, answered without a panic.
        let Some(future) = self.future.as_mut() else { return Poll::Pending };
        let out = ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detach<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let span = std::mem::replace(&mut self.span, tracing::Span::none());
                // Counted from here, before the task runs, so a waiter never misses it.
                self.detached.tracker.spawn_on(future.instrument(span), &runtime);
            }
            // Only reachable when the runtime itself is gone, and its tasks with it.
            Err(_) => tracing::error!("a protected request was dropped outside a tokio runtime; it cannot finish"),
        }
    }
}
