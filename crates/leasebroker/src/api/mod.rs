//! The HTTP API (docs/protocol.md#leasebroker-api): handlers, authentication, and errors as problem+json. The router
//! that puts them together is in [`crate::routes`].
//!
//! - [`dto`]: what the API shows (workers, pages, the fleet);
//! - `auth`: bearer tokens, the admin token, the per-principal rate limit;
//! - `shares`: each principal's requests in progress, the process's turns, and the delete that
//!   passes the record limit;
//! - `problems`: errors as bounded problem+json, JSON bodies parsed without quoting them;
//! - `handlers`: one function per route.

use std::sync::Arc;

use idempotency::Principal;
use metrics_exporter_prometheus::PrometheusHandle;
use sha2::{Digest, Sha256};

use crate::firmware::Firmware;
use crate::hypervisor::client::HypervisorClient;
use crate::service::Workers;

mod auth;
pub mod dto;
mod handlers;
mod problems;
pub mod records;
mod shares;

pub use auth::ADMIN_PRINCIPAL;
pub(crate) use auth::{authenticate, authenticate_admin, rate_limit};
pub use dto::*;
pub use handlers::*;
pub use problems::{ApiError, MAX_DETAIL, json_error_detail};
pub use records::*;
pub use shares::{MAX_IN_FLIGHT, Shares};
pub(crate) use shares::{admin_share, console_share, own_deletes_pass, tenant_share};

/// Shared state of the handlers, behind one `Arc`: axum clones the state for every middleware
/// and handler of every request, and the services inside hold several clients (a clone of each
/// would be allocations and contended reference counts on every request).
#[derive(Clone)]
pub struct AppState(Arc<AppStateInner>);

impl AppState {
    /// The state of `inner`.
    pub fn new(inner: AppStateInner) -> Self {
        Self(Arc::new(inner))
    }
}

impl std::ops::Deref for AppState {
    type Target = AppStateInner;

    fn deref(&self) -> &AppStateInner {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct AppStateInner {
    /// The workers service.
    pub workers: Workers,
    /// The firmware service.
    pub firmware: Firmware,
    /// Bearer tokens (as SHA-256 digests, so comparisons take the same time whatever the length)
    /// and the principals they authenticate.
    pub tokens: Arc<Vec<([u8; 32], Principal)>>,
    /// The admin token's digest.
    pub admin_token: Option<[u8; 32]>,
    /// The idempotency store, for readiness.
    pub store: Arc<dyn idempotency::Store>,
    /// Renders /metrics.
    pub metrics: PrometheusHandle,
    /// The hypervisor, for fleet counts.
    pub hypervisor: HypervisorClient,
    /// The per-principal limit on mutating requests (`--rate-limit`), if any.
    pub rate_limiter: Option<Arc<PrincipalRateLimiter>>,
    /// Each principal's requests in progress (`--max-concurrent-per-principal`) and the
    /// process's turns.
    pub shares: Shares,
    /// The audit trail of operators' actions on records.
    pub audit: crate::audit::Audit,
    /// Whether the stores answer, for requests that wait on them too long.
    pub probe: crate::outage::StoreProbe,
    /// The JSON body field a request's key may come from (`--key-sources request-id`): the
    /// idempotency layer reads it, the handlers take it out before reading the request.
    pub body_key_field: Option<&'static str>,
}

/// A rate limiter with one budget per principal. Its memory is bounded by the configured
/// principals: only authenticated requests reach it.
pub type PrincipalRateLimiter = governor::DefaultKeyedRateLimiter<String>;

/// A limiter allowing `per_second` mutating requests per principal, `burst` at once (default:
/// twice `per_second`). `None` when `per_second` is 0: no limit.
pub fn rate_limiter(per_second: u32, burst: Option<u32>) -> Option<Arc<PrincipalRateLimiter>> {
    let rate = std::num::NonZeroU32::new(per_second)?;
    let burst = burst.and_then(std::num::NonZeroU32::new).unwrap_or_else(|| rate.saturating_add(rate.get()));
    Some(Arc::new(governor::RateLimiter::keyed(governor::Quota::per_second(rate).allow_burst(burst))))
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for AppStateInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").field("principals", &self.tokens.len()).finish_non_exhaustive()
    }
}

/// Hashes a token for constant-time comparison.
pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The largest request body accepted (413 beyond).
pub const BODY_LIMIT: usize = 1024 * 1024;

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use rand::Rng;

    use super::auth::{bearer, principal_for};
    use super::*;
    use axum::http::{HeaderMap, HeaderValue, header};

    /// Many bodies with a random string put where serde quotes it (a value of the wrong type, an
    /// unknown field name, a label, a broken document): every detail is bounded and none quotes
    /// the string.
    #[test]
    fn json_error_details_are_bounded_and_never_quote_the_body() {
        let templates = [
            r#"{"image": "i", "cpu": "S", "memory_gb": 1}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "S": 1}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {"S": 1}}"#,
            r#"{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {"k": "v" "S"}}"#,
            r#"{"image": ["S"], "cpu": 1, "memory_gb": 1}"#,
            r#"{"image": "i", "cpu": S, "memory_gb": 1}"#,
            r#"["S"]"#,
            r#""S""#,
        ];
        let mut rng = rand::rng();
        let alphabet: Vec<char> = "abcXYZ019 `\"'\\,:{}[]éß€😀".chars().collect();
        for round in 0..1000 {
            let len = if round % 50 == 0 { rng.random_range(1000..20_000) } else { rng.random_range(24..200) };
            let mut secret: String = (0..len).map(|_| alphabet[rng.random_range(0..alphabet.len())]).collect();
            secret.insert_str(0, "canary");
            let escaped = serde_json::to_string(&secret).expect("json");
            let escaped = &escaped[1..escaped.len() - 1];
            for t in templates {
                let body = t.replace('S', escaped);
                let Err(e) = serde_json::from_slice::<crate::service::CreateWorker>(body.as_bytes()) else { continue };
                let detail = json_error_detail(&e);
                assert!(!detail.is_empty() && detail.len() <= MAX_DETAIL, "{} bytes for {t}", detail.len());
                assert!(!detail.contains("canary"), "{t}: {detail}");
                let chars: Vec<char> = secret.chars().take(400).collect();
                for w in chars.windows(12) {
                    let w: String = w.iter().collect();
                    assert!(!detail.contains(&w), "{t}: {detail} quotes {w:?}");
                }
            }
        }
    }

    #[test]
    fn every_configured_token_is_compared_whichever_matches() {
        let tokens: Vec<([u8; 32], Principal)> =
            (0..5).map(|i| (token_digest(&format!("token-{i}")), Principal::new(format!("p{i}")))).collect();
        for (probe, expected) in [
            ("token-0", Some("p0")),
            ("token-3", Some("p3")),
            ("token-4", Some("p4")),
            ("token-", None),
            ("token-00", None),
            ("", None),
        ] {
            let compared = Cell::new(0);
            let found =
                principal_for(tokens.iter().inspect(|_| compared.set(compared.get() + 1)), &token_digest(probe));
            assert_eq!(found.as_ref().map(Principal::as_str), expected, "{probe:?}");
            assert_eq!(compared.get(), tokens.len(), "{probe:?}: every token is compared");
        }
    }

    #[test]
    fn bearer_takes_one_well_formed_header() {
        let headers = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::AUTHORIZATION, HeaderValue::from_str(v).expect("value"));
            }
            h
        };
        assert_eq!(bearer(&headers(&["Bearer abc"])), Some(token_digest("abc")));
        assert_eq!(bearer(&headers(&["bearer abc"])), Some(token_digest("abc")), "the scheme is case-insensitive");
        assert_eq!(bearer(&headers(&[])), None);
        assert_eq!(bearer(&headers(&["Bearer "])), None);
        assert_eq!(bearer(&headers(&["Basic YWJj"])), None);
        assert_eq!(bearer(&headers(&["Bearer abc", "Bearer abc"])), None, "sent twice");
    }
}
