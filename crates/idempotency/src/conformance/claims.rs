//! The cases about claims: who owns a key, what a second request sees, fencing, scopes, bodies.

use super::*;

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
    let again = fx
        .store
        .reclaim(ReclaimRequest {
            record: &r,
            now: t + Span::seconds(1),
            in_flight_ttl: TTL,
            expires_at: t + Span::hours(1),
        })
        .await
        .expect("reclaim")
        .expect("reclaimed");
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
    assert!(
        fx.store
            .reclaim(ReclaimRequest { record: &record, now: early, in_flight_ttl: TTL, expires_at: early })
            .await
            .expect("reclaim")
            .is_none(),
        "not stale yet"
    );
    let late = t + Span::seconds(300);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = if i % 2 == 0 { fx.store.clone() } else { fx.peer.clone() };
            let record = record.clone();
            tokio::spawn(async move {
                store.reclaim(ReclaimRequest { record: &record, now: late, in_flight_ttl: TTL, expires_at: late }).await
            })
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
        .reclaim(ReclaimRequest {
            record: slow.record(),
            now: t + Span::seconds(301),
            in_flight_ttl: TTL,
            expires_at: t + Span::hours(1),
        })
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
            .reclaim(ReclaimRequest {
                record: &fx.store.get(&scope).await.expect("get").expect("row"),
                now: t + Span::days(1),
                in_flight_ttl: TTL,
                expires_at: t + Span::days(2)
            })
            .await
            .expect("reclaim")
            .is_none()
    );
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

/// Scopes far longer than a store's index takes (a 64 KiB path, a 3 KiB principal, random hex
/// that does not compress; PostgreSQL refuses btree rows over 2,704 bytes) go through every
/// transition, replay whole, are counted and listed by their principal, and two that differ only
/// in their last character are two records.
pub async fn long_scopes_are_stored_apart(fx: Fixture) {
    let t = now();
    let noise = |bytes: usize| (0..bytes / 32 + 1).map(|_| crate::RecordId::random().to_hex()).collect::<String>();
    let principal = format!("{}-{}", unique("long-principal"), noise(3_000));
    let path = format!("/v1/workers/{}", noise(65_000));
    let key = unique("long-key");
    let key = format!("{key}{}", "k".repeat(crate::MAX_KEY_LEN - key.len()));
    let a = scope_with(&principal, &format!("{path}a"), &key);
    let b = scope_with(&principal, &format!("{path}b"), &key);

    let ca = owned(&*fx.store, request(&a, &fp("a"), t)).await;
    fx.store.heartbeat(&ca, renewal(t + Span::seconds(1))).await.expect("heartbeat");
    fx.store.complete(&ca, &response(201, b"a"), t + Span::hours(1)).await.expect("complete");
    let ra = existing(&*fx.peer, request(&a, &fp("a"), t)).await;
    assert_eq!(ra.scope, a, "the record of a long scope carries that scope whole");
    assert_eq!(ra.decide(&fp("a"), t, TTL), Decision::Replay(response(201, b"a")));

    // Only the last character differs: another record, owned afresh.
    let cb = owned(&*fx.store, request(&b, &fp("b"), t)).await;
    assert_ne!(cb.record().record_id, ca.record().record_id);
    fx.store.fail(&cb).await.expect("fail");
    let rb = existing(&*fx.peer, request(&b, &fp("b"), t)).await;
    assert_eq!(rb.state, RecordState::Failed);
    let cb = fx
        .peer
        .reclaim(ReclaimRequest { record: &rb, now: t, in_flight_ttl: TTL, expires_at: t + Span::hours(1) })
        .await
        .expect("reclaim")
        .expect("a failed record is reclaimed");
    fx.peer.complete(&cb, &response(201, b"b"), t + Span::hours(1)).await.expect("complete");
    for (s, body) in [(&a, b"a"), (&b, b"b")] {
        let r = fx.store.get(s).await.expect("get").expect("the record");
        assert_eq!(r.response.expect("a response").body.decode().expect("decode"), Bytes::copy_from_slice(body));
    }

    if let Some(n) = fx.store.count_records(&a.principal, t).await.expect("count") {
        assert_eq!(n, 2, "both records count for their principal");
    }
    let query = crate::RecordQuery { principal: Some(a.principal.clone()), ..crate::RecordQuery::all(t, 10) };
    let listed = fx.store.list_records(&query).await.expect("list").records;
    assert_eq!(listed.len(), 2, "both records are listed by their principal");
    for r in &listed {
        // A store may keep a long component shortened; the method and the path's start remain.
        assert!(r.scope.endpoint.as_str().starts_with(&format!("POST {}", &path[..500])), "{:.80}", r.scope.endpoint);
        let by_id = fx.store.get_by_id(&r.record_id).await.expect("get by id").expect("found by id");
        assert_eq!(by_id.record_id, r.record_id);
    }
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

/// `get` of an unknown scope is `None`; `ping` answers.
pub async fn unknown_scope_is_absent(fx: Fixture) {
    assert!(fx.store.get(&fresh_scope()).await.expect("get").is_none());
    fx.store.ping().await.expect("ping");
}
