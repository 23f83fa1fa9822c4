//! What a protected handler learns about its request.

use std::sync::Arc;

use idempotency::{Claim, Endpoint, IdempotencyKey, Principal, SubKey};

/// The idempotency record a protected request runs under, in the request's extensions while
/// the handler owns it. It is an axum extractor: take `ctx: IdempotencyContext` in a handler
/// behind the layer (a request the layer did not protect is rejected with
/// [`MissingContext`], a `500` problem), or `Option<IdempotencyContext>` on a route that also
/// serves unprotected requests (reads, `Off` routes, `Optional` routes without a key).
///
/// Key each side effect off [`derive`](Self::derive): the sub-key is the same on every retry of
/// the record, so a retry after a partial failure finds what the first attempt did.
///
/// ```
/// use idempotency_tower::IdempotencyContext;
///
/// async fn create_worker(ctx: IdempotencyContext) -> String {
///     let allocation_id = ctx.derive("alloc");
///     format!("allocating under {allocation_id} for {}", ctx.principal())
/// }
/// # let _ = axum::Router::<()>::new().route("/v1/workers", axum::routing::post(create_worker));
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    claim: Arc<Claim>,
}

tokio::task_local! {
    /// The context of the protected request whose handler this task runs.
    static CURRENT: IdempotencyContext;
}

impl IdempotencyContext {
    pub(crate) fn new(claim: Claim) -> Self {
        Self { claim: Arc::new(claim) }
    }

    /// The context of the protected request whose handler is running on this task, if any: the
    /// layer sets it around the handler, so code the handler calls (a client middleware, see
    /// [`PropagateIdempotencyKey`](crate::PropagateIdempotencyKey)) finds it without having it
    /// passed down. A task the handler spawns does not inherit it: pass the context (or a
    /// derived sub-key) to such a task explicitly.
    pub fn current() -> Option<Self> {
        CURRENT.try_with(Clone::clone).ok()
    }

    /// Runs `work` with this context as [`current`](Self::current).
    pub(crate) fn scope<F: Future>(self, work: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, work)
    }

    pub(crate) fn claim_arc(&self) -> Arc<Claim> {
        self.claim.clone()
    }

    /// A stable sub-key for the side effect `label` of this record (see [`idempotency::derive`]).
    pub fn derive(&self, label: &str) -> SubKey {
        self.claim.derive(label)
    }

    /// The claim this attempt holds: the record as claimed and its fencing generation.
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// The client's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.claim.scope().key
    }

    /// Who sent the request.
    pub fn principal(&self) -> &Principal {
        &self.claim.scope().principal
    }

    /// Where it was sent.
    pub fn endpoint(&self) -> &Endpoint {
        &self.claim.scope().endpoint
    }

    /// Which attempt this is: 1 for the first, one more for each run after a failure or a stale
    /// claim. A handler may use it to decide to reconcile before acting again.
    pub fn attempt(&self) -> i64 {
        self.claim.generation()
    }
}

/// The rejection of [`IdempotencyContext`] as an extractor: the handler runs on a request the
/// idempotency layer did not protect (the route is not behind it, or its policy let the request
/// through without a record). A server's mistake, so `500` with an RFC 9457 problem, `internal`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MissingContext;

impl std::fmt::Display for MissingContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request runs without an idempotency record: the route is not behind the idempotency layer")
    }
}

impl std::error::Error for MissingContext {}

impl axum::response::IntoResponse for MissingContext {
    fn into_response(self) -> axum::response::Response {
        tracing::error!("{self}");
        crate::Problem::new(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            idempotency::problems::INTERNAL,
            "Internal error",
            "the idempotency layer is missing",
        )
        .into_response()
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for IdempotencyContext {
    type Rejection = MissingContext;

    async fn from_request_parts(parts: &mut http::request::Parts, _: &S) -> Result<Self, MissingContext> {
        parts.extensions.get::<Self>().cloned().ok_or(MissingContext)
    }
}

impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _: &S,
    ) -> Result<Option<Self>, std::convert::Infallible> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}
