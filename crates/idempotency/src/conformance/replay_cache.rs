//! The [`ReplayCache`](crate::ReplayCache) over a store that announces its changes, with two
//! replicas: not a case of the suite (a store without announcements gets no cache), but a test
//! each announcing store runs ([`replay_cache_is_coherent_across_replicas`]).

use super::*;
use crate::{DEFAULT_REPLAY_CACHE_BYTES, Forget, ReplayCache};

/// How long a forget on one replica may take to reach another's cache.
pub const INVALIDATION_BOUND: Duration = Duration::from_secs(1);

/// Waits until `cache`'s store hears its announcements (its listener connects in the
/// background), at most 30 s.
async fn listening(store: &Arc<dyn Store>) {
    let changes = store.changes().expect("a store that announces its changes");
    for _ in 0..300 {
        if changes.is_listening() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the store never listened for its announcements");
}

/// Each replica behind its own cache: replays of a completed record on one are answered from
/// its copy (at most two store reads for a hundred replays), and a forget on the other reaches that copy
/// within [`INVALIDATION_BOUND`]: the key then runs again there, as a new record.
pub async fn replay_cache_is_coherent_across_replicas(fx: Fixture) {
    let (a, b) = (fx.store.clone(), fx.peer.clone());
    let cached_a = ReplayCache::new(a.clone(), DEFAULT_REPLAY_CACHE_BYTES);
    let cached_b = ReplayCache::new(b.clone(), DEFAULT_REPLAY_CACHE_BYTES);
    listening(&a).await;
    listening(&b).await;

    let t = now();
    let scope = fresh_scope();
    let claim = owned(&cached_a, request(&scope, &fp("a"), t)).await;
    cached_a.complete(&claim, &response(201, b"{\"id\":1}"), t + Span::hours(1)).await.expect("complete");
    for _ in 0..100 {
        let r = existing(&cached_b, request(&scope, &fp("a"), t)).await;
        assert_eq!((r.record_id, r.state), (claim.record().record_id, RecordState::Completed));
    }
    // The first replay reads the store; so may the one after the completion's own announcement
    // reached the replica (an announcement names a record, not what happened to it).
    assert!(cached_b.hits() >= 98, "{} of 100 replays from the copy", cached_b.hits());

    match cached_a.forget(&claim.record().record_id).await.expect("forget") {
        Forget::Forgotten(r) => assert_eq!(r.record_id, claim.record().record_id),
        other => panic!("a completed record is forgotten: {other:?}"),
    }
    tokio::time::sleep(INVALIDATION_BOUND).await;
    let again = owned(&cached_b, request(&scope, &fp("a"), t + Span::seconds(1))).await;
    assert_ne!(again.record().record_id, claim.record().record_id, "the key runs as a new operation");
    assert!(cached_b.is_empty(), "no copy of the forgotten record is left");
}
