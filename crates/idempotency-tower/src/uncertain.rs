//! The `uncertain` outcome (opt-in): a request that was sent on (by a gateway, to a service that
//! acts) and whose outcome nobody knows. The layer never runs such a request again on a guess.
//!
//! - A handler says it does not know its outcome by putting [`OutcomeUncertain`] in its
//!   response's extensions: the layer marks the record uncertain
//!   ([`Store::mark_uncertain`](idempotency::Store::mark_uncertain)) instead of storing or
//!   failing it, and the client gets `504` problem `outcome-uncertain`.
//! - [`StaleClaims`] says what a claim gone stale (its attempt died) becomes: taken over and run
//!   again (the default, for handlers that resume through their sub-keys), or uncertain.
//! - [`OnUncertain`] says what a retry of an uncertain record gets: `409 outcome-uncertain`
//!   (hold, the default), the request run again (resend), or a [`Probe`]'s answer.
//!
//! Without any of these the layer behaves as it always did: no record becomes uncertain.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use idempotency::Record;

/// A response extension by which a handler says it does not know whether its request acted (it
/// was sent on and its answer was lost: a timeout after the request was written, a reset). The
/// layer marks the record uncertain instead of storing the response or failing the record, and
/// answers `504` problem `outcome-uncertain` in its place; a retry with the key then gets what
/// [`OnUncertain`] says, never a second run on a guess.
///
/// ```
/// use axum::response::{IntoResponse, Response};
/// use idempotency_tower::OutcomeUncertain;
///
/// fn lost_answer() -> Response {
///     let mut res = http::StatusCode::GATEWAY_TIMEOUT.into_response();
///     res.extensions_mut().insert(OutcomeUncertain);
///     res
/// }
/// # assert!(lost_answer().extensions().get::<OutcomeUncertain>().is_some());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutcomeUncertain;

/// What becomes of a claim gone stale (its attempt stopped renewing it: the process died, or hung
/// past the in-flight TTL) when a retry finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum StaleClaims {
    /// The retry takes the claim over and runs the handler again (the default): right for a
    /// handler that resumes through its sub-keys, whose side effects deduplicate.
    #[default]
    Reclaim,
    /// The record becomes uncertain ([`Store::mark_stale_uncertain`](idempotency::Store::mark_stale_uncertain)):
    /// the dead attempt may have sent its request on, so nothing runs it again on a guess, and
    /// the retry gets what [`OnUncertain`] says. A gateway's rule.
    Uncertain,
}

/// What a retry of an uncertain record gets. A layer setting
/// ([`on_uncertain`](crate::IdempotencyLayerBuilder::on_uncertain)); a request's own choice, put
/// in its extensions by a middleware before the layer, wins over it.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum OnUncertain {
    /// `409` problem `outcome-uncertain`, its `detail` naming the record id, until an operator
    /// resolves the record (forgets it, or stores what happened). The default.
    #[default]
    Hold,
    /// The record is taken over ([`Store::take_over_uncertain`](idempotency::Store::take_over_uncertain))
    /// and the handler runs again: for a target that deduplicates by the key it is sent.
    Resend,
    /// The probe is asked what happened; see [`Probed`].
    Probe(Arc<dyn Probe>),
}

impl OnUncertain {
    /// A probe rule.
    pub fn probe(probe: impl Probe) -> Self {
        Self::Probe(Arc::new(probe))
    }
}

impl fmt::Debug for OnUncertain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Hold => f.write_str("Hold"),
            Self::Resend => f.write_str("Resend"),
            Self::Probe(_) => f.write_str("Probe(..)"),
        }
    }
}

/// Finds out what became of an uncertain record's request (asks its target, for instance by the
/// key it was sent with: [`Record::derive`](idempotency::Record::derive)).
pub trait Probe: Send + Sync + 'static {
    /// What happened to `record`'s request.
    fn probe<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Probed>;
}

/// What a [`Probe`] found.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Probed {
    /// It happened, and this is its response: the record is resolved with it
    /// ([`Store::resolve`](idempotency::Store::resolve), its replayable headers as the layer
    /// stores any response's) and it is replayed, to this retry and every later one.
    Happened(http::Response<Bytes>),
    /// It never happened: the record is taken over and the handler runs again.
    NeverHappened,
    /// The probe cannot tell (its target did not answer): `503` problem `outcome-uncertain` with
    /// `Retry-After`; the next retry asks again.
    Unknown,
}
