//! Error answers: RFC 9457-style problems, and the dropped connection of the `fail_after` fault.

use std::io;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

pub(super) async fn not_found() -> Response {
    problem(StatusCode::NOT_FOUND, "not-found", "no such route")
}

pub(super) async fn method_not_allowed() -> Response {
    problem(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", "method not allowed on this route")
}

/// A response that never reaches the client: its body fails on the first poll, before hyper has
/// flushed the buffered status line, so hyper closes the connection with nothing sent and the
/// client sees the connection end mid-request, not a status.
pub(super) fn dropped_connection() -> Response {
    let stream = futures::stream::once(async {
        Err::<Bytes, io::Error>(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "simulated fault: connection dropped after the work was done",
        ))
    });
    Response::new(Body::from_stream(stream))
}

pub(super) fn json_rejection(rejection: JsonRejection) -> Response {
    let name = match rejection.status() {
        StatusCode::UNPROCESSABLE_ENTITY => "invalid-request",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported-media-type",
        _ => "invalid-json",
    };
    problem(rejection.status(), name, &rejection.body_text())
}

pub(super) fn vm_not_found(vm_id: &str) -> Response {
    problem(StatusCode::NOT_FOUND, "vm-not-found", &format!("no VM {vm_id:?}"))
}

/// An RFC 9457 error body: the service's own problem type, titled by the status.
pub(super) fn problem(status: StatusCode, name: &str, detail: &str) -> Response {
    idempotency_tower::Problem::new(status, name, status.canonical_reason().unwrap_or("error"), detail).into_response()
}
