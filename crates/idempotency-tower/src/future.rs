//! The layer's response future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use http::Response;
use pin_project_lite::pin_project;

use crate::BoxError;

pub(crate) type BoxFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

pin_project! {
    /// The response future of [`IdempotencyService`](crate::IdempotencyService).
    ///
    /// Requests the layer does not protect poll the inner service's future `F` directly; a
    /// protected request polls the work that claims its key and runs the handler, which moves
    /// to a task of its own and keeps running when this future is dropped (counted in the
    /// layer's [`DetachedHandlers`](crate::DetachedHandlers)).
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
