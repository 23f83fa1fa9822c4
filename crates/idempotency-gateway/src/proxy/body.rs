//! Reading the upstream's answer to a protected request before the layer sees it.

use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tower_http::timeout::TimeoutBody;

/// Reads `body` up to `limit` bytes, each part within `timeout` of the one before: an answer
/// that breaks off or stalls there is an error, known before anything is stored. An answer of
/// at most `limit` bytes is returned whole; a longer one as what was read followed by the rest,
/// streamed (still cut when a part takes longer than `timeout`).
pub(super) async fn read_bounded(body: Incoming, limit: usize, timeout: Duration) -> Result<Body, axum::BoxError> {
    // Boxed: `TimeoutBody` holds a timer and is not `Unpin`.
    let mut body = Box::pin(TimeoutBody::new(timeout, body));
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        // Trailers are not forwarded on a protected request.
        let Ok(data) = frame?.into_data() else { continue };
        if read.len() + data.len() > limit {
            read.extend_from_slice(&data);
            let first = futures::stream::once(async move { Ok::<Bytes, axum::BoxError>(read.freeze()) });
            let rest = body.into_data_stream();
            return Ok(Body::from_stream(first.chain(rest)));
        }
        read.extend_from_slice(&data);
    }
    Ok(Body::from(read.freeze()))
}
