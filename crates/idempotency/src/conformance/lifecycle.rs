//! The cases about a record's life: expiry and the sweep, reclaims, heartbeats, removal.

use super::*;

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

/// For a store that sweeps whole days of expiry (UTC) at once, in place of
/// [`expiry_frees_the_key`]: an expired record counts as absent to a claim before any sweep, and
/// a sweep once the record's expiry day has ended removes it; the key is then free.
pub async fn expiry_frees_the_key_by_the_day(fx: Fixture) {
    // Three days ago, so that the records' expiry day has ended by now.
    let t = now() - Span::days(3);
    let (swept, unswept) = (fresh_scope(), fresh_scope());
    let mut first_ids = vec![];
    for scope in [&swept, &unswept] {
        let c = owned(&*fx.store, request(scope, &fp("a"), t)).await;
        fx.store.complete(&c, &response(201, b"old"), t + Span::seconds(60)).await.expect("complete");
        first_ids.push(c.record().record_id);
    }
    existing(&*fx.peer, request(&swept, &fp("a"), t + Span::seconds(59))).await;

    // Expired: absent to a claim before any sweep. The new record lives until tomorrow.
    let at = t + Span::seconds(61);
    let renewed = ClaimRequest { expires_at: now() + Span::days(1), ..request(&unswept, &fp("b"), at) };
    let again = owned(&*fx.peer, renewed).await;
    assert_ne!(again.record().record_id, first_ids[1]);
    assert_eq!(again.generation(), 1);
    assert_ne!(again.derive("alloc"), crate::derive(again.scope(), &first_ids[1], "alloc"));

    let mut n = 0;
    loop {
        let k = fx.store.sweep_expired(now(), 1000).await.expect("sweep");
        n += k;
        if k < 1000 {
            break;
        }
    }
    assert!(n >= 1, "the expired record must be swept once its day has ended");
    assert!(fx.store.get(&swept).await.expect("get").is_none());
    let kept = fx.peer.get(&unswept).await.expect("get").expect("the re-claimed record is live");
    assert_eq!(kept.record_id, again.record().record_id);
    let fresh = owned(&*fx.store, request(&swept, &fp("c"), now())).await;
    assert_ne!(fresh.record().record_id, first_ids[0]);
}

/// For a store that sweeps whole days of expiry (UTC) at once, in place of
/// [`sweep_is_bounded_and_spares_live_records`]: a sweep removes every record whose expiry day
/// has ended, whatever the batch, and never a live record, not even one that expires later
/// today or was completed with a long retention.
pub async fn sweep_drops_ended_days_and_spares_live_records(fx: Fixture) {
    let t = now() - Span::days(3650);
    let live = fresh_scope();
    let c = owned(&*fx.store, request(&live, &fp("a"), t)).await;
    fx.store.complete(&c, &response(201, b"{}"), t + Span::days(36500)).await.expect("complete");
    let soon = fresh_scope();
    let s = owned(&*fx.store, request(&soon, &fp("a"), now())).await;
    fx.store.complete(&s, &response(201, b"{}"), now() + Span::seconds(30)).await.expect("complete");
    let mut expired = vec![];
    for _ in 0..25 {
        let s = fresh_scope();
        let c = owned(&*fx.store, request(&s, &fp("a"), t)).await;
        fx.store.complete(&c, &response(201, b"{}"), t + Span::seconds(1)).await.expect("complete");
        expired.push(s);
    }
    let first = fx.store.sweep_expired(now(), 10).await.expect("sweep");
    assert!(first >= 25, "a whole day goes at once, whatever the batch: {first}");
    for s in &expired {
        assert!(fx.peer.get(s).await.expect("get").is_none());
    }
    for s in [&live, &soon] {
        let kept = fx.peer.get(s).await.expect("get").expect("a live record is kept");
        assert_eq!(kept.state, RecordState::Completed);
    }
}

/// A reclaim moves `expires_at` to at least the new attempt's expiry (never earlier): a retry
/// near the end of the retention window is neither swept nor replaced by a new record while it
/// runs.
pub async fn reclaim_extends_expiry(fx: Fixture) {
    let t = now();
    let retention = Span::hours(1);
    let scope = fresh_scope();
    let first = owned(&*fx.store, ClaimRequest { expires_at: t + retention, ..request(&scope, &fp("a"), t) }).await;
    fx.store.fail(&first).await.expect("fail");
    let old_expiry = t + retention;

    // A retry a minute before the record expires takes it over...
    let at = old_expiry - Span::minutes(1);
    let failed = fx.store.get(&scope).await.expect("get").expect("row");
    let retry = fx
        .peer
        .reclaim(ReclaimRequest { record: &failed, now: at, in_flight_ttl: TTL, expires_at: at + retention })
        .await
        .expect("reclaim")
        .expect("failed is reclaimable");
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
    let again = fx
        .store
        .reclaim(ReclaimRequest { record: &seen, now: stale_at, in_flight_ttl: TTL, expires_at: t })
        .await
        .expect("reclaim")
        .expect("stale is reclaimable");
    assert_eq!(again.record().expires_at, at + retention, "an earlier expiry must not shorten the record's");
    let later = stale_at + Span::seconds(300);
    let third = fx
        .peer
        .reclaim(ReclaimRequest {
            record: again.record(),
            now: later,
            in_flight_ttl: TTL,
            expires_at: later + retention,
        })
        .await
        .expect("reclaim")
        .expect("stale");
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
    fx.peer.heartbeat(&claim, renewal(beat)).await.expect("heartbeat");
    // An older heartbeat (another replica's clock) does not move it back.
    fx.store.heartbeat(&claim, renewal(t + Span::seconds(100))).await.expect("heartbeat");
    let r = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!((r.state, r.generation, r.started_at, r.created_at), (RecordState::InFlight, 1, beat, t));

    let old_stale = t + Span::seconds(300);
    assert_eq!(r.decide(&fp("a"), old_stale, TTL), Decision::InProgress { retry_after: Duration::from_secs(200) });
    // The reclaim compares against the stored started_at, not the caller's copy.
    assert!(
        fx.peer
            .reclaim(ReclaimRequest {
                record: claim.record(),
                now: old_stale,
                in_flight_ttl: TTL,
                expires_at: old_stale
            })
            .await
            .expect("reclaim")
            .is_none()
    );
    assert!(
        fx.peer
            .reclaim(ReclaimRequest { record: &r, now: old_stale, in_flight_ttl: TTL, expires_at: old_stale })
            .await
            .expect("reclaim")
            .is_none(),
        "renewed: not stale"
    );
    // The renewed claim still completes; it goes stale only a TTL after its last heartbeat.
    let next = fx
        .peer
        .reclaim(ReclaimRequest { record: &r, now: beat + Span::seconds(300), in_flight_ttl: TTL, expires_at: beat })
        .await
        .expect("reclaim");
    assert!(next.is_some(), "a TTL after the last heartbeat the claim is stale");
}

/// A heartbeat of a claim that is no longer current is fenced and writes nothing: superseded,
/// completed, failed or gone.
pub async fn heartbeat_is_fenced(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let slow = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let stale = t + Span::seconds(301);
    let newer = fx
        .peer
        .reclaim(ReclaimRequest { record: slow.record(), now: stale, in_flight_ttl: TTL, expires_at: stale })
        .await
        .expect("reclaim")
        .expect("stale");
    let late = fx.store.heartbeat(&slow, renewal(stale + Span::seconds(1))).await;
    assert!(matches!(late, Err(StoreError::Fenced { generation: 1 })), "{late:?}");
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").started_at, stale, "nothing written");
    fx.peer.heartbeat(&newer, renewal(stale + Span::seconds(2))).await.expect("the current claim renews");

    fx.peer.complete(&newer, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    assert!(matches!(
        fx.store.heartbeat(&newer, renewal(stale + Span::seconds(3))).await,
        Err(StoreError::Fenced { .. })
    ));

    let failed = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.store.fail(&failed).await.expect("fail");
    assert!(matches!(fx.store.heartbeat(&failed, renewal(t)).await, Err(StoreError::Fenced { .. })));

    let gone_scope = fresh_scope();
    let gone = owned(&*fx.store, request(&gone_scope, &fp("a"), t)).await;
    fx.store.remove(&gone).await.expect("remove");
    assert!(matches!(fx.store.heartbeat(&gone, renewal(t)).await, Err(StoreError::Fenced { .. })));
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
    let reaper = fx
        .peer
        .reclaim(ReclaimRequest {
            record: &failed,
            now: t + Span::seconds(1),
            in_flight_ttl: TTL,
            expires_at: t + Span::hours(1),
        })
        .await
        .expect("reclaim");
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

/// `count_records` counts a principal's live records, through either handle: not another
/// principal's, not one expired at the time asked, not a key claimed twice. A store that does
/// not count (answers `None`) passes.
pub async fn counts_a_principals_live_records(fx: Fixture) {
    let t = now();
    let (alice, bob) = (unique("alice"), unique("bob"));
    let count = |store: Arc<dyn Store>, who: String, at: Timestamp| async move {
        store.count_records(&Principal::new(who), at).await.expect("count")
    };
    let Some(none) = count(fx.store.clone(), alice.clone(), t).await else { return };
    assert_eq!(none, 0);
    for i in 0..3 {
        owned(&*fx.store, request(&scope_with(&alice, "/v1/workers", &format!("k{i}")), &fp("a"), t)).await;
    }
    owned(&*fx.store, request(&scope_with(&bob, "/v1/workers", "k0"), &fp("a"), t)).await;
    // In flight for a second: its TTL is shorter than that, so it expires with its retention.
    let short = ClaimRequest {
        in_flight_ttl: Duration::from_millis(500),
        expires_at: t + Span::seconds(1),
        ..request(&scope_with(&alice, "/v1/workers", "short"), &fp("a"), t)
    };
    owned(&*fx.store, short).await;
    existing(&*fx.store, request(&scope_with(&alice, "/v1/workers", "k0"), &fp("a"), t)).await;
    assert_eq!(count(fx.store.clone(), alice.clone(), t).await, Some(4));
    assert_eq!(count(fx.peer.clone(), alice.clone(), t).await, Some(4), "the other handle counts the same");
    assert_eq!(count(fx.store.clone(), alice, t + Span::seconds(2)).await, Some(3), "the expired one is not counted");
    assert_eq!(count(fx.peer.clone(), bob, t).await, Some(1));
}

/// `count_records` counts what a principal stores: records completed or in flight. A failed one
/// stored nothing and does not count, nor does a removed or a forgotten one; a failed record
/// taken over counts again while its new attempt lives. Both handles count the same.
pub async fn counts_only_what_a_principal_stores(fx: Fixture) {
    let t = now();
    let alice = unique("alice");
    let count = |store: Arc<dyn Store>| {
        let principal = Principal::new(alice.clone());
        async move { store.count_records(&principal, t).await.expect("count") }
    };
    let Some(none) = count(fx.store.clone()).await else { return };
    assert_eq!(none, 0);
    let claim = |key: &str| owned(&*fx.store, request(&scope_with(&alice, "/v1/workers", key), &fp("a"), t));
    let in_flight = claim("in-flight").await;
    let completed = claim("completed").await;
    fx.store.complete(&completed, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    let failed = claim("failed").await;
    fx.store.fail(&failed).await.expect("fail");
    assert_eq!(count(fx.store.clone()).await, Some(2), "a failed record stored nothing");
    assert_eq!(count(fx.peer.clone()).await, Some(2), "the other handle counts the same");

    // A failed record taken over counts again; failed again, it stops.
    let found = existing(&*fx.peer, request(failed.scope(), &fp("a"), t)).await;
    let reclaim = ReclaimRequest { record: &found, now: t, in_flight_ttl: TTL, expires_at: t + Span::hours(1) };
    let again = fx.peer.reclaim(reclaim).await.expect("reclaim").expect("a failed record is reclaimed");
    assert_eq!(count(fx.store.clone()).await, Some(3), "a live attempt counts");
    fx.peer.fail(&again).await.expect("fail");
    assert_eq!(count(fx.store.clone()).await, Some(2));

    // An attempt that fails, a removed record and a forgotten one count no more.
    fx.store.fail(&in_flight).await.expect("fail");
    let removed = claim("removed").await;
    assert_eq!(count(fx.peer.clone()).await, Some(2));
    fx.store.remove(&removed).await.expect("remove");
    assert_eq!(count(fx.peer.clone()).await, Some(1));
    let forgotten = fx.peer.forget(&completed.record().record_id).await.expect("forget");
    assert!(matches!(forgotten, crate::Forget::Forgotten(_)), "{forgotten:?}");
    assert_eq!(count(fx.store.clone()).await, Some(0));
    assert_eq!(count(fx.peer.clone()).await, Some(0));
}
