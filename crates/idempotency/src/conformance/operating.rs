//! The cases about operating a store: listing records a page at a time, reading one by its id,
//! forgetting one. Every case lists only its own principals' records (other tests may share
//! the store).

use std::collections::HashSet;

use super::*;
use crate::{Forget, RecordId, RecordQuery};

fn by_principal(principal: &str, now: Timestamp, limit: u32) -> RecordQuery {
    RecordQuery { principal: Some(Principal::new(principal)), ..RecordQuery::all(now, limit) }
}

/// Every page of `query` in turn, checking that no page is larger than its limit.
async fn every_page(store: &dyn Store, mut query: RecordQuery) -> Vec<crate::Record> {
    let mut all = vec![];
    for _ in 0..10_000 {
        let page = store.list_records(&query).await.expect("list");
        assert!(page.records.len() <= query.page_size(), "a page holds at most its limit");
        all.extend(page.records);
        match page.next_cursor {
            Some(c) => query.cursor = Some(c),
            None => return all,
        }
    }
    panic!("the listing never ended");
}

/// Pages of any size together list every live record exactly once, and no expired one.
pub async fn listing_pages_through_every_live_record(fx: Fixture) {
    let t = now();
    let principal = unique("lister");
    let mut live = HashSet::new();
    for i in 0..11 {
        let scope = scope_with(&principal, "/v1/workers", &unique("key"));
        let c = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
        match i % 3 {
            0 => fx.store.complete(&c, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete"),
            1 => fx.store.fail(&c).await.expect("fail"),
            _ => {}
        }
        live.insert(c.record().record_id);
    }
    // Created a day ago, expired an hour ago: not listed.
    let old = scope_with(&principal, "/v1/workers", &unique("key"));
    let gone = owned(&*fx.store, request(&old, &fp("a"), t - Span::hours(25))).await.record().record_id;

    for limit in [1, 4, 11, 500] {
        let listed = every_page(&*fx.peer, by_principal(&principal, t, limit)).await;
        let ids: Vec<RecordId> = listed.iter().map(|r| r.record_id).collect();
        let unique_ids: HashSet<RecordId> = ids.iter().copied().collect();
        assert_eq!(ids.len(), unique_ids.len(), "limit {limit}: a record on two pages");
        assert_eq!(unique_ids, live, "limit {limit}: every live record, no expired one");
        assert!(!unique_ids.contains(&gone));
    }
    // Without a filter the listing holds them too (among other tests' records).
    let all: HashSet<RecordId> =
        every_page(&*fx.store, RecordQuery::all(t, 1000)).await.iter().map(|r| r.record_id).collect();
    assert!(live.is_subset(&all));
    // A listed record is the whole record.
    let one = fx.store.list_records(&by_principal(&principal, t, 1)).await.expect("list").records;
    let got = fx.store.get(&one[0].scope).await.expect("get").expect("row");
    assert_eq!(one[0], got);
}

/// The state, principal and age filters each narrow the listing, and combine.
pub async fn listing_filters_by_state_principal_and_age(fx: Fixture) {
    let t = now();
    let (a, b) = (unique("tenant-a"), unique("tenant-b"));
    let mut ids = std::collections::HashMap::new();
    // (principal, started, final state)
    for (name, principal, started, state) in [
        ("a-old-flight", &a, t - Span::hours(2), RecordState::InFlight),
        ("a-new-flight", &a, t, RecordState::InFlight),
        ("a-old-done", &a, t - Span::hours(2), RecordState::Completed),
        ("a-new-failed", &a, t, RecordState::Failed),
        ("b-old-flight", &b, t - Span::hours(2), RecordState::InFlight),
    ] {
        let scope = scope_with(principal, "/v1/workers", &unique("key"));
        let c = owned(&*fx.store, request(&scope, &fp("a"), started)).await;
        match state {
            RecordState::Completed => {
                fx.store.complete(&c, &response(201, b"{}"), t + Span::hours(1)).await.expect("complete")
            }
            RecordState::Failed => fx.store.fail(&c).await.expect("fail"),
            RecordState::Uncertain => fx.store.mark_uncertain(&c).await.expect("mark uncertain"),
            RecordState::InFlight => {}
        }
        ids.insert(name, c.record().record_id);
    }
    let names = |records: Vec<crate::Record>| -> HashSet<&str> {
        records.iter().map(|r| *ids.iter().find(|(_, id)| **id == r.record_id).expect("one of ours").0).collect()
    };
    let query = |principal: &str| by_principal(principal, t, 100);
    let set = |v: &[&'static str]| v.iter().copied().collect::<HashSet<&str>>();

    assert_eq!(
        names(every_page(&*fx.store, query(&a)).await),
        set(&["a-old-flight", "a-new-flight", "a-old-done", "a-new-failed"])
    );
    assert_eq!(names(every_page(&*fx.store, query(&b)).await), set(&["b-old-flight"]));
    let in_flight = RecordQuery { state: Some(RecordState::InFlight), ..query(&a) };
    assert_eq!(names(every_page(&*fx.store, in_flight.clone()).await), set(&["a-old-flight", "a-new-flight"]));
    let failed = RecordQuery { state: Some(RecordState::Failed), ..query(&a) };
    assert_eq!(names(every_page(&*fx.store, failed).await), set(&["a-new-failed"]));
    let completed = RecordQuery { state: Some(RecordState::Completed), ..query(&a) };
    assert_eq!(names(every_page(&*fx.store, completed).await), set(&["a-old-done"]));
    let stuck = RecordQuery { started_before: Some(t - Span::hours(1)), ..in_flight };
    assert_eq!(names(every_page(&*fx.store, stuck).await), set(&["a-old-flight"]));
    let old = RecordQuery { started_before: Some(t - Span::hours(1)), ..query(&a) };
    assert_eq!(names(every_page(&*fx.store, old).await), set(&["a-old-flight", "a-old-done"]));
    let nobody = query(&unique("nobody"));
    let page = fx.store.list_records(&nobody).await.expect("list");
    assert!(page.records.is_empty() && page.next_cursor.is_none());
}

/// A record is found by its id, from either handle; an unknown id is absent.
pub async fn records_are_found_by_id(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let c = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    fx.store.complete(&c, &response(201, b"{\"id\":1}"), t + Span::hours(1)).await.expect("complete");
    let by_scope = fx.store.get(&scope).await.expect("get").expect("row");
    let by_id = fx.peer.get_by_id(&c.record().record_id).await.expect("get by id").expect("found");
    assert_eq!(by_id, by_scope);
    assert_eq!(by_id.response.expect("response").body.decode().expect("body").as_ref(), b"{\"id\":1}");
    assert!(fx.store.get_by_id(&RecordId::random()).await.expect("get by id").is_none());
}

/// Forget deletes a completed or failed record and frees its key (a new claim owns it, with a
/// new record id); an in-flight record is left alone; an unknown id is absent.
pub async fn forget_spares_in_flight_and_frees_the_key(fx: Fixture) {
    let t = now();
    let scope = fresh_scope();
    let c = owned(&*fx.store, request(&scope, &fp("a"), t)).await;
    let id = c.record().record_id;
    match fx.peer.forget(&id).await.expect("forget") {
        Forget::InFlight(r) => assert_eq!(r.record_id, id),
        other => panic!("an in-flight record is not forgotten: {other:?}"),
    }
    assert_eq!(fx.store.get(&scope).await.expect("get").expect("still there").state, RecordState::InFlight);
    fx.store.complete(&c, &response(201, b"{}"), t + Span::hours(1)).await.expect("the claim still completes");

    match fx.peer.forget(&id).await.expect("forget") {
        Forget::Forgotten(r) => assert_eq!((r.record_id, r.state), (id, RecordState::Completed)),
        other => panic!("a completed record is forgotten: {other:?}"),
    }
    assert!(fx.store.get(&scope).await.expect("get").is_none());
    assert!(fx.store.get_by_id(&id).await.expect("get by id").is_none());
    assert_eq!(fx.store.forget(&id).await.expect("forget again"), Forget::Absent);
    let again = owned(&*fx.store, request(&scope, &fp("a"), t + Span::seconds(1))).await;
    assert_ne!(again.record().record_id, id, "the key runs as a new operation");

    fx.store.fail(&again).await.expect("fail");
    let other = owned(&*fx.store, request(&fresh_scope(), &fp("a"), t)).await;
    assert!(matches!(fx.store.forget(&again.record().record_id).await.expect("forget"), Forget::Forgotten(_)));
    assert!(fx.store.get(other.scope()).await.expect("get").is_some(), "other records are untouched");
}

/// A cursor the store did not make is refused, not taken for the start.
pub async fn foreign_cursor_is_refused(fx: Fixture) {
    for cursor in ["not-a-cursor", "", "zz", "../../etc"] {
        let query = RecordQuery { cursor: Some(cursor.to_owned()), ..RecordQuery::all(now(), 10) };
        let got = fx.store.list_records(&query).await;
        assert!(matches!(got, Err(StoreError::InvalidCursor)), "{cursor:?}: {got:?}");
    }
}
