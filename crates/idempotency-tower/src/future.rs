//! The layer's response future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use axum::body::Body;
use http::Response;
use pin_project_lite::pin_project;
use tracing::Instrument;

use crate::BoxError;

pub(crate) type BoxFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService).
    ///
    /// Requests the layer does not protect poll the inner service's future `F` directly; a
    /// protected request polls the work that claims its key and runs the handler, which moves
    /// to a task of its own and keeps running when this future is dropped.
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        Inner { #[pin] future: F },
        Protected { future: BoxFuture<E> },
        Ready { response: Option<Response<Body>> },
    }
}

impl<F, E> ResponseFuture<F, E> {
    pub(crate) fn inner(future: F) -> Self {
        Self { kind: Kind::Inner { future } }
    }

    pub(crate) fn protected(future: BoxFuture<E>) -> Self {
        Self { kind: Kind::Protected { future } }
    }

    pub(crate) fn ready(response: Response<Body>) -> Self {
        Self { kind: Kind::Ready { response: Some(response) } }
    }
}

impl<F, E> fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Protected { .. } => "protected",
            Kind::Ready { .. } => "ready",
        };
        f.debug_struct("ResponseFuture").field("kind", &kind).finish()
    }
}

impl<F, E, ResBody> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => Poll::Ready(ready!(future.poll(cx)).map(|res| res.map(Body::new))),
            KindProj::Protected { future } => future.as_mut().poll(cx),
            KindProj::Ready { response } => match response.take() {
                Some(res) => Poll::Ready(Ok(res)),
                // Polled again after completion: a caller bug, answered without a panic.
                None => Poll::Pending,
            },
        }
    }
}

/// What a [`Detach`] yields: the future's output, or the panic that ended it.
pub(crate) type Caught<T> = Result<T, Box<dyn std::any::Any + Send>>;

/// Runs a future in place, inside the task that awaits it, and hands whatever is left of it to
/// a task of its own if it is dropped before it finishes.
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
}

impl<T: Send + 'static> Detach<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        use futures::FutureExt;
        Self {
            future: Some(Box::pin(std::panic::AssertUnwindSafe(future).catch_unwind())),
            span: tracing::Span::current(),
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

/// How many requests are running in tasks of their own because their client hung up.
static DETACHED: AtomicUsize = AtomicUsize::new(0);

/// How many handlers are still running detached, in this process: requests whose client hung up
/// after their key was claimed, finishing in the background so their responses are stored, and
/// completions being retried in the background after the store failed to take them. A
/// server that shuts down waits for this to reach zero (bounded by its own timeout) so that a
/// retry after a restart replays instead of finding the key in flight.
pub fn detached_handlers() -> usize {
    DETACHED.load(Ordering::Acquire)
}

/// Counts one detached handler (or completion retry) while it lives.
pub(crate) struct DetachedGuard;

impl DetachedGuard {
    pub(crate) fn new() -> Self {
        DETACHED.fetch_add(1, Ordering::AcqRel);
        Self
    }
}

impl Drop for DetachedGuard {
    fn drop(&mut self) {
        DETACHED.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T: Send + 'static> Drop for Detach<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // Counted from here, before the task exists, so a waiter never misses it.
                let guard = DetachedGuard::new();
                let span = std::mem::replace(&mut self.span, tracing::Span::none());
                runtime.spawn(
                    async move {
                        let _guard = guard;
                        future.await
                    }
                    .instrument(span),
                );
            }
            // Only reachable when the runtime itself is gone, and its tasks with it.
            Err(_) => tracing::error!("a protected request was dropped outside a tokio runtime; it cannot finish"),
        }
    }
}
