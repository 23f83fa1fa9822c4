//! The store conformance suite: written once, run against every [`Store`].
//!
//! A store crate runs it with [`store_conformance_suite!`](crate::store_conformance_suite), naming
//! a module and an async expression that makes a fresh [`Fixture`]:
//!
//! ```
//! // In a test file, such as `tests/conformance.rs`:
//! idempotency::store_conformance_suite!(memory, async {
//!     let store = std::sync::Arc::new(idempotency::MemoryStore::new());
//!     idempotency::conformance::Fixture { peer: store.clone(), store }
//! });
//! # fn main() {}
//! ```
//!
//! Each case becomes a `#[tokio::test]` named `<module>::<case>`, so a test run shows which
//! backend passed what. Cases pass explicit timestamps instead of sleeping, so expiry and
//! staleness are tested exactly and quickly.
//!
//! Beside the suite, [`FaultyStore`] wraps any store and fails chosen operations on demand, for
//! testing what a store's caller does when the store errors (see [`crate::faulty`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::Duration as Span;

use crate::{
    ClaimOutcome, ClaimRequest, Decision, Endpoint, Fingerprint, IdempotencyKey, Principal, ReclaimRequest,
    RecordState, Renewal, Scope, Store, StoreError, StoredBody, StoredResponse, Timestamp, now,
};

pub use crate::faulty::{FaultyStore, InjectedFault, Op};
pub use claims::*;
pub use holding::Holding;
pub use lifecycle::*;
pub use operating::*;
pub use port::{HeldPort, free_port_with, free_ports};
pub use replay_cache::*;
pub use retention::*;
pub use uncertain::*;

mod claims;
mod holding;
mod lifecycle;
mod operating;
mod port;
mod replay_cache;
mod retention;
mod uncertain;

/// Two handles on one backing store: `peer` must be a separate connection pool to the same
/// database where the backend has pools (two replicas of a service), or the same store.
#[derive(Clone)]
pub struct Fixture {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// A second, independent handle on the same data.
    pub peer: Arc<dyn Store>,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fixture")
    }
}

pub(super) const TTL: Duration = Duration::from_secs(300);

pub(super) fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", crate::RecordId::random().to_hex())
}

pub(super) fn scope_with(principal: &str, endpoint: &str, key: &str) -> Scope {
    Scope::new(
        Principal::new(principal),
        Endpoint::new("POST", endpoint),
        IdempotencyKey::try_from(key).expect("test keys are valid"),
    )
}

pub(super) fn fresh_scope() -> Scope {
    scope_with(&unique("principal"), "/v1/workers", &unique("key"))
}

pub(super) fn fp(s: &str) -> Fingerprint {
    Fingerprint::from_stored(format!("sha256:{s}"))
}

pub(super) fn request(scope: &Scope, fingerprint: &Fingerprint, at: Timestamp) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        fingerprint: fingerprint.clone(),
        now: at,
        in_flight_ttl: TTL,
        expires_at: at + Span::hours(24),
    }
}

/// A renewal at `at` by an attempt whose retention is a day, like [`request`]'s.
pub(super) fn renewal(at: Timestamp) -> Renewal {
    Renewal { now: at, in_flight_ttl: TTL, expires_at: at + Span::hours(24) }
}

pub(super) fn response(status: u16, body: &[u8]) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/v1/workers/wkr-1".into()),
            ("x-multi".into(), "one".into()),
            ("x-multi".into(), "two".into()),
        ],
        body: StoredBody::encode(Bytes::copy_from_slice(body), 1024),
    }
}

pub(super) async fn owned(store: &dyn Store, req: ClaimRequest) -> crate::Claim {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Owned(c) => c,
        ClaimOutcome::Existing(r) => panic!("expected to own the key, found {r:?}"),
    }
}

pub(super) async fn existing(store: &dyn Store, req: ClaimRequest) -> crate::Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Existing(r) => r,
        ClaimOutcome::Owned(c) => panic!("expected an existing record, owned {c:?}"),
    }
}

/// Generates one `#[tokio::test]` per conformance case in a module named `$name`, and beside it
/// an async function also named `$name` that evaluates `$fixture`, an async expression making a
/// fresh [`Fixture`].
///
/// For a backend that may be unavailable (a database named by an environment variable), write
/// `optional` before the expression and make it evaluate to `Option<Fixture>`: on `None` each
/// case returns at once (the fixture should have said loudly why it skipped).
///
/// ```
/// # use std::sync::Arc;
/// # use idempotency::{MemoryStore, conformance::Fixture};
/// # struct Database;
/// # async fn my_test_database() -> Option<Database> { Some(Database) }
/// # async fn fixture_on(_db: Database) -> Fixture {
/// #     let store = Arc::new(MemoryStore::new());
/// #     Fixture { peer: store.clone(), store }
/// # }
/// idempotency::store_conformance_suite!(postgres, optional async {
///     let db = my_test_database().await?; // None: skipped
///     Some(fixture_on(db).await)
/// });
/// # fn main() {}
/// ```
///
/// A store whose records expire by themselves (a Redis key's own expiry), whose
/// `sweep_expired` so has nothing to delete, writes `self_expiring optional` instead: its
/// expiry is then tested by [`expiry_frees_the_key_by_itself`] and
/// [`expired_records_vanish_without_a_sweep`] in place of [`expiry_frees_the_key`] and
/// [`sweep_is_bounded_and_spares_live_records`], which need a sweep to delete records that
/// expire at a time the test names.
///
/// A store that sweeps whole days of expiry at once (PostgreSQL partitioned by expiry day),
/// whose sweep so removes a record only once its expiry day has ended and is not bounded by the
/// batch, writes `whole_days optional`: [`expiry_frees_the_key_by_the_day`] and
/// [`sweep_drops_ended_days_and_spares_live_records`] replace the same two cases.
#[macro_export]
macro_rules! store_conformance_suite {
    ($name:ident, whole_days optional $fixture:expr) => {
        $crate::store_conformance_suite!(@suite $name, $fixture;
            expiry_frees_the_key_by_the_day,
            sweep_drops_ended_days_and_spares_live_records,
        );
    };
    ($name:ident, self_expiring optional $fixture:expr) => {
        $crate::store_conformance_suite!(@suite $name, $fixture;
            expiry_frees_the_key_by_itself,
            expired_records_vanish_without_a_sweep,
        );
    };
    ($name:ident, optional $fixture:expr) => {
        $crate::store_conformance_suite!(@suite $name, $fixture;
            expiry_frees_the_key,
            sweep_is_bounded_and_spares_live_records,
        );
    };
    ($name:ident, $fixture:expr) => {
        $crate::store_conformance_suite!($name, optional async { ::core::option::Option::Some($fixture.await) });
    };
    (@suite $name:ident, $fixture:expr; $($expiry:ident),* $(,)?) => {
        // The expression once, in the caller's scope (so it sees what the caller sees), outside
        // the `#[test]` functions (so it is type-checked even where tests are not built, as in
        // doc examples). A function and a module may share a name: they live in different
        // namespaces.
        async fn $name() -> ::core::option::Option<$crate::conformance::Fixture> {
            $fixture.await
        }

        mod $name {
            $crate::store_conformance_suite!(@cases super::$name();
                first_claim_owns,
                second_claim_sees_the_record,
                mismatch_is_detected_in_every_state,
                completed_record_replays_byte_for_byte,
                failed_record_is_reclaimed,
                racing_claims_have_exactly_one_owner,
                stale_reclaim_has_exactly_one_winner,
                superseded_claim_is_fenced,
                scopes_never_share_a_record,
                long_scopes_are_stored_apart,
                compressed_and_binary_bodies_round_trip,
                unknown_scope_is_absent,
                reclaim_extends_expiry,
                heartbeat_keeps_a_claim_live,
                heartbeat_is_fenced,
                remove_frees_the_key,
                listing_pages_through_every_live_record,
                listing_filters_by_state_principal_and_age,
                records_are_found_by_id,
                forget_spares_in_flight_and_frees_the_key,
                foreign_cursor_is_refused,
                counts_a_principals_live_records,
                an_in_flight_record_outlives_a_short_retention,
                a_heartbeat_renews_the_expiry_of_an_in_flight_record,
                a_reclaim_keeps_the_record_for_at_least_the_ttl,
                a_live_claim_is_never_replaced_past_its_expiry,
                counts_only_what_a_principal_stores,
                mark_uncertain_keeps_the_record,
                an_uncertain_record_is_not_reclaimed_after_its_ttl,
                mark_uncertain_is_fenced,
                stale_in_flight_becomes_uncertain_with_one_winner,
                take_over_of_an_uncertain_record_has_one_owner,
                resolve_completes_only_an_uncertain_record,
                forget_frees_an_uncertain_record,
                uncertain_records_are_listed_and_counted,
                $($expiry,)*
            );
        }
    };
    (@cases $fixture:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let ::core::option::Option::Some(fixture) = $fixture.await else { return };
                $crate::conformance::$case(fixture).await;
            }
        )*
    };
}
