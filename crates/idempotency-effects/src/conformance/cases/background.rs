//! The cases of the background work: the reaper, the inventory sweep, the watcher, the marks.
//! Each takes a fresh [`Fixture`] and counts side effects on a [`Downstream`].

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use idempotency::ReclaimRequest;

use super::super::{Downstream, Fixture, Gated, SETTLE, Step, effects, fresh_op, wait_out_settle};
use super::{mark_of, reaper_config};
use crate::{
    Effect, EffectError, Effects, IntentState, InventorySweep, Ledger, Mark, Outcome, Reaper, ReaperConfig, Watcher,
    now_micros,
};

/// Abandoned operations whose calls landed; on one replica the reaper ticks while on the other
/// the clients retry, all at once. Per operation: either the retry adopted the resource and the
/// operation finished, or the reaper undid it and the operation is rolled back. Never both,
/// never a second send.
pub async fn the_reaper_and_retries_on_two_replicas_never_both_act(f: Fixture) {
    const N: usize = 16;
    let ds = Arc::new(Downstream::new("thing", false));
    let mut ops = Vec::new();
    for _ in 0..N {
        let (claim, op) = fresh_op(&*f.store, "create").await;
        let r = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await;
        assert!(r.is_err());
        f.store.fail(&claim).await.unwrap();
        ops.push(op);
    }
    wait_out_settle().await;
    let reaper = Reaper::new(f.ledger.clone(), f.store.clone(), vec![ds.clone() as Arc<dyn Effect>], reaper_config());
    let reaping = {
        let (reaper, ledger, ops) = (reaper.clone(), f.ledger.clone(), ops.clone());
        tokio::spawn(async move {
            let mut rolled_back = 0;
            for _ in 0..200 {
                rolled_back += reaper.tick().await.expect("tick").rolled_back;
                let mut open = 0;
                for op in &ops {
                    if !matches!(mark_of(&*ledger, op.id()).await, Some(Mark::RolledBack | Mark::Finished)) {
                        open += 1;
                    }
                }
                if open == 0 {
                    return rolled_back;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("the reaper never settled every operation");
        })
    };
    let retries = ops.iter().map(|op| {
        let (op, ds, store, peer) = (op.clone(), ds.clone(), f.store_peer.clone(), f.peer.clone());
        tokio::spawn(async move {
            let record = store.get(op.scope()).await.unwrap()?;
            let now = idempotency::now();
            let claim = store
                .reclaim(ReclaimRequest {
                    record: &record,
                    now,
                    in_flight_ttl: Duration::from_secs(1),
                    expires_at: now + chrono::Duration::hours(1),
                })
                .await
                .unwrap()?;
            let attempt = Effects::new(peer).settle(SETTLE).attempt(&op);
            let ran = attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
            let ran = match ran {
                Ok(outcome) => attempt.finish().await.map(|()| outcome),
                Err(e) => Err(e),
            };
            match &ran {
                Ok(_) => {
                    let response = idempotency::StoredResponse {
                        status: 201,
                        headers: vec![],
                        body: idempotency::StoredBody::encode(bytes::Bytes::from_static(b"ok"), 1024),
                    };
                    store.complete(&claim, &response, now + chrono::Duration::hours(1)).await.unwrap();
                }
                Err(_) => {
                    let _ = store.fail(&claim).await;
                }
            }
            Some(ran)
        })
    });
    let retried: Vec<_> = join_all(retries).await.into_iter().map(|r| r.expect("task")).collect();
    let rolled_back = reaping.await.expect("reaper task");
    let mut finished = 0;
    for (op, retry) in ops.iter().zip(&retried) {
        let tag = op.derive("thing").to_string();
        match mark_of(&*f.ledger, op.id()).await {
            Some(Mark::Finished) => {
                finished += 1;
                let Some(Ok(outcome)) = retry else { panic!("finished without a successful retry: {retry:?}") };
                assert_eq!(ds.with_tag(&tag), vec![outcome.id().to_owned()], "the adopted resource stays");
            }
            Some(Mark::RolledBack) => {
                assert!(!matches!(retry, Some(Ok(_))), "a retry succeeded on a rolled-back operation: {retry:?}");
                assert!(ds.with_tag(&tag).is_empty(), "a rolled-back operation leaves nothing downstream");
            }
            other => panic!("operation left {other:?}"),
        }
    }
    assert_eq!(finished + rolled_back as usize, N, "every operation ended one way");
    assert_eq!(ds.sends(), N as u64, "no operation was sent twice");
}

/// A retry whose claim went stale is held right before it adopts what the first call made; the
/// reaper takes the stale record and rolls the operation back (undoing the resource); the retry
/// wakes. It adopts nothing and answers RolledBack: no success names a resource that is gone.
pub async fn a_retry_held_at_adoption_while_the_reaper_rolls_back_adopts_nothing(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (claim, op) = fresh_op(&*f.store, "create").await;
    let first = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    f.store.fail(&claim).await.unwrap();
    wait_out_settle().await;
    // The retry takes the record, then stalls at the adoption until its claim is stale.
    let record = f.store_peer.get(op.scope()).await.unwrap().expect("record");
    let now = idempotency::now();
    let retry_claim = f
        .store_peer
        .reclaim(ReclaimRequest {
            record: &record,
            now,
            in_flight_ttl: Duration::from_secs(1),
            expires_at: now + chrono::Duration::hours(1),
        })
        .await;
    assert!(retry_claim.unwrap().is_some(), "the retry holds the record");
    let gated = Gated::new(f.peer.clone(), Step::Adopt);
    let retry = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await
        })
    };
    gated.reached().await;
    let reaper = Reaper::new(f.ledger.clone(), f.store.clone(), vec![ds.clone() as Arc<dyn Effect>], reaper_config());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while mark_of(&*f.ledger, op.id()).await != Some(Mark::RolledBack) {
        assert!(tokio::time::Instant::now() < deadline, "the reaper never took the stale claim");
        // Everything else is put off; this row is looked at again at once.
        f.ledger.put_off(op.id(), 0).await.unwrap();
        reaper.tick().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ds.count(), 0, "the reaper undid the landed call");
    gated.release();
    let woke = retry.await.expect("task");
    assert!(matches!(woke, Err(EffectError::RolledBack)), "{woke:?}");
    assert_eq!((ds.sends(), ds.count()), (1, 0));
    let finish = effects(&f.peer).attempt(&op).finish().await;
    assert!(matches!(finish, Err(EffectError::RolledBack)), "{finish:?}");
}

/// The reaper leaves alone an operation whose record a live attempt holds, and an abandoned one
/// whose last call may still land (inside the settle window): it rolls back only after both.
pub async fn the_reaper_waits_for_a_live_claim_and_the_settle_window(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (claim, op) = fresh_op(&*f.store, "create").await;
    let r = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await;
    assert!(matches!(r, Err(EffectError::Ambiguous(_))), "{r:?}");
    let released = Arc::new(Released::default());
    let reaper = Reaper::new(
        f.peer.clone(),
        f.store_peer.clone(),
        vec![ds.clone() as Arc<dyn Effect>],
        ReaperConfig { in_flight_ttl: Duration::from_secs(3600), ..reaper_config() },
    )
    .service(released.clone());
    // Held by a live claim (its TTL is an hour): put off, nothing undone.
    f.ledger.put_off(op.id(), 0).await.unwrap();
    let pass = reaper.tick().await.unwrap();
    assert_eq!((pass.examined, pass.waiting, pass.rolled_back), (1, 1, 0), "{pass:?}");
    let row = f.ledger.operation(op.id()).await.unwrap().unwrap();
    assert!(row.next_check_at > now_micros(), "put off until the claim may go stale");
    // The handler failed: abandoned (abandon time zero), but its call was sent just now.
    f.store.fail(&claim).await.unwrap();
    f.ledger.put_off(op.id(), 0).await.unwrap();
    let pass = reaper.tick().await.unwrap();
    assert_eq!((pass.waiting, pass.rolled_back), (1, 0), "inside the settle window: {pass:?}");
    assert_eq!(ds.count(), 1, "nothing undone while a call may still land");
    assert_eq!(mark_of(&*f.ledger, op.id()).await, Some(Mark::Live), "not taken either");
    let row = f.ledger.operation(op.id()).await.unwrap().unwrap();
    let intents = f.ledger.intents(op.id()).await.unwrap();
    assert_eq!(row.next_check_at, intents[0].sent_at + crate::micros(SETTLE), "put off to the end of the window");
    wait_out_settle().await;
    let pass = reaper.tick().await.unwrap();
    assert_eq!((pass.rolled_back, pass.undone), (1, 1), "{pass:?}");
    assert_eq!(ds.count(), 0);
    assert_eq!(
        released.0.lock().unwrap().as_slice(),
        [op.id().to_owned()],
        "the service released once, on the rollback"
    );
}

/// A service's compensation that records which operations it released.
#[derive(Debug, Default)]
struct Released(std::sync::Mutex<Vec<String>>);

#[async_trait::async_trait]
impl crate::Abandoned for Released {
    async fn release(&self, op: &crate::OperationRow) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.lock().unwrap().push(op.op_id.clone());
        Ok(())
    }
}

/// Downstream: a finished operation's resource (kept), a duplicate that landed after it
/// finished, a live operation's pending call that landed, and a call that landed after its
/// operation was rolled back. The sweep undoes the duplicate and the late landing, once.
pub async fn the_inventory_sweep_undoes_orphans_only(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let all: Vec<Arc<dyn Effect>> = vec![ds.clone()];
    // Finished, kept.
    let (_c, finished) = fresh_op(&*f.store, "create").await;
    let a = effects(&f.ledger).attempt(&finished);
    let kept = a.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    a.finish().await.unwrap();
    // Live, its call landed but its answer was lost.
    let (_c, live) = fresh_op(&*f.store, "create").await;
    assert!(effects(&f.ledger).attempt(&live).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await.is_err());
    // Rolled back (nothing had landed), then its call lands.
    let (claim, gone) = fresh_op(&*f.store, "create").await;
    assert!(effects(&f.ledger).attempt(&gone).run(&*ds, |t| async { ds.send_dropped(t) }).await.is_err());
    f.store.fail(&claim).await.unwrap();
    wait_out_settle().await;
    // Only `gone` is looked at (the others are put off): it is abandoned.
    let eager = Reaper::new(f.ledger.clone(), f.store.clone(), all.clone(), reaper_config());
    let mut rolled = false;
    for _ in 0..3 {
        f.ledger.put_off(gone.id(), 0).await.unwrap();
        let _ = eager_only(&eager, &*f.ledger, gone.id()).await;
        if mark_of(&*f.ledger, gone.id()).await == Some(Mark::RolledBack) {
            rolled = true;
            break;
        }
    }
    assert!(rolled, "the abandoned operation is rolled back");
    let late = ds.land(&gone.derive("thing").to_string());
    let duplicate = ds.land(&finished.derive("thing").to_string());
    // Another service's, on the same downstream: a tag this ledger never issued.
    let foreign = ds.land("sk-issued-by-another-service");
    let sweep = InventorySweep::new(f.peer.clone(), all, SETTLE);
    let swept = sweep.sweep().await.unwrap();
    assert_eq!((swept.listed, swept.undone, swept.foreign), (5, 2, 1), "{swept:?}");
    let mut left: Vec<String> = ds.list(crate::TAG_PREFIX).await.unwrap().into_iter().map(|t| t.id).collect();
    left.sort();
    assert!(left.contains(&kept.id().to_owned()) && !left.contains(&late) && !left.contains(&duplicate), "{left:?}");
    assert!(left.contains(&foreign), "another service's resource was undone: {left:?}");
    assert_eq!(sweep.sweep().await.unwrap().undone, 0, "counted once");
    // The rolled-back operation's tag is known until the retention, then forgotten.
    let tag = gone.derive("thing").to_string();
    assert_eq!(f.peer.ownership(&tag, "x", now_micros()).await.unwrap(), crate::Ownership::Unowned);
    f.ledger.prune(now_micros() + 1).await.unwrap();
    assert_eq!(f.peer.ownership(&tag, "x", now_micros()).await.unwrap(), crate::Ownership::Foreign);
}

/// Ticks `reaper` with only `op_id` due (every other row put off for an hour).
async fn eager_only(reaper: &Reaper, ledger: &dyn Ledger, op_id: &str) -> crate::Pass {
    let later = now_micros() + 3_600_000_000;
    for op in ledger.due(now_micros(), 10_000).await.unwrap() {
        if op.op_id != op_id {
            ledger.put_off(&op.op_id, later).await.unwrap();
        }
    }
    reaper.tick().await.unwrap()
}

/// 100,000 operations the reaper must wait on (inserted in bulk), all due before an abandoned
/// one falls due: the abandoned one is rolled back within two ticks of at most 500 rows each
/// (hole 3: the reaper read the oldest rows every tick and never reached it).
pub async fn the_reaper_is_fair_behind_100_000_waiting_rows(f: Fixture) {
    const WAITING: usize = 100_000;
    let ds = Arc::new(Downstream::new("thing", false));
    let (claim, op) = fresh_op(&*f.store, "create").await;
    assert!(effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await.is_err());
    f.store.fail(&claim).await.unwrap();
    let abandoned = f.ledger.operation(op.id()).await.unwrap().expect("row");
    // Rows whose last attempt is an hour later than the abandoned one's (so they are not
    // abandoned), all fallen due before it.
    let rows: Vec<_> = (0..WAITING)
        .map(|i| crate::OperationRow {
            op_id: format!("waiting-{i:06}"),
            kind: "create".into(),
            principal: "team-w".into(),
            endpoint: "POST /v1/things".into(),
            idem_key: format!("w-{i}"),
            record_id: idempotency::RecordId::random().to_hex(),
            subject: None,
            mark: Mark::Live,
            last_attempt_at: abandoned.last_attempt_at + 3_600_000_000,
            next_check_at: abandoned.next_check_at - 1 - i as i64,
        })
        .collect();
    let started = std::time::Instant::now();
    f.ledger.insert_operations(&rows).await.expect("bulk insert");
    eprintln!("bulk insert of {WAITING} operation rows: {:?}", started.elapsed());
    wait_out_settle().await;
    let reaper = Reaper::new(
        f.peer.clone(),
        f.store_peer.clone(),
        vec![ds.clone() as Arc<dyn Effect>],
        ReaperConfig { abandon_after: Duration::from_secs(1), ..reaper_config() },
    );
    let mut ticks = 0;
    while mark_of(&*f.ledger, op.id()).await != Some(Mark::RolledBack) {
        ticks += 1;
        assert!(ticks <= 2, "not rolled back within two ticks");
        let pass = reaper.tick().await.unwrap();
        assert!(pass.examined <= 500, "bounded work per tick: {pass:?}");
        assert!(pass.waiting >= pass.examined - 1, "{pass:?}");
    }
    assert_eq!((ds.count(), ds.undos()), (0, 1));
    // What it waited on is put off, not looked at again at once.
    let next = reaper.tick().await.unwrap();
    assert_eq!(next.rolled_back, 0);
    assert!(next.examined <= 500);
}

/// A long-running effect: accepted; a retry attaches (nothing sent again); the watcher that
/// took its lease dies; another takes over once the lease expires and sees it to the end.
pub async fn a_dead_watcher_is_taken_over_and_retries_attach(f: Fixture) {
    let ds = Arc::new(Downstream::new("flash", true));
    let all: Vec<Arc<dyn Effect>> = vec![ds.clone()];
    let (_c, op) = fresh_op(&*f.store, "flash").await;
    let a = effects(&f.ledger).attempt(&op);
    let accepted = a.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    assert!(matches!(accepted, Outcome::Accepted(_)));
    a.finish().await.unwrap();
    let retry = effects(&f.peer).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(retry, Err(EffectError::Finished)), "a finished operation is not started again: {retry:?}");
    // A retry of an unfinished long-running operation attaches to the accepted call.
    let (_c, op2) = fresh_op(&*f.store, "flash").await;
    let first = effects(&f.ledger).attempt(&op2).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    let again = effects(&f.peer).attempt(&op2).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    assert_eq!(first, again);
    assert_eq!(ds.sends(), 2, "one send per operation");

    let w1 = Watcher::new(f.ledger.clone(), all.clone(), "w1", Duration::from_millis(800));
    assert_eq!(w1.step().await.unwrap().polled, 2, "w1 takes both leases");
    drop(w1); // dies holding them
    let w2 = Watcher::new(f.peer.clone(), all, "w2", Duration::from_secs(30));
    assert_eq!(w2.step().await.unwrap().polled, 0, "the leases of w1 still hold");
    ds.complete(accepted.id());
    ds.complete(first.id());
    let mut done = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while done < 2 {
        assert!(tokio::time::Instant::now() < deadline, "w2 never took over");
        done += w2.step().await.unwrap().done;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let states: Vec<_> = f.ledger.intents(op2.id()).await.unwrap().into_iter().map(|i| i.state).collect();
    assert_eq!(states, vec![IntentState::Done]);
}

/// Eight watchers read one expired lease and race to take it: exactly one does.
pub async fn racing_watchers_take_one_lease(f: Fixture) {
    let ds = Arc::new(Downstream::new("flash", true));
    let (_c, op) = fresh_op(&*f.store, "flash").await;
    effects(&f.ledger).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    let seen = f.ledger.to_watch("nobody", now_micros(), 10).await.unwrap();
    assert_eq!(seen.len(), 1);
    let (tag, until) = (seen[0].intent_id.clone(), seen[0].watch_until);
    let takes = (0..8).map(|i| {
        let ledger = if i % 2 == 0 { f.ledger.clone() } else { f.peer.clone() };
        let tag = tag.clone();
        tokio::spawn(async move { ledger.take_watch(&tag, &format!("w{i}"), until, now_micros() + 60_000_000).await })
    });
    let won = join_all(takes).await.into_iter().filter(|r| *r.as_ref().unwrap().as_ref().unwrap()).count();
    assert_eq!(won, 1);
}

/// What the service's own tables own is never undone by the inventory sweep; an undo whose
/// answer was lost is counted once, when the resource is seen gone.
pub async fn the_sweep_spares_what_the_service_owns_and_counts_a_lost_undo_once(f: Fixture) {
    #[derive(Debug)]
    struct Owns(String);
    #[async_trait::async_trait]
    impl crate::Owner for Owns {
        async fn owns(&self, _effect: &str, id: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
            Ok(id == self.0)
        }
    }
    let ds = Arc::new(Downstream::new("thing", false));
    // Three finished creates whose resources the service deleted from its ledger's keeping
    // (`disown`): their tags are this ledger's, and only the service's own row owns one.
    let mut landed = Vec::new();
    for _ in 0..3 {
        let (_c, op) = fresh_op(&*f.store, "create").await;
        let a = effects(&f.ledger).attempt(&op);
        let done = a.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
        a.finish().await.unwrap();
        f.ledger.disown(done.id()).await.unwrap();
        landed.push((op.derive("thing").to_string(), done.id().to_owned()));
    }
    let (owned_tag, owned) = landed[0].clone();
    let sweep = InventorySweep::new(f.ledger.clone(), vec![ds.clone() as Arc<dyn Effect>], SETTLE)
        .owned_by(Arc::new(Owns(owned.clone())));
    ds.lose_undo_answers(true);
    let first = sweep.sweep().await.unwrap();
    assert_eq!((first.listed, first.undone, first.errors), (3, 0, 2), "{first:?}");
    ds.lose_undo_answers(false);
    let second = sweep.sweep().await.unwrap();
    assert_eq!((second.listed, second.undone), (1, 2), "the lost undos, counted once they are seen gone: {second:?}");
    assert_eq!(sweep.sweep().await.unwrap().undone, 0, "counted once");
    assert_eq!(ds.with_tag(&owned_tag), vec![owned]);
    assert!(landed[1..].iter().all(|(tag, _)| ds.with_tag(tag).is_empty()));
}
