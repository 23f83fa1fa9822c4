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
    ClaimOutcome, ClaimRequest, Decision, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordState, Scope, Store,
    StoreError, StoredBody, StoredResponse, Timestamp, now,
};

pub use crate::faulty::{FaultyStore, InjectedFault, Op};

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

const TTL: Duration = Duration::from_secs(300);

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", crate::RecordId::random().to_hex())
}

fn scope_with(principal: &str, endpoint: &str, key: &str) -> Scope {
    Scope::new(
        Principal::new(principal),
        Endpoint::new("POST", endpoint),
        IdempotencyKey::try_from(key).expect("test keys are valid"),
    )
}

fn fresh_scope() -> Scope {
    scope_with(&unique("principal"), "/v1/workers", &unique("key"))
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::from_stored(format!("sha256:{s}"))
}

fn request(scope: &Scope, fingerprint: &Fingerprint, at: Timestamp) -> ClaimRequest {
    ClaimRequest { scope: scope.clone(), fingerprint: fingerprint.clone(), now: at, expires_at: at + Span::hours(24) }
}

fn response(status: u16, body: &[u8]) -> StoredResponse {
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

async fn owned(store: &dyn Store, req: ClaimRequest) -> crate::Claim {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Owned(c) => c,
        ClaimOutcome::Existing(r) => panic!("expected to own the key, found {r:?}"),
    }
}

async fn existing(store: &dyn Store, req: ClaimRequest) -> crate::Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Existing(r) => r,
        ClaimOutcome::Owned(c) => panic!("expected an existing record, owned {c:?}"),
    }
}

/// The first claim of a new key owns it: in flight, generation 1, the request's fingerprint.
pub async fn first_claim_owns(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let claim = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let r = claim.record();
    assert_eq!(r.state, RecordState::InFlight);
    assert_eq!(r.generation, 1);
    assert_eq!(r.fingerprint, fp("a"));
    assert_eq!(r.created_at, t);
    assert_eq!(r.started_at, t);
    assert_eq!(fx.store.get(&scope).await.expect("get").as_ref(), Some(r));
}

/// A second claim does not own the key; it sees the first claim's record, unchanged.
pub async fn second_claim_sees_the_record(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let claim = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let seen = existing(&*fx.peer, request(&scope, &fp("a"), t + Span::seconds(1))).await;
    assert_eq!(&seen, claim.record());
    assert_eq!(
        seen.decide(&fp("a"), t + Span::seconds(1), TTL),
        Decision::InProgress { retry_after: TTL - Duration::from_secs(1) }
    );
}

/// The same key with a different fingerprint is a mismatch in every state.
pub async fn mismatch_is_detected_in_every_state(fx: Fixture) {
    let t = now();
    let (s1, s2, s3) = (fresh_scope(), fresh_scope(), fresh_scope());
    owned(&*fx.store, request(&s1, &fp("a"), t)).await;
    let c2 = owned(&*fx.store, request(&s2, &fp("a"), t)).await;
    fx.store.complete(&c2, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    let c3 = owned(&*fx.store, request(&s3, &fp("a"), t)).await;
    fx.store.fail(&c3).await.expect("fail");
    for s in [s1, s2, s3] {
        let r = existing(&*fx.store, request(&s, &fp("b"), t)).await;
        assert_eq!(r.decide(&fp("b"), t, TTL), Decision::Mismatch, "{:?}", r.state);
        assert_eq!(r.fingerprint, fp("a"), "a mismatched claim must not change the record");
    }
}

/// A completed record replays its status, headers (order and repeats kept) and body byte for byte.
pub async fn completed_record_replays_byte_for_byte(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let claim = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let resp = response(201, br#"{"id":"wkr-1","state":"booting"}"#);
    fx.store.complete(&claim, &resp, t + Span::hours(24)).await.expect("complete");
    let r = existing(&*fx.peer, request(&scope, &fp("a"), t + Span::seconds(5))).await;
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.expires_at, t + Span::hours(24));
    match r.decide(&fp("a"), t + Span::seconds(5), TTL) {
        Decision::Replay(got) => {
            assert_eq!(got, resp);
            assert_eq!(got.body.decode().expect("decode"), Bytes::from_static(br#"{"id":"wkr-1","state":"booting"}"#));
        }
        d => panic!("expected a replay, got {d:?}"),
    }
}

/// A failed record is re-claimed by the next attempt (same record id, next generation) and can
/// then complete.
pub async fn failed_record_is_reclaimed(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let first = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    fx.store.fail(&first).await.expect("fail");
    let r = existing(&*fx.store, request(&scope, &fp("a"), t + Span::seconds(1))).await;
    assert_eq!(r.state, RecordState::Failed);
    assert_eq!(r.decide(&fp("a"), t, TTL), Decision::Reclaim);
    let again =
        fx.store.reclaim(&r, t + Span::seconds(1), TTL, t + Span::hours(1)).await.expect("reclaim").expect("reclaimed");
    assert_eq!(again.generation(), 2);
    assert_eq!(again.record().record_id, first.record().record_id);
    assert_eq!(again.record().started_at, t + Span::seconds(1));
    assert_eq!(again.record().created_at, t);
    assert_eq!(again.derive("alloc"), first.derive("alloc"));
    fx.store.complete(&again, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").state, RecordState::Completed);
}

/// 64 tasks race to claim one new key through two handles: exactly one owns it.
pub async fn racing_claims_have_exactly_one_owner(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = if i % 2 == 0 { fx.store.clone() } else { fx.peer.clone() };
            let req = request(&scope, &fp("a"), t);
            tokio::spawn(async move { store.claim(req).await })
        })
        .collect();
    let mut owners = 0;
    let mut ids = std::collections::HashSet::new();
    for outcome in futures::future::join_all(tasks).await {
        match outcome.expect("task").expect("claim") {
            ClaimOutcome::Owned(c) => {
                owners += 1;
                ids.insert(c.record().record_id);
            }
            ClaimOutcome::Existing(r) => {
                ids.insert(r.record_id);
            }
        }
    }
    assert_eq!(owners, 1, "exactly one of 64 concurrent claims must own the key");
    assert_eq!(ids.len(), 1, "every claimer must see the same record");
}

/// Many tasks race to re-claim one stale record: exactly one wins. A fresh record is not
/// reclaimable at all.
pub async fn stale_reclaim_has_exactly_one_winner(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let first = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let record = first.record().clone();
    let early = t + Span::seconds(299);
    assert!(fx.store.reclaim(&record, early, TTL, early).await.expect("reclaim").is_none(), "not stale yet");
    let late = t + Span::seconds(300);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = if i % 2 == 0 { fx.store.clone() } else { fx.peer.clone() };
            let record = record.clone();
            tokio::spawn(async move { store.reclaim(&record, late, TTL, late).await })
        })
        .collect();
    let winners: Vec<_> =
        futures::future::join_all(tasks).await.into_iter().filter_map(|r| r.expect("task").expect("reclaim")).collect();
    assert_eq!(winners.len(), 1, "exactly one concurrent re-claim must win");
    assert_eq!(winners[0].generation(), 2);
    assert_eq!(winners[0].record().started_at, late);
}

/// A superseded claim can neither complete nor fail, and does not overwrite the newer attempt.
pub async fn superseded_claim_is_fenced(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let slow = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let newer = fx
        .peer
        .reclaim(slow.record(), t + Span::seconds(301), TTL, t + Span::hours(1))
        .await
        .expect("reclaim")
        .expect("stale claim is reclaimable");
    let late = fx.store.complete(&slow, &response(201, b"slow"), t + Span::hours(1)).await;
    assert!(matches!(late, Err(StoreError::Fenced { generation: 1 })), "{late:?}");
    assert!(matches!(fx.store.fail(&slow).await, Err(StoreError::Fenced { .. })));
    let r = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!((r.state, r.generation, r.response.is_none()), (RecordState::InFlight, 2, true));

    fx.peer.complete(&newer, &response(201, b"newer"), t + Span::hours(1)).await.expect("complete");
    assert!(matches!(fx.store.complete(&slow, &response(201, b"slow"), t).await, Err(StoreError::Fenced { .. })));
    let r = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!(r.response.expect("stored").body.decode().expect("decode"), Bytes::from_static(b"newer"));
    // Completing twice is refused too: a completed record is final.
    assert!(matches!(fx.store.complete(&newer, &response(200, b"x"), t).await, Err(StoreError::Fenced { .. })));
    assert!(
        fx.store
            .reclaim(&fx.store.get(&scope).await.expect("get").expect("row"), t + Span::days(1), TTL, t + Span::days(2))
            .await
            .expect("reclaim")
            .is_none()
    );
}

/// Expired records are swept; the key is then free and a new claim gets a new record id.
/// An expired record that was not swept yet counts as absent too.
pub async fn expiry_frees_the_key(fx: Fixture) {
    let t = now();
    let (swept, unswept) = (fresh_scope(), fresh_scope());
    let mut first_ids = vec![];
    for scope in [&swept, &unswept] {
        let c = owned(&*fx.store, request(scope, &fp("a"), t)).await;
        fx.store.complete(&c, &response(201, b"old"), t + Span::seconds(60)).await.expect("complete");
        first_ids.push(c.record().record_id);
    }
    // Not yet expired: still replayed.
    existing(&*fx.store, request(&swept, &fp("a"), t + Span::seconds(59))).await;

    // An expired record is absent to claim even before the sweeper ran.
    let again = owned(&*fx.store, request(&unswept, &fp("b"), t + Span::seconds(61))).await;
    assert_ne!(again.record().record_id, first_ids[1]);
    assert_eq!(again.generation(), 1);
    assert_ne!(again.derive("alloc"), crate::derive(again.scope(), &first_ids[1], "alloc"),);

    // Sweep everything that expired by a time far in the future for this test's records only
    // would touch other tests' rows; sweep up to t+61s and check our row went.
    let mut n = 0;
    loop {
        let k = fx.store.sweep_expired(t + Span::seconds(61), 1000).await.expect("sweep");
        n += k;
        if k < 1000 {
            break;
        }
    }
    assert!(n >= 1, "the expired record must be swept");
    assert!(fx.store.get(&swept).await.expect("get").is_none());
    assert!(fx.store.get(&unswept).await.expect("get").is_some(), "the re-claimed record is live");
    let fresh = owned(&*fx.store, request(&swept, &fp("c"), t + Span::seconds(62))).await;
    assert_ne!(fresh.record().record_id, first_ids[0]);
}

/// Sweeping deletes at most `batch` records per call and never a live one.
pub async fn sweep_is_bounded_and_spares_live_records(fx: Fixture) {
    // Far in the past, so this test's expired rows do not collide with other tests' timing.
    let t = now() - Span::days(3650);
    let live = fresh_scope();
    let c = owned(&*fx.store, request(&live, &fp("a"), t)).await;
    fx.store.complete(&c, &response(201, b"{}"), t + Span::days(36500)).await.expect("complete");
    let mut expired = vec![];
    for _ in 0..25 {
        let s = fresh_scope();
        let c = owned(&*fx.store, request(&s, &fp("a"), t)).await;
        fx.store.complete(&c, &response(201, b"{}"), t + Span::seconds(1)).await.expect("complete");
        expired.push(s);
    }
    let at = t + Span::seconds(2);
    let first = fx.store.sweep_expired(at, 10).await.expect("sweep");
    assert_eq!(first, 10, "one call deletes at most the batch");
    let mut total = first;
    loop {
        let k = fx.store.sweep_expired(at, 10).await.expect("sweep");
        assert!(k <= 10);
        total += k;
        if k == 0 {
            break;
        }
    }
    assert!(total >= 25);
    for s in &expired {
        assert!(fx.store.get(s).await.expect("get").is_none());
    }
    assert!(fx.store.get(&live).await.expect("get").is_some());
}

/// For a store whose records expire by themselves (the Redis store: a key's own expiry), in
/// place of [`expiry_frees_the_key`]: a record whose `expires_at` has passed counts as absent to
/// a claim (new record id, generation 1) even while the store still holds it, and one whose
/// `expires_at` is already past by the wall clock is gone without a sweep.
pub async fn expiry_frees_the_key_by_itself(fx: Fixture) {
    let t = now();
    let (held, gone) = (fresh_scope(), fresh_scope());
    let c = owned(&*fx.store, request(&held, &fp("a"), t)).await;
    fx.store.complete(&c, &response(201, b"old"), t + Span::seconds(60)).await.expect("complete");
    existing(&*fx.peer, request(&held, &fp("a"), t + Span::seconds(59))).await;
    let again = owned(&*fx.peer, request(&held, &fp("b"), t + Span::seconds(61))).await;
    assert_ne!(again.record().record_id, c.record().record_id);
    assert_eq!((again.generation(), again.record().fingerprint.clone()), (1, fp("b")));
    assert_ne!(again.derive("alloc"), c.derive("alloc"), "a new record has new sub-keys");

    // Completed an hour ago with a one-minute retention: gone, with no sweep.
    let past = t - Span::hours(1);
    let old = owned(&*fx.store, request(&gone, &fp("a"), past)).await;
    fx.store.complete(&old, &response(201, b"old"), past + Span::seconds(60)).await.expect("complete");
    assert!(fx.peer.get(&gone).await.expect("get").is_none(), "an expired record must vanish by itself");
    let fresh = owned(&*fx.peer, request(&gone, &fp("c"), t)).await;
    assert_ne!(fresh.record().record_id, old.record().record_id);
    assert!(fx.store.get(&held).await.expect("get").is_some(), "the re-claimed record is live");
}

/// For a store whose records expire by themselves, in place of
/// [`sweep_is_bounded_and_spares_live_records`]: expired records vanish without a sweep, and a
/// sweep stays within its batch and never deletes a live record.
pub async fn expired_records_vanish_without_a_sweep(fx: Fixture) {
    let t = now() - Span::hours(2);
    let live = fresh_scope();
    let c = owned(&*fx.store, request(&live, &fp("a"), t)).await;
    fx.store.complete(&c, &response(201, b"{}"), t + Span::days(36500)).await.expect("complete");
    let mut expired = vec![];
    for _ in 0..25 {
        let s = fresh_scope();
        let c = owned(&*fx.store, request(&s, &fp("a"), t)).await;
        fx.store.complete(&c, &response(201, b"{}"), t + Span::seconds(1)).await.expect("complete");
        expired.push(s);
    }
    for s in &expired {
        assert!(fx.peer.get(s).await.expect("get").is_none(), "an expired record must vanish by itself");
    }
    for at in [now(), now() + Span::days(1)] {
        assert!(fx.store.sweep_expired(at, 10).await.expect("sweep") <= 10);
    }
    let kept = fx.peer.get(&live).await.expect("get").expect("the live record is kept");
    assert_eq!((kept.record_id, kept.state), (c.record().record_id, RecordState::Completed));
}

/// Two principals, or two endpoints, with the same key never share a record.
pub async fn scopes_never_share_a_record(fx: Fixture) {
    let t = now();
    let key = unique("shared-key");
    let a = scope_with("alice", "/v1/workers", &key);
    let b = scope_with("bob", "/v1/workers", &key);
    let c = scope_with("alice", "/v1/workers/wkr-1/reboot", &key);
    let ca = owned(&*fx.store, request(&a, &fp("a"), t)).await;
    let cb = owned(&*fx.store, request(&b, &fp("a"), t)).await;
    let cc = owned(&*fx.store, request(&c, &fp("a"), t)).await;
    assert_ne!(ca.record().record_id, cb.record().record_id);
    assert_ne!(ca.derive("alloc"), cb.derive("alloc"));
    fx.store.complete(&ca, &response(201, b"alice"), t + Span::hours(1)).await.expect("complete");
    for s in [&b, &c] {
        let r = fx.store.get(s).await.expect("get").expect("row");
        assert_eq!(r.state, RecordState::InFlight, "completing alice's record must not touch {s:?}");
    }
    fx.store.complete(&cb, &response(201, b"bob"), t + Span::hours(1)).await.expect("complete");
    drop(cc);
    let ra = fx.store.get(&a).await.expect("get").expect("row");
    let rb = fx.store.get(&b).await.expect("get").expect("row");
    assert_eq!(ra.response.expect("a").body.decode().expect("decode"), Bytes::from_static(b"alice"));
    assert_eq!(rb.response.expect("b").body.decode().expect("decode"), Bytes::from_static(b"bob"));
}

/// A body above the threshold is stored compressed and read back byte for byte; so is a binary
/// body that is not UTF-8.
pub async fn compressed_and_binary_bodies_round_trip(fx: Fixture) {
    let t = now();
    let big: Vec<u8> = br#"{"node":"n-1","labels":{"team":"ml-eval"}},"#.repeat(6000);
    let binary: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
    for body in [big, binary] {
        let scope = fresh_scope();
        let c = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
        let resp =
            StoredResponse { status: 200, headers: vec![], body: StoredBody::encode(Bytes::from(body.clone()), 1024) };
        fx.store.complete(&c, &resp, t + Span::hours(1)).await.expect("complete");
        let got = fx.peer.get(&scope).await.expect("get").expect("row").response.expect("stored");
        assert_eq!(got.body.encoding(), resp.body.encoding());
        assert_eq!(got.body.decode().expect("decode"), Bytes::from(body));
    }
}

/// A reclaim moves `expires_at` to at least the new attempt's expiry (never earlier): a retry
/// near the end of the retention window is neither swept nor replaced by a new record while it
/// runs.
pub async fn reclaim_extends_expiry(fx: Fixture) {
    let t = now();
    let retention = Span::hours(1);
    let scope = fresh_scope();
    let first = owned(
        &*fx.store,
        ClaimRequest { scope: scope.clone(), fingerprint: fp("a"), now: t, expires_at: t + retention },
    )
    .await;
    fx.store.fail(&first).await.expect("fail");
    let old_expiry = t + retention;

    // A retry a minute before the record expires takes it over...
    let at = old_expiry - Span::minutes(1);
    let failed = fx.store.get(&scope).await.expect("get").expect("row");
    let retry =
        fx.peer.reclaim(&failed, at, TTL, at + retention).await.expect("reclaim").expect("failed is reclaimable");
    assert_eq!(retry.record().expires_at, at + retention, "the claim must carry the new expiry");
    let stored = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!(stored.expires_at, at + retention);

    // ...so at the old expiry the sweeper leaves it alone and a claim finds it, not a free key.
    fx.store.sweep_expired(old_expiry, 1000).await.expect("sweep");
    let seen = existing(&*fx.store, request(&scope, &fp("a"), old_expiry)).await;
    assert_eq!((seen.record_id, seen.generation), (first.record().record_id, 2));
    assert_eq!(
        seen.decide(&fp("a"), old_expiry, TTL),
        Decision::InProgress { retry_after: TTL - Duration::from_secs(60) }
    );

    // A stale claim taken over extends it the same way; an earlier expiry never shortens it.
    let stale_at = at + Span::seconds(300);
    let again = fx.store.reclaim(&seen, stale_at, TTL, t).await.expect("reclaim").expect("stale is reclaimable");
    assert_eq!(again.record().expires_at, at + retention, "an earlier expiry must not shorten the record's");
    let later = stale_at + Span::seconds(300);
    let third = fx.peer.reclaim(again.record(), later, TTL, later + retention).await.expect("reclaim").expect("stale");
    assert_eq!(third.record().expires_at, later + retention);
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").expires_at, later + retention);
}

/// A heartbeat renews a live claim: after it, the claim is not stale when the old TTL ends,
/// and `started_at` never moves backwards.
pub async fn heartbeat_keeps_a_claim_live(fx: Fixture) {
    let scope = fresh_scope();
    let t = now();
    let claim = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let beat = t + Span::seconds(200);
    fx.peer.heartbeat(&claim, beat).await.expect("heartbeat");
    // An older heartbeat (another replica's clock) does not move it back.
    fx.store.heartbeat(&claim, t + Span::seconds(100)).await.expect("heartbeat");
    let r = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!((r.state, r.generation, r.started_at, r.created_at), (RecordState::InFlight, 1, beat, t));

    let old_stale = t + Span::seconds(300);
    assert_eq!(r.decide(&fp("a"), old_stale, TTL), Decision::InProgress { retry_after: Duration::from_secs(200) });
    // The reclaim compares against the stored started_at, not the caller's copy.
    assert!(fx.peer.reclaim(claim.record(), old_stale, TTL, old_stale).await.expect("reclaim").is_none());
    assert!(fx.peer.reclaim(&r, old_stale, TTL, old_stale).await.expect("reclaim").is_none(), "renewed: not stale");
    // The renewed claim still completes; it goes stale only a TTL after its last heartbeat.
    let next = fx.peer.reclaim(&r, beat + Span::seconds(300), TTL, beat).await.expect("reclaim");
    assert!(next.is_some(), "a TTL after the last heartbeat the claim is stale");
}

/// A heartbeat of a claim that is no longer current is fenced and writes nothing: superseded,
/// completed, failed or gone.
pub async fn heartbeat_is_fenced(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let slow = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let stale = t + Span::seconds(301);
    let newer = fx.peer.reclaim(slow.record(), stale, TTL, stale).await.expect("reclaim").expect("stale");
    let late = fx.store.heartbeat(&slow, stale + Span::seconds(1)).await;
    assert!(matches!(late, Err(StoreError::Fenced { generation: 1 })), "{late:?}");
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").started_at, stale, "nothing written");
    fx.peer.heartbeat(&newer, stale + Span::seconds(2)).await.expect("the current claim renews");

    fx.peer.complete(&newer, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    assert!(matches!(fx.store.heartbeat(&newer, stale + Span::seconds(3)).await, Err(StoreError::Fenced { .. })));

    let failed = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.store.fail(&failed).await.expect("fail");
    assert!(matches!(fx.store.heartbeat(&failed, t).await, Err(StoreError::Fenced { .. })));

    let gone_scope = fresh_scope();
    let gone = owned(&*fx.store, request(&gone_scope, &fp("a"), t)).await;
    fx.store.remove(&gone).await.expect("remove");
    assert!(matches!(fx.store.heartbeat(&gone, t).await, Err(StoreError::Fenced { .. })));
    assert!(fx.store.get(&gone_scope).await.expect("get").is_none(), "a fenced heartbeat must not recreate the row");
}

/// `remove` deletes the record of the current claim, so the key's next claim creates a new
/// record (new record id, new sub-keys); a superseded or finished claim cannot remove it.
pub async fn remove_frees_the_key(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let first = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    fx.store.fail(&first).await.expect("fail");
    // A reaper takes the claim first, then removes the record.
    let failed = fx.store.get(&scope).await.expect("get").expect("row");
    let reaper = fx.peer.reclaim(&failed, t + Span::seconds(1), TTL, t + Span::hours(1)).await.expect("reclaim");
    let reaper = reaper.expect("failed is reclaimable");
    assert!(matches!(fx.store.remove(&first).await, Err(StoreError::Fenced { generation: 1 })), "superseded");
    assert!(fx.store.get(&scope).await.expect("get").is_some(), "a fenced remove deletes nothing");
    fx.peer.remove(&reaper).await.expect("remove");
    assert!(fx.store.get(&scope).await.expect("get").is_none());
    assert!(matches!(fx.store.remove(&reaper).await, Err(StoreError::Fenced { .. })), "already gone");

    let fresh = owned(&*fx.store, request(&scope, &fp("b"), t + Span::seconds(2))).await;
    assert_ne!(fresh.record().record_id, first.record().record_id);
    assert_eq!(fresh.generation(), 1);
    assert_ne!(fresh.derive("alloc"), first.derive("alloc"), "a new record has new sub-keys");

    // A completed record is final: its claim cannot remove it.
    fx.store.complete(&fresh, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    assert!(matches!(fx.store.remove(&fresh).await, Err(StoreError::Fenced { .. })));
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").state, RecordState::Completed);
    // Other records are untouched by a remove.
    let other = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    let victim = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.store.remove(&victim).await.expect("remove");
    assert!(fx.store.get(other.scope()).await.expect("get").is_some());
}

/// `get` of an unknown scope is `None`; `ping` answers.
pub async fn unknown_scope_is_absent(fx: Fixture) {
    assert!(fx.store.get(&fresh_scope()).await.expect("get").is_none());
    fx.store.ping().await.expect("ping");
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
#[macro_export]
macro_rules! store_conformance_suite {
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
                compressed_and_binary_bodies_round_trip,
                unknown_scope_is_absent,
                reclaim_extends_expiry,
                heartbeat_keeps_a_claim_live,
                heartbeat_is_fenced,
                remove_frees_the_key,
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
