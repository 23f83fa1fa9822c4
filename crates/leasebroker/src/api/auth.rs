//! Bearer tokens, the admin token, and the per-principal rate limit.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotency::Principal;
use idempotency_tower::Problem;
use leasebroker_api::problems;
use subtle::ConstantTimeEq;

use super::*;

pub(super) fn unauthorized() -> Response {
    unauthorized_because("a valid bearer token is required")
}

/// `401` with `detail`. A token valid only for the other kind of route gets it too (docs/protocol.md#leasebroker-api and
/// 7 name no other status), with a detail that says so instead of calling the token invalid.
fn unauthorized_because(detail: &'static str) -> Response {
    let mut r = Problem::new(StatusCode::UNAUTHORIZED, problems::UNAUTHORIZED, "Unauthorized", detail).into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// Whether `digest` is the admin token's, compared in constant time.
fn is_admin(state: &AppState, digest: &[u8; 32]) -> bool {
    state.admin_token.is_some_and(|known| bool::from(known.ct_eq(digest)))
}

pub(super) fn bearer(headers: &HeaderMap) -> Option<[u8; 32]> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    // The scheme name is case-insensitive (RFC 9110 section 11.1).
    let (scheme, token) = value.to_str().ok()?.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| token_digest(token))
}

/// The principal whose token has `digest`. Every configured token is compared, in constant
/// time, whether one matched early or none does, so the time taken says nothing about which
/// token (or how much of one) matched.
pub(super) fn principal_for<'a>(
    tokens: impl IntoIterator<Item = &'a ([u8; 32], Principal)>,
    digest: &[u8; 32],
) -> Option<Principal> {
    let mut found: Option<Principal> = None;
    for (known, principal) in tokens {
        if bool::from(known.ct_eq(digest)) {
            found = Some(principal.clone());
        }
    }
    found
}

/// The bearer check of `/v1`: the token's principal goes into the request's extensions, else
/// `401`.
pub(crate) async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(digest) = bearer(req.headers()) else { return unauthorized() };
    match principal_for(state.tokens.iter(), &digest) {
        Some(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        None if is_admin(&state, &digest) => unauthorized_because(
            "this is the admin token: it is valid for /admin and the console, not for /v1 routes, which take a \
             tenant's token",
        ),
        None => unauthorized(),
    }
}

/// `429` + `Retry-After` for a principal over its budget of mutating requests. Runs after
/// authentication and before the idempotency layer, so a refused request claims no key.
pub(crate) async fn rate_limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    use governor::clock::Clock;
    let (Some(limiter), false) = (&state.rate_limiter, req.method().is_safe()) else { return next.run(req).await };
    let Some(principal) = req.extensions().get::<Principal>() else { return next.run(req).await };
    match limiter.check_key(&principal.as_str().to_owned()) {
        Ok(()) => next.run(req).await,
        Err(not_until) => {
            let wait = not_until.wait_time_from(limiter.clock().now());
            let secs = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
            Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                idempotency::problems::TOO_MANY_REQUESTS,
                "Too many requests",
                "this principal is over its rate of mutating requests; nothing was stored, retry after \
                 Retry-After seconds",
            )
            .with_retry_after(secs)
            .into_response()
        }
    }
}

/// The principal of requests made with the admin token: its idempotency records are scoped to
/// it, apart from every tenant's.
pub const ADMIN_PRINCIPAL: &str = "admin";

/// The bearer check of `/admin`: the admin token (whose requests run as [`ADMIN_PRINCIPAL`]),
/// else `401`.
pub(crate) async fn authenticate_admin(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let Some(digest) = bearer(req.headers()) else { return unauthorized() };
    if is_admin(&state, &digest) {
        req.extensions_mut().insert(Principal::new(ADMIN_PRINCIPAL));
        return next.run(req).await;
    }
    match principal_for(state.tokens.iter(), &digest) {
        Some(_) => unauthorized_because(
            "this is a tenant's token: it is valid for /v1 routes, not for /admin routes, which take the admin \
             token",
        ),
        None => unauthorized(),
    }
}
