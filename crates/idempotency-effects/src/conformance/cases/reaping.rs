//! The cases of the reaper's own steps: when it takes a record, what it does when the record
//! cannot be removed, and durations too long to add. Each takes a fresh [`Fixture`] and counts
//! side effects on a [`Downstream`].

use std::sync::Arc;
use std::time::Duration;

use idempotency::conformance::{FaultyStore, Op};
use idempotency::{ClaimOutcome, RecordState};

use super::super::{Downstream, Fixture, Gated, Step, claim_request, effects, fresh_op, wait_out_settle, wait_until};
use super::{mark_of, reaper_config};
use crate::{Effect, EffectError, Mark, Operation, Reaper, ReaperConfig, now_micros};

/// An operation whose call landed (its answer lost) and whose handler failed, with the settle
/// window of that call passed: abandoned, for the reaper to roll back.
async fn abandoned(f: &Fixture, ds: &Arc<Downstream>) -> Operation {
    let (claim, op) = fresh_op(&*f.store, "create").await;
    let first = effects(&f.ledger).attempt(&op).run(&**ds, |t| async { ds.send_landed_answer_lost(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    f.store.fail(&claim).await.expect("the handler failed");
    wait_out_settle().await;
    op
}

/// The reaper takes an abandoned operation's record with the time of the reclaim, not the time
/// its tick began. A tick held up before it reaches the row (held here right after it began,
/// at its read of the due rows: a long batch, a slow database) must not start its claim in the
/// past, where it may be stale at once and a retry could take the record while the reaper
/// undoes what the operation made.
pub async fn the_reaper_claims_the_record_at_the_time_of_the_reclaim(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let op = abandoned(&f, &ds).await;
    let holding = Gated::new(f.ledger.clone(), Step::TakeForRollback);
    let ticking = Gated::new(holding.clone(), Step::Due);
    let reaper = Reaper::new(ticking.clone(), f.store.clone(), vec![ds.clone() as Arc<dyn Effect>], reaper_config());
    let tick = tokio::spawn(async move { reaper.tick().await });
    ticking.reached().await;
    let held_from = now_micros();
    wait_until("the clock moved on", || now_micros() > held_from).await;
    ticking.release();
    holding.reached().await;
    let record = f.store_peer.get(op.scope()).await.expect("get").expect("the record");
    assert_eq!(record.state, RecordState::InFlight, "the reaper holds the record");
    assert!(
        record.started_at.timestamp_micros() > held_from,
        "the reaper's claim starts at {} µs, before the reclaim (its tick was held from {held_from} µs)",
        record.started_at.timestamp_micros()
    );
    holding.release();
    let pass = tick.await.expect("task").expect("tick");
    assert_eq!((pass.rolled_back, pass.undone), (1, 1), "{pass:?}");
}

/// The record of a rolled-back operation cannot be removed (the store fails): the operation is
/// not marked rolled back, so the reaper looks at it again and removes the record on a later
/// tick. A rollback marked done with its record left behind would leave the key answering `503`
/// (every retry finds the rolled-back operation) until the record expires. Once it is removed,
/// the key runs afresh: a new record, a new operation, one new send.
pub async fn a_record_the_reaper_cannot_remove_is_removed_on_a_later_tick(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let op = abandoned(&f, &ds).await;
    let store = Arc::new(FaultyStore::new(f.store.clone()));
    store.fail_always(Op::Remove);
    let reaper = Reaper::new(f.ledger.clone(), store.clone(), vec![ds.clone() as Arc<dyn Effect>], reaper_config());
    let pass = reaper.tick().await.expect("tick");
    assert_eq!(store.injected(Op::Remove), 1, "the reaper tried to remove the record: {pass:?}");
    assert_eq!(ds.count(), 0, "what the operation made is undone");
    assert_ne!(
        mark_of(&*f.ledger, op.id()).await,
        Some(Mark::RolledBack),
        "marked rolled back while its record stays, so never looked at again: {pass:?}"
    );
    store.heal(Op::Remove);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while mark_of(&*f.ledger, op.id()).await != Some(Mark::RolledBack) {
        assert!(tokio::time::Instant::now() < deadline, "the reaper never finished the rollback");
        f.ledger.put_off(op.id(), 0).await.expect("put off");
        reaper.tick().await.expect("tick");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.store.get(op.scope()).await.expect("get"), None, "the record is removed");
    let ClaimOutcome::Owned(claim) = f.store_peer.claim(claim_request(op.scope().clone())).await.expect("claim") else {
        panic!("the key has a record still");
    };
    let afresh = Operation::of(claim.record(), "create");
    assert_ne!(afresh.id(), op.id(), "a new operation");
    let done = effects(&f.peer).attempt(&afresh).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(done.is_ok(), "the key runs afresh: {done:?}");
    assert_eq!((ds.sends(), ds.count()), (2, 1));
}

/// A retention too long to add to a timestamp (`Duration::MAX`): the reaper neither panics nor
/// wraps around. It rolls the abandoned operation back, and its mark is kept (a retention that
/// wrapped into the past would prune it at once).
pub async fn a_retention_too_long_to_add_neither_panics_nor_wraps(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let op = abandoned(&f, &ds).await;
    let reaper = Reaper::new(
        f.peer.clone(),
        f.store_peer.clone(),
        vec![ds.clone() as Arc<dyn Effect>],
        ReaperConfig { retention: Duration::MAX, ..reaper_config() },
    );
    let pass = reaper.tick().await.expect("tick");
    assert_eq!((pass.rolled_back, pass.undone), (1, 1), "{pass:?}");
    assert_eq!(mark_of(&*f.ledger, op.id()).await, Some(Mark::RolledBack), "the mark is kept: {pass:?}");
    assert_eq!(f.store.get(op.scope()).await.expect("get"), None, "the record is removed");
    let again = reaper.tick().await.expect("a second tick");
    assert_eq!((again.rolled_back, again.pruned), (0, 0), "{again:?}");
}
