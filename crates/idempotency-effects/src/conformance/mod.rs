//! The ledger conformance suite: written once, run against every [`Ledger`] backend.
//!
//! A ledger crate runs it with [`ledger_conformance_suite!`](crate::ledger_conformance_suite),
//! naming a module and an async expression that makes a fresh [`Fixture`] (or `None` after a
//! loud SKIPPED, with `optional`). Each case becomes a multi-threaded `#[tokio::test]` named
//! `<module>::<case>`. Every case counts side effects on a [`Downstream`] kept in memory (the
//! ground truth), with real concurrency where it races.
//!
//! ```
//! idempotency_effects::ledger_conformance_suite!(memory, async {
//!     let ledger = std::sync::Arc::new(idempotency_effects::MemoryLedger::new());
//!     let store = std::sync::Arc::new(idempotency::MemoryStore::new());
//!     idempotency_effects::conformance::Fixture {
//!         ledger: ledger.clone(), peer: ledger, store: store.clone(), store_peer: store,
//!     }
//! });
//! # fn main() {}
//! ```

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordId, Scope, Store,
};

use crate::{Effects, Ledger, Operation};

mod cases;
mod downstream;
mod gated;

pub use cases::*;
pub use downstream::Downstream;
pub use gated::{Gated, Step};

/// Two handles on one ledger and one record store: `peer` and `store_peer` must be separate
/// connection pools on the same databases where the backend has pools (two replicas).
#[derive(Clone)]
pub struct Fixture {
    /// The ledger under test.
    pub ledger: Arc<dyn Ledger>,
    /// A second, independent handle on the same ledger.
    pub peer: Arc<dyn Ledger>,
    /// The idempotency record store the reaper reads.
    pub store: Arc<dyn Store>,
    /// A second handle on it.
    pub store_peer: Arc<dyn Store>,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fixture")
    }
}

/// The settle window of the cases that wait it out: short, so the suite stays quick.
pub(crate) const SETTLE: Duration = Duration::from_secs(1);

pub(crate) fn effects(ledger: &Arc<dyn Ledger>) -> Effects {
    Effects::new(ledger.clone()).settle(SETTLE)
}

/// Claims a fresh record (a unique principal and key) and returns its claim and operation.
pub(crate) async fn fresh_op(store: &dyn Store, kind: &str) -> (Claim, Operation) {
    let scope = Scope::new(
        Principal::new(format!("team-{}", RecordId::random().to_hex())),
        Endpoint::new("POST", "/v1/things"),
        IdempotencyKey::try_from(format!("k-{}", RecordId::random().to_hex()).as_str()).expect("valid key"),
    );
    match store.claim(claim_request(scope)).await.expect("claim") {
        ClaimOutcome::Owned(claim) => {
            let op = Operation::of(claim.record(), kind);
            (claim, op)
        }
        ClaimOutcome::Existing(r) => panic!("a fresh key has a record: {r:?}"),
    }
}

/// A claim of `scope` now, the record kept for 24 hours.
pub(crate) fn claim_request(scope: Scope) -> ClaimRequest {
    let now = idempotency::now();
    ClaimRequest {
        scope,
        fingerprint: Fingerprint::from_stored("sha256:00"),
        now,
        in_flight_ttl: Duration::from_secs(300),
        expires_at: now + chrono::Duration::hours(24),
    }
}

/// Waits until `cond` holds, polling, for at most 30 s.
pub(crate) async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the settle window of every send made so far has passed.
pub(crate) async fn wait_out_settle() {
    let until = idempotency::now().timestamp_micros() + crate::micros(SETTLE + crate::DEFAULT_SEND_AHEAD);
    wait_until("the settle window passed", || idempotency::now().timestamp_micros() > until).await;
}

/// Generates one `#[tokio::test]` per conformance case in a module named `$name`, and beside it
/// an async function also named `$name` that evaluates `$fixture` (an async expression making
/// a fresh [`Fixture`]; with `optional`, an `Option<Fixture>` whose `None` skips every case).
#[macro_export]
macro_rules! ledger_conformance_suite {
    ($name:ident, optional $fixture:expr) => {
        async fn $name() -> ::core::option::Option<$crate::conformance::Fixture> {
            $fixture.await
        }

        mod $name {
            $crate::ledger_conformance_suite!(@cases super::$name();
                racing_attempts_send_once,
                a_stalled_attempt_waking_after_finish_sends_nothing,
                a_stalled_attempt_waking_after_finish_and_delete_brings_nothing_back,
                a_stalled_stamp_after_another_attempt_finished_sends_nothing,
                a_stalled_attempt_waking_after_rollback_sends_nothing,
                the_settle_window_is_respected_and_a_late_landing_adopted,
                a_definite_refusal_releases_and_the_retry_sends_at_once,
                a_queue_for_the_ledger_does_not_refuse_the_send,
                a_stamp_whose_commit_came_back_late_is_taken_again_and_sent_once,
                a_stamp_late_every_time_sends_nothing_and_the_retry_sends_once,
                the_reaper_and_retries_on_two_replicas_never_both_act,
                a_retry_held_at_adoption_while_the_reaper_rolls_back_adopts_nothing,
                the_reaper_waits_for_a_live_claim_and_the_settle_window,
                the_inventory_sweep_undoes_orphans_only,
                the_reaper_is_fair_behind_100_000_waiting_rows,
                a_dead_watcher_is_taken_over_and_retries_attach,
                racing_watchers_take_one_lease,
                marks_refuse_every_step_until_the_retention,
                an_operation_that_never_began_is_fenced_off,
                the_sweep_spares_what_the_service_owns_and_counts_a_lost_undo_once,
                an_idempotent_call_is_sent_again_without_waiting,
                an_operation_keeps_its_subject,
                a_paused_refusal_never_releases_a_newer_send,
                the_reaper_claims_the_record_at_the_time_of_the_reclaim,
                a_record_the_reaper_cannot_remove_is_removed_on_a_later_tick,
                a_retention_too_long_to_add_neither_panics_nor_wraps,
            );
        }
    };
    ($name:ident, $fixture:expr) => {
        $crate::ledger_conformance_suite!($name, optional async { ::core::option::Option::Some($fixture.await) });
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                if let ::core::option::Option::Some(fixture) = $make.await {
                    $crate::conformance::$case(fixture).await;
                }
            }
        )*
    };
}
