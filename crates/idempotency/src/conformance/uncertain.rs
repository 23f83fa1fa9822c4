//! The cases about the `uncertain` state: a request sent on whose outcome is unknown. It is never
//! run again on a guess (no TTL, no `reclaim`); it leaves that state only by a take-over
//! (exactly one winner), a resolution, a forget or its expiry.

use super::*;
use crate::{Claim, Forget, Record, RecordQuery, Resolve};

/// A reclaim-style request on `record` at `at`, with a day's retention.
fn on(record: &Record, at: Timestamp) -> ReclaimRequest<'_> {
    ReclaimRequest { record, now: at, in_flight_ttl: TTL, expires_at: at + Span::hours(24) }
}

/// A new key claimed at `t` and marked uncertain by its own claim.
async fn uncertain_record(store: &dyn Store, t: Timestamp) -> (Claim, Record) {
    let scope = fresh_scope();
    let claim = owned(store, request(&scope, &fp("a"), t)).await;
    store.mark_uncertain(&claim).await.expect("mark uncertain");
    let record = store.get(&scope).await.expect("get").expect("the record");
    (claim, record)
}

/// `mark_uncertain` by the current claim: uncertain, same generation, the expiry kept (at least
/// the retention); the claim can no longer complete, fail, renew or remove it; the next claim
/// gets it back as an existing record, and a different request with its key is a mismatch.
pub async fn mark_uncertain_keeps_the_record(fx: Fixture) {
    let t = now();
    let (claim, r) = uncertain_record(&*fx.store, t).await;
    assert_eq!(r.state, RecordState::Uncertain);
    assert_eq!((r.generation, r.record_id), (1, claim.record().record_id));
    assert_eq!(r.expires_at, claim.record().expires_at, "the expiry stays the retention's");
    assert!(r.response.is_none());
    let late = t + Span::seconds(10);
    let seen = existing(&*fx.peer, request(&r.scope, &fp("a"), late)).await;
    assert_eq!(seen, r);
    assert_eq!(seen.decide(&fp("a"), late, TTL), Decision::Uncertain);
    let other = existing(&*fx.peer, request(&r.scope, &fp("b"), late)).await;
    assert_eq!(other.decide(&fp("b"), late, TTL), Decision::Mismatch);
    for (what, result) in [
        ("complete", fx.store.complete(&claim, &response(201, b"{}"), t + Span::hours(1)).await),
        ("fail", fx.store.fail(&claim).await),
        ("heartbeat", fx.store.heartbeat(&claim, renewal(late)).await),
        ("mark_uncertain", fx.store.mark_uncertain(&claim).await),
        ("remove", fx.store.remove(&claim).await),
    ] {
        assert!(
            matches!(result, Err(StoreError::Fenced { generation: 1 })),
            "{what} on an uncertain record: {result:?}"
        );
    }
    assert_eq!(fx.store.get(&r.scope).await.expect("get").expect("kept"), r, "nothing was written");
}

/// An uncertain record is not reclaimed after its TTL: a claim long after the in-flight TTL
/// (but before the expiry) gets it back unchanged, and neither `reclaim` nor
/// `mark_stale_uncertain` takes it.
pub async fn an_uncertain_record_is_not_reclaimed_after_its_ttl(fx: Fixture) {
    let t = now();
    let (_, r) = uncertain_record(&*fx.store, t).await;
    let later = t + Span::hours(23);
    let seen = existing(&*fx.peer, request(&r.scope, &fp("a"), later)).await;
    assert_eq!((seen.state, seen.generation), (RecordState::Uncertain, 1));
    assert_eq!(seen.decide(&fp("a"), later, TTL), Decision::Uncertain);
    assert!(fx.peer.reclaim(on(&seen, later)).await.expect("reclaim").is_none(), "reclaim must not take it");
    assert!(fx.peer.mark_stale_uncertain(on(&seen, later)).await.expect("mark").is_none());
    assert_eq!(fx.store.get(&r.scope).await.expect("get").expect("kept"), r);
}

/// `mark_uncertain` by a claim that was superseded (its record re-claimed by a newer attempt) is
/// fenced and writes nothing; so is one on a completed or failed record.
pub async fn mark_uncertain_is_fenced(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let old = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let newer = fx.peer.reclaim(on(old.record(), t + Span::seconds(300))).await.expect("reclaim").expect("stale");
    let late = fx.store.mark_uncertain(&old).await;
    assert!(matches!(late, Err(StoreError::Fenced { generation: 1 })), "{late:?}");
    let r = fx.store.get(&scope).await.expect("get").expect("row");
    assert_eq!((r.state, r.generation), (RecordState::InFlight, 2));
    fx.peer.complete(&newer, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete");
    assert!(matches!(fx.store.mark_uncertain(&newer).await, Err(StoreError::Fenced { generation: 2 })));
    let failed = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.store.fail(&failed).await.expect("fail");
    assert!(matches!(fx.store.mark_uncertain(&failed).await, Err(StoreError::Fenced { .. })));
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("row").state, RecordState::Completed);
}

/// 32 tasks race to turn one stale in-flight record uncertain: exactly one wins, the record keeps
/// its generation, and nothing can reclaim it after. A live claim, a failed record and a stale
/// record read at an older generation are not taken.
pub async fn stale_in_flight_becomes_uncertain_with_one_winner(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let claim = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let read = claim.record().clone();
    let early = t + Span::seconds(299);
    assert!(fx.store.mark_stale_uncertain(on(&read, early)).await.expect("mark").is_none(), "not stale yet");
    let late = t + Span::seconds(300);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = if i % 2 == 0 { fx.store.clone() } else { fx.peer.clone() };
            let read = read.clone();
            tokio::spawn(async move { store.mark_stale_uncertain(on(&read, late)).await })
        })
        .collect();
    let winners: Vec<Record> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .filter_map(|r| r.expect("task").expect("mark stale uncertain"))
        .collect();
    assert_eq!(winners.len(), 1, "exactly one concurrent stale -> uncertain must win");
    let won = &winners[0];
    assert_eq!((won.state, won.generation, won.record_id), (RecordState::Uncertain, 1, read.record_id));
    assert!(won.expires_at >= late + Span::hours(24), "the expiry is at least the caller's retention");
    assert_eq!(&fx.store.get(&scope).await.expect("get").expect("row"), won);
    assert!(fx.store.reclaim(on(won, late + Span::hours(1))).await.expect("reclaim").is_none());
    assert!(matches!(fx.store.complete(&claim, &response(201, b"{}"), late).await, Err(StoreError::Fenced { .. })));

    let failed = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.store.fail(&failed).await.expect("fail");
    let failed = fx.store.get(failed.scope()).await.expect("get").expect("row");
    assert!(fx.store.mark_stale_uncertain(on(&failed, late)).await.expect("mark").is_none(), "failed is not stale");
    // Read before a reclaim took it over: the generation no longer matches.
    let old = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    fx.peer.reclaim(on(old.record(), late)).await.expect("reclaim").expect("stale");
    let much_later = late + Span::seconds(600);
    assert!(fx.store.mark_stale_uncertain(on(old.record(), much_later)).await.expect("mark").is_none());
}

/// 32 tasks race to take over one uncertain record: exactly one owns it, in flight under the next
/// generation from its `now`, with the record's id (so the same sub-keys); it can complete, and
/// the old claim stays fenced. Records in other states are not taken over.
pub async fn take_over_of_an_uncertain_record_has_one_owner(fx: Fixture) {
    let t = now();
    let (first, r) = uncertain_record(&*fx.store, t).await;
    let at = t + Span::seconds(5);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = if i % 2 == 0 { fx.store.clone() } else { fx.peer.clone() };
            let r = r.clone();
            tokio::spawn(async move { store.take_over_uncertain(on(&r, at)).await })
        })
        .collect();
    let owners: Vec<Claim> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .filter_map(|r| r.expect("task").expect("take over"))
        .collect();
    assert_eq!(owners.len(), 1, "exactly one of 32 concurrent take-overs must own the record");
    let claim = &owners[0];
    let got = claim.record();
    assert_eq!((got.state, got.generation, got.record_id), (RecordState::InFlight, 2, r.record_id));
    assert_eq!((got.started_at, got.created_at), (at, t));
    assert!(got.expires_at >= at + Span::hours(24));
    assert_eq!(claim.derive("send"), first.derive("send"), "the same record, the same sub-keys");
    assert!(matches!(fx.store.complete(&first, &response(201, b"old"), at).await, Err(StoreError::Fenced { .. })));
    fx.peer.complete(claim, &response(201, b"again"), at + Span::hours(24)).await.expect("complete");
    let done = fx.store.get(&r.scope).await.expect("get").expect("row");
    assert_eq!(done.decide(&fp("a"), at, TTL), Decision::Replay(response(201, b"again")));
    assert!(fx.store.take_over_uncertain(on(&done, at)).await.expect("take over").is_none(), "completed");

    let flying = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    let stale = t + Span::hours(1);
    assert!(fx.store.take_over_uncertain(on(flying.record(), stale)).await.expect("take over").is_none());
    fx.store.fail(&flying).await.expect("fail");
    let failed = fx.store.get(flying.scope()).await.expect("get").expect("row");
    assert!(fx.store.take_over_uncertain(on(&failed, stale)).await.expect("take over").is_none());
}

/// `resolve` completes an uncertain record with the response given (every retry replays it) and
/// its expiry; a record in any other state is left as it is and reported with its state; an
/// unknown id is absent.
pub async fn resolve_completes_only_an_uncertain_record(fx: Fixture) {
    let t = now();
    let (_, r) = uncertain_record(&*fx.store, t).await;
    let resp = response(201, br#"{"id":"order-1"}"#);
    let until = t + Span::hours(48);
    match fx.peer.resolve(&r.record_id, &resp, until).await.expect("resolve") {
        Resolve::Resolved(done) => {
            assert_eq!((done.state, done.record_id, done.expires_at), (RecordState::Completed, r.record_id, until));
            assert_eq!(done.response.as_ref(), Some(&resp));
        }
        other => panic!("expected the record resolved, got {other:?}"),
    }
    let seen = existing(&*fx.store, request(&r.scope, &fp("a"), t + Span::seconds(1))).await;
    assert_eq!(seen.decide(&fp("a"), t, TTL), Decision::Replay(resp.clone()));
    match fx.store.resolve(&r.record_id, &response(200, b"other"), until).await.expect("resolve") {
        Resolve::NotUncertain(kept) => assert_eq!(kept.response.as_ref(), Some(&resp), "a completed record is final"),
        other => panic!("expected NotUncertain, got {other:?}"),
    }
    let flying = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    match fx.store.resolve(&flying.record().record_id, &resp, until).await.expect("resolve") {
        Resolve::NotUncertain(kept) => assert_eq!(kept.state, RecordState::InFlight),
        other => panic!("expected NotUncertain, got {other:?}"),
    }
    let unknown = crate::RecordId::random();
    assert_eq!(fx.store.resolve(&unknown, &resp, until).await.expect("resolve"), Resolve::Absent);
}

/// `forget` frees an uncertain record (an operator's "it did not happen"): the key's next claim
/// owns a new record.
pub async fn forget_frees_an_uncertain_record(fx: Fixture) {
    let t = now();
    let (_, r) = uncertain_record(&*fx.store, t).await;
    match fx.peer.forget(&r.record_id).await.expect("forget") {
        Forget::Forgotten(gone) => assert_eq!(gone.state, RecordState::Uncertain),
        other => panic!("expected the uncertain record forgotten, got {other:?}"),
    }
    let again = owned(&*fx.store, request(&r.scope, &fp("a"), t + Span::seconds(1))).await;
    assert_ne!(again.record().record_id, r.record_id);
}

/// The listing's state filter finds uncertain records, and they count as live for their
/// principal (a failed one does not).
pub async fn uncertain_records_are_listed_and_counted(fx: Fixture) {
    let t = now();
    let principal = unique("unsure");
    let mut claims = vec![];
    for _ in 0..3 {
        let scope = scope_with(&principal, "/v1/orders", &unique("key"));
        claims.push(owned(&*fx.store, request(&scope, &fp("a"), t)).await);
    }
    fx.store.mark_uncertain(&claims[0]).await.expect("mark uncertain");
    fx.store.fail(&claims[1]).await.expect("fail");
    let query = RecordQuery {
        state: Some(RecordState::Uncertain),
        principal: Some(Principal::new(principal.as_str())),
        ..RecordQuery::all(t, 10)
    };
    let listed = fx.peer.list_records(&query).await.expect("list").records;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].record_id, listed[0].state), (claims[0].record().record_id, RecordState::Uncertain));
    if let Some(n) = fx.store.count_records(&Principal::new(principal.as_str()), t).await.expect("count") {
        assert_eq!(n, 2, "the uncertain and the in-flight record count; the failed one does not");
    }
}
