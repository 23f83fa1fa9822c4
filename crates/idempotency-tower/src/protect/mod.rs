//! The protected request path (docs/protocol.md#records): claim, decide, run as owner, store or replay.
//!
//! - [`claim`]: claims the key (or reads its record) and decides: run the handler as owner,
//!   replay, wait for the record in flight, or refuse;
//! - [`owner`]: runs the handler as the owner of the claim and turns what it produced into the
//!   response and the record's outcome;
//! - [`finish`]: records that outcome in the store (complete or fail), retried in the background
//!   when the store does not take it;
//! - [`heartbeat`]: renews the claim while the handler (or a retried completion) runs;
//! - [`uncertain`]: what a retry of an uncertain record gets (hold, resend, probe).

mod claim;
mod finish;
mod heartbeat;
mod owner;
mod uncertain;

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use idempotency::{ErrorChain, Fingerprint, Scope, StoreError};
use tower::Service;

use crate::config::Config;
use crate::problem::{Rejection, rejection_response};

pub(crate) use claim::run;

/// The inner service of a protected request, as [`run`] needs it: its future and error may move
/// to a task of their own (the request runs to its end when its client goes away).
pub(crate) trait Handler<ResBody>:
    Service<Request<Body>, Response = Response<ResBody>, Future: Send + 'static, Error: Send + 'static> + Send + 'static
{
}

impl<S, ResBody> Handler<ResBody> for S
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// A request the layer protects, its body read and its key scoped and fingerprinted: what [`run`]
/// takes.
pub(crate) struct Protected<S> {
    pub(crate) cfg: Arc<Config>,
    pub(crate) inner: S,
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) scope: Scope,
    pub(crate) fingerprint: Fingerprint,
}

/// The answer when a store call before the handler failed: `503 store-unavailable`.
fn store_down(cfg: &Config, op: &'static str, e: StoreError) -> Response<Body> {
    tracing::error!(error = %ErrorChain(&e), op, "idempotency store call failed; the handler did not run");
    rejection_response(cfg, Rejection::StoreUnavailable(e))
}
