//! Request limits applied before anything else looks at a request (docs/protocol.md#leasebroker-api, "Bounded per
//! tenant", "Connections"): the length of the path, and the time the whole body may take.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use idempotency_tower::Problem;
use leasebroker_api::problems;
use tokio::time::{Instant, Sleep};

/// The longest request path accepted, in bytes (`414` beyond). A record's scope holds the path,
/// so this also bounds what one record costs and keeps the store's key under PostgreSQL's
/// index-row limit.
pub const MAX_PATH: usize = 2048;

/// `414 uri-too-long` for a path over [`MAX_PATH`] bytes, before authentication, rate limits or
/// the idempotency layer: nothing is read, counted or stored.
pub async fn path_length(req: Request, next: Next) -> Response {
    if req.uri().path().len() > MAX_PATH {
        return Problem::new(
            StatusCode::URI_TOO_LONG,
            problems::URI_TOO_LONG,
            "Path too long",
            format!("the request path exceeds {MAX_PATH} bytes; nothing was processed"),
        )
        .into_response();
    }
    next.run(req).await
}

/// A request body that fails once its deadline has passed, however slowly it drips: the server
/// wraps every request's body in one (`--body-timeout` from when its headers arrived). Reading it
/// then fails with an [`io::ErrorKind::TimedOut`] error, which the idempotency layer answers
/// `408 body-timeout` before any key is claimed, so nothing is stored.
#[derive(Debug)]
pub struct DeadlineBody {
    inner: Body,
    sleep: Pin<Box<Sleep>>,
}

impl DeadlineBody {
    /// `inner`, cut at `deadline`.
    pub fn new(inner: Body, deadline: Instant) -> Self {
        Self { inner, sleep: Box::pin(tokio::time::sleep_until(deadline)) }
    }
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(io::Error::new(
                io::ErrorKind::TimedOut,
                "the request body did not arrive within --body-timeout",
            ))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
