//! The protected request path (SPEC 1.3): claim, decide, run as owner, store or replay.
//!
//! - [`claim`]: claims the key (or reads its record) and decides: run the handler as owner,
//!   replay, wait for the record in flight, or refuse;
//! - [`owner`]: runs the handler as the owner of the claim and turns what it produced into the
//!   response and the record's outcome;
//! - [`finish`]: records that outcome in the store (complete or fail), retried in the background
//!   when the store does not take it;
//! - [`heartbeat`]: renews the claim while the handler (or a retried completion) runs.

mod claim;
mod finish;
mod heartbeat;
mod owner;

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use idempotency::{Fingerprint, Scope};

use crate::config::Config;

pub(crate) use claim::run;

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
