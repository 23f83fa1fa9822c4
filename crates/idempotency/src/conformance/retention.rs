//! The cases about how long a record in flight lives (docs/protocol.md#records): never shorter than a live
//! attempt, whatever the retention, so a key never runs twice because its record expired under
//! a handler that is still running.
//!
//! The claims here are made in the past (a few seconds to minutes before the wall clock), so that
//! a store whose records expire by themselves (Redis: the key's own expiry) has dropped a record
//! that expired at its retention by the time the case looks, as it would in service.

use super::*;

/// A retention shorter than the in-flight TTL, as a caller might configure it.
const SHORT: Span = Span::seconds(2);

/// A claim of `scope` at `at` whose retention is [`SHORT`].
fn short(scope: &Scope, at: Timestamp) -> ClaimRequest {
    ClaimRequest { expires_at: at + SHORT, ..request(scope, &fp("a"), at) }
}

/// A claim whose retention is shorter than the in-flight TTL still lives at least the TTL after
/// its claim: a retry after the retention finds it in flight (the same record, no new owner), and
/// a sweep then leaves it alone.
pub async fn an_in_flight_record_outlives_a_short_retention(fx: Fixture) {
    let t = now() - Span::seconds(3);
    let scope = fresh_scope();
    let first = owned(&*fx.store, short(&scope, t)).await;
    assert_eq!(first.record().expires_at, t + Span::from_std(TTL).expect("TTL"), "claim + TTL, not claim + retention");

    let retry = t + Span::milliseconds(3500);
    let seen = existing(&*fx.peer, short(&scope, retry)).await;
    assert_eq!((seen.record_id, seen.generation, seen.state), (first.record().record_id, 1, RecordState::InFlight));
    assert!(matches!(seen.decide(&fp("a"), retry, TTL), Decision::InProgress { .. }));

    fx.store.sweep_expired(retry, 1000).await.expect("sweep");
    let kept = fx.peer.get(&scope).await.expect("get").expect("a record in flight is not swept under its attempt");
    assert_eq!(kept.record_id, first.record().record_id);
}

/// A heartbeat renews the expiry with the claim: a record in flight expires no earlier than its
/// last renewal plus the TTL, so a handler that runs longer than the retention keeps its record.
pub async fn a_heartbeat_renews_the_expiry_of_an_in_flight_record(fx: Fixture) {
    let ttl = Span::from_std(TTL).expect("TTL");
    let t = now() - Span::seconds(200);
    let scope = fresh_scope();
    let claim = owned(&*fx.store, short(&scope, t)).await;
    let beat = t + Span::seconds(250);
    fx.peer.heartbeat(&claim, Renewal { expires_at: beat + SHORT, ..renewal(beat) }).await.expect("heartbeat");
    let renewed = fx.store.get(&scope).await.expect("get").expect("the record");
    assert_eq!((renewed.started_at, renewed.expires_at), (beat, beat + ttl), "renewed: the last beat + TTL");

    // Past the first claim's TTL and far past its retention: in flight under its renewal.
    let retry = t + Span::seconds(500);
    fx.store.sweep_expired(retry, 1000).await.expect("sweep");
    let seen = existing(&*fx.store, short(&scope, retry)).await;
    assert_eq!((seen.record_id, seen.generation), (claim.record().record_id, 1));
    assert!(matches!(seen.decide(&fp("a"), retry, TTL), Decision::InProgress { .. }));
    fx.store.complete(&claim, &response(201, b"{}"), retry + SHORT).await.expect("the renewed claim completes");
}

/// A reclaim, too, keeps the record at least a TTL past the new attempt's start, whatever the
/// expiry it asks for.
pub async fn a_reclaim_keeps_the_record_for_at_least_the_ttl(fx: Fixture) {
    let ttl = Span::from_std(TTL).expect("TTL");
    let t = now() - Span::seconds(30);
    let scope = fresh_scope();
    let first = owned(&*fx.store, short(&scope, t)).await;
    fx.store.fail(&first).await.expect("fail");
    let failed = fx.peer.get(&scope).await.expect("get").expect("the failed record");
    let at = t + Span::seconds(10);
    let retry = fx
        .peer
        .reclaim(ReclaimRequest { record: &failed, now: at, in_flight_ttl: TTL, expires_at: at + SHORT })
        .await
        .expect("reclaim")
        .expect("a failed record is reclaimed");
    assert_eq!(retry.record().expires_at, at + ttl);
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("the record").expires_at, at + ttl);
}

/// Belt and braces: a record whose expiry passed while its claim is live (it was written with a
/// shorter TTL than the caller's, or by an older version) is not replaced by a claim, nor taken
/// by a reclaim, until the claim goes stale; then the key is free.
pub async fn a_live_claim_is_never_replaced_past_its_expiry(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let written = ClaimRequest {
        in_flight_ttl: Duration::from_secs(1),
        expires_at: t + Span::seconds(30),
        ..request(&scope, &fp("a"), t)
    };
    let first = owned(&*fx.store, written).await;
    assert_eq!(first.record().expires_at, t + Span::seconds(30));
    let past = t + Span::seconds(31);
    let seen = existing(&*fx.peer, request(&scope, &fp("a"), past)).await;
    assert_eq!((seen.record_id, seen.state), (first.record().record_id, RecordState::InFlight));
    let taken = fx
        .peer
        .reclaim(ReclaimRequest { record: &seen, now: past, in_flight_ttl: TTL, expires_at: past + Span::hours(1) })
        .await
        .expect("reclaim");
    assert!(taken.is_none(), "a live claim is not reclaimed");

    let stale = t + Span::from_std(TTL).expect("TTL");
    let next = owned(&*fx.store, request(&scope, &fp("a"), stale)).await;
    assert_ne!(next.record().record_id, first.record().record_id, "expired and stale: the key is free");
}
