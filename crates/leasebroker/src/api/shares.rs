//! Each tenant's share of the process (docs/protocol.md#leasebroker-api, "Bounded per tenant"): how many requests a
//! principal has in progress at once (`--max-concurrent-per-principal`), the process's turns
//! ([`MAX_IN_FLIGHT`]), and the delete that passes the record limit.
//!
//! The order is what makes one tenant unable to stall another: a request is authenticated from
//! its headers alone, then takes one of its principal's places (`429` at once when it has none
//! left), and only then waits for a turn of the process and reads its body. So a principal's
//! slow uploads and `Prefer: wait` retries hold at most its own places and at most that many
//! turns, and another principal's request finds a turn free. `/healthz`, `/readyz`, `/metrics`
//! and `/openapi.json` take neither: they read no body and run no tenant work, and so never wait
//! behind it.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotency::Principal;
use idempotency_tower::{PassesRecordLimit, Problem};
use tokio::sync::Semaphore;

use super::AppState;
use crate::places::Places;

/// Requests handled at once in the whole process, past their principal's places: the
/// idempotency layer buffers up to [`super::BODY_LIMIT`] of body for each, so this bounds what
/// the bodies in memory take in all. More wait for a turn, their bodies unread.
pub const MAX_IN_FLIGHT: usize = 512;

/// `Retry-After` for a principal at its limit of requests in progress: its requests end within
/// moments, or within a body timeout or a wait.
const RETRY_AFTER_SECS: u64 = 1;

/// Who a request's places are counted for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Party {
    /// A tenant, by its token's principal.
    Tenant(Principal),
    /// The admin token's requests (`/admin`).
    Admin,
    /// The operator console, whose login reads a form before anyone is known.
    Console,
}

/// The places each party holds and the process's turns; shared by every request.
#[derive(Debug, Clone)]
pub struct Shares {
    /// Each party's requests in progress, at most `--max-concurrent-per-principal`.
    in_progress: Places<Party>,
    turns: Arc<Semaphore>,
    /// Whether a delete of one's own worker must be told apart (a record limit is set).
    record_limit: bool,
}

impl Shares {
    /// `per_principal` requests in progress per principal (0: no limit); `record_limit`: whether
    /// the idempotency layer limits each principal's records.
    pub fn new(per_principal: u32, record_limit: bool) -> Self {
        let cap = match per_principal {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        Self { in_progress: Places::new(cap), turns: Arc::new(Semaphore::new(MAX_IN_FLIGHT)), record_limit }
    }

    /// Runs `req` in one of `party`'s places and a turn of the process, or answers `429`. The
    /// place is given back when the response's head is made (or the request is dropped).
    async fn run(&self, party: Party, req: Request, next: Next) -> Response {
        let Some(_place) = self.in_progress.enter(party) else { return too_many_at_once() };
        // The semaphore is never closed.
        let _turn = self.turns.acquire().await.ok();
        next.run(req).await
    }
}

fn too_many_at_once() -> Response {
    Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        idempotency::problems::TOO_MANY_REQUESTS,
        "Too many requests",
        "this principal has as many requests in progress as it may; nothing was processed, retry after \
         Retry-After seconds",
    )
    .with_retry_after(RETRY_AFTER_SECS)
    .into_response()
}

/// A `/v1` request, after authentication: in one of its principal's places.
pub(crate) async fn tenant_share(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(principal) = req.extensions().get::<Principal>().cloned() else { return next.run(req).await };
    state.shares.run(Party::Tenant(principal), req, next).await
}

/// An `/admin` request, after authentication: in one of the admin's places.
pub(crate) async fn admin_share(State(state): State<AppState>, req: Request, next: Next) -> Response {
    state.shares.run(Party::Admin, req, next).await
}

/// A console request: in one of the console's places.
pub(crate) async fn console_share(State(state): State<AppState>, req: Request, next: Next) -> Response {
    state.shares.run(Party::Console, req, next).await
}

/// Lets `DELETE /v1/workers/{id}` of a worker the principal holds pass the record limit
/// ([`PassesRecordLimit`]): at its limit a tenant can still give back what it holds. A delete of
/// anything else (another's worker, one already deleted, no worker) is limited as any request.
pub(crate) async fn own_deletes_pass(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if state.shares.record_limit
        && req.method() == Method::DELETE
        && let Some((principal, id)) = worker_named(&req)
        && holds_worker(&state, &principal, &id).await
    {
        req.extensions_mut().insert(PassesRecordLimit);
    }
    next.run(req).await
}

/// The principal of `req` and the worker its path names (`/v1/workers/{id}`), owned: a request
/// is not `Sync`, so no borrow of it may be held across an await.
fn worker_named(req: &Request) -> Option<(Principal, String)> {
    let id = req.uri().path().strip_prefix("/v1/workers/").filter(|id| !id.contains('/'))?;
    Some((req.extensions().get::<Principal>()?.clone(), id.to_owned()))
}

/// Whether `principal` holds the worker `id`.
async fn holds_worker(state: &AppState, principal: &Principal, id: &str) -> bool {
    // Not an id at all: no principal holds it.
    let Ok(id) = id.parse::<leasebroker_api::WorkerId>() else { return false };
    match state.workers.domain.worker(principal, &id).await {
        Ok(found) => found.is_some(),
        // The limit then applies as to any request; the layer's own store calls report an outage.
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether a delete is of the principal's own worker");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_party_has_places_of_its_own() {
        let shares = Shares::new(2, false);
        let alice = || Party::Tenant(Principal::new("alice"));
        let held = (shares.in_progress.enter(alice()), shares.in_progress.enter(alice()));
        assert!(held.0.is_some() && held.1.is_some());
        assert!(shares.in_progress.enter(alice()).is_none(), "a third place beyond the limit");
        for other in [Party::Tenant(Principal::new("bob")), Party::Admin, Party::Console] {
            assert!(shares.in_progress.enter(other.clone()).is_some(), "{other:?} has places of its own");
        }
        let unlimited = Shares::new(0, false);
        let many: Vec<_> = (0..1000).map(|_| unlimited.in_progress.enter(alice()).expect("no limit")).collect();
        assert_eq!(many.len(), 1000);
    }
}
