//! The cases of attempts: racing and stalled attempts, send stamps, the settle window, refusals.
//! Each takes a fresh [`Fixture`] and counts side effects on a [`Downstream`].

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use super::super::{Downstream, Fixture, Gated, SETTLE, Step, effects, fresh_op, wait_out_settle};
use super::{mark_of, reaper_config};
use crate::{Effect, EffectError, Effects, IntentState, Mark, Outcome, Reaper, Sent, now_micros};

/// Sixteen attempts of one operation at once, on two ledger handles, after a first call whose
/// outcome was unknown and whose settle window passed: exactly one sends again.
pub async fn racing_attempts_send_once(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let first = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_dropped(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    wait_out_settle().await;

    let runs = (0..16).map(|i| {
        let ledger = if i % 2 == 0 { f.ledger.clone() } else { f.peer.clone() };
        let (op, ds) = (op.clone(), ds.clone());
        tokio::spawn(async move {
            let attempt = effects(&ledger).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::from_millis(50))).await
        })
    });
    let results: Vec<_> = join_all(runs).await.into_iter().map(|r| r.expect("task")).collect();
    assert_eq!(ds.sends(), 2, "one call by the first attempt, one by exactly one racer: {results:?}");
    assert_eq!(ds.count(), 1, "one resource");
    let ids: Vec<&str> = results.iter().filter_map(|r| r.as_ref().ok()).map(Outcome::id).collect();
    assert!(!ids.is_empty(), "someone sent: {results:?}");
    assert!(ids.iter().all(|id| *id == ids[0]), "every success names one resource: {ids:?}");
    for r in &results {
        assert!(
            matches!(r, Ok(_) | Err(EffectError::Contended | EffectError::Settling { .. })),
            "a racer that lost answers 503 and sent nothing: {r:?}"
        );
    }
}

/// An attempt stalls before its first step; another finishes the operation; the first wakes
/// (hole 1: a deleted-and-recreated row would let it start again). It sends nothing.
pub async fn a_stalled_attempt_waking_after_finish_sends_nothing(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let gated = Gated::new(f.ledger.clone(), Step::Decide);
    let stalled = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await
        })
    };
    gated.reached().await;
    let retry = effects(&f.peer).attempt(&op);
    let done = retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("the retry runs");
    retry.finish().await.expect("finish");
    gated.release();
    let woke = stalled.await.expect("task");
    assert!(matches!(woke, Err(EffectError::Finished)), "{woke:?}");
    assert_eq!(ds.sends(), 1, "the stalled attempt sent nothing");
    assert_eq!(ds.with_tag(&op.derive("thing").to_string()), vec![done.id().to_owned()]);
    assert_eq!(mark_of(&*f.ledger, op.id()).await, Some(Mark::Finished));
    assert!(f.ledger.intents(op.id()).await.unwrap().is_empty(), "a finished operation keeps a compact mark only");
}

/// As above, and the service deleted the resource (undo + disown) before the stalled attempt
/// woke: it brings nothing back.
pub async fn a_stalled_attempt_waking_after_finish_and_delete_brings_nothing_back(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let gated = Gated::new(f.ledger.clone(), Step::Decide);
    let stalled = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await
        })
    };
    gated.reached().await;
    let retry = effects(&f.peer).attempt(&op);
    let done = retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("the retry runs");
    retry.finish().await.expect("finish");
    assert!(ds.undo(done.id()).await.unwrap());
    assert_eq!(f.peer.disown(done.id()).await.unwrap(), 1, "the finished operation owned it");
    gated.release();
    let woke = stalled.await.expect("task");
    assert!(matches!(woke, Err(EffectError::Finished)), "{woke:?}");
    assert_eq!((ds.sends(), ds.count()), (1, 0), "nothing sent again, nothing brought back");
}

/// After a call whose outcome was unknown, an attempt decides to send again (nothing found,
/// the window passed) and stalls right before it stamps; another attempt sends and finishes.
/// The first wakes: its stamp is refused, it sends nothing.
pub async fn a_stalled_stamp_after_another_attempt_finished_sends_nothing(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let first = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_dropped(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    wait_out_settle().await;
    let gated = Gated::new(f.ledger.clone(), Step::Stamp);
    let stalled = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await
        })
    };
    gated.reached().await;
    let retry = effects(&f.peer).attempt(&op);
    retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("the retry sends");
    retry.finish().await.expect("finish");
    gated.release();
    let woke = stalled.await.expect("task");
    assert!(matches!(woke, Err(EffectError::Finished)), "{woke:?}");
    assert_eq!((ds.sends(), ds.count()), (2, 1), "the first call and the retry's; the stalled one sent nothing");
}

/// An attempt stalls; the operation is abandoned and the reaper rolls it back; the attempt
/// wakes. It sends nothing and makes nothing.
pub async fn a_stalled_attempt_waking_after_rollback_sends_nothing(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (claim, op) = fresh_op(&*f.store, "create").await;
    let first = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_landed_answer_lost(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    f.store.fail(&claim).await.expect("the handler failed");
    let gated = Gated::new(f.ledger.clone(), Step::Decide);
    let stalled = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await
        })
    };
    gated.reached().await;
    wait_out_settle().await;
    let reaper =
        Reaper::new(f.peer.clone(), f.store_peer.clone(), vec![ds.clone() as Arc<dyn Effect>], reaper_config());
    let pass = reaper.tick().await.expect("tick");
    assert_eq!((pass.rolled_back, pass.undone), (1, 1), "{pass:?}");
    assert_eq!(f.store.get(op.scope()).await.unwrap(), None, "the record is removed: a retry runs afresh");
    gated.release();
    let woke = stalled.await.expect("task");
    assert!(matches!(woke, Err(EffectError::RolledBack)), "{woke:?}");
    assert_eq!((ds.sends(), ds.count()), (1, 0), "the stalled attempt sent and made nothing");
    assert_eq!(mark_of(&*f.ledger, op.id()).await, Some(Mark::RolledBack));
}

/// A call that lands late: the retry before it lands answers Settling and sends nothing; the
/// retry after it landed adopts it.
pub async fn the_settle_window_is_respected_and_a_late_landing_adopted(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let tag = op.derive("thing").to_string();
    let first = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_dropped(t) }).await;
    assert!(matches!(first, Err(EffectError::Ambiguous(_))), "{first:?}");
    let early = effects(&f.peer).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    match early {
        Err(EffectError::Settling { retry_after }) => assert!((1..=2).contains(&retry_after), "{retry_after}"),
        other => panic!("a retry inside the window must wait: {other:?}"),
    }
    assert_eq!(ds.sends(), 1, "nothing sent inside the window");
    let landed = ds.land(&tag); // the first call lands now
    let late = effects(&f.peer).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert_eq!(late.expect("adopted"), Outcome::Done(landed.clone()));
    assert_eq!((ds.sends(), ds.count()), (1, 1));
    // A second resource with the tag (a landing past a window set too short) is undone by the
    // retry that finds both; the adopted one stays.
    let op2 = fresh_op(&*f.store, "create").await.1;
    let tag2 = op2.derive("thing").to_string();
    let first = effects(&f.ledger).attempt(&op2).run(&*ds, |t| async { ds.send_dropped(t) }).await;
    assert!(first.is_err());
    let (a, b) = (ds.land(&tag2), ds.land(&tag2));
    let kept = effects(&f.peer).attempt(&op2).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("adopted");
    assert_eq!(kept.id(), a.min(b.clone()), "the lowest id is kept, on every replica");
    assert_eq!(ds.with_tag(&tag2), vec![kept.id().to_owned()], "the duplicate is undone");
}

/// A definite refusal releases the intent: the retry sends at once (no settle wait) and the
/// operation ends with one resource.
pub async fn a_definite_refusal_releases_and_the_retry_sends_at_once(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let tag = op.derive("thing").to_string();
    let refused = effects(&f.ledger).attempt(&op).run(&*ds, |t| async { ds.send_refused(t) }).await;
    assert!(matches!(&refused, Err(EffectError::Refused(e)) if e.status() == Some(409)), "{refused:?}");
    assert_eq!(refused.as_ref().unwrap_err().retry_after(), None, "a refusal is not retried by Retry-After");
    let intents = f.ledger.intents(op.id()).await.unwrap();
    assert_eq!(
        intents.iter().map(|i| (i.intent_id.as_str(), i.state)).collect::<Vec<_>>(),
        vec![(tag.as_str(), IntentState::Failed)]
    );
    let retry = effects(&f.peer).attempt(&op);
    let done = retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("the retry sends at once");
    retry.finish().await.unwrap();
    assert_eq!((ds.sends(), ds.count()), (2, 1));
    assert_eq!(ds.with_tag(&tag), vec![done.id().to_owned()]);
}

/// A definite refusal releases only the send it answered. An attempt whose call was refused
/// (a 4xx) pauses right before it releases the intent; meanwhile the settle window of that send
/// passes and a newer attempt sends again, its answer lost (it may still land). The old
/// attempt wakes and releases: the newer send must stay pending under its own stamp, so the
/// next retry waits out its settle window instead of sending a third time at once.
pub async fn a_paused_refusal_never_releases_a_newer_send(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let tag = op.derive("thing").to_string();
    let gated = Gated::new(f.ledger.clone(), Step::Release);
    let paused = {
        let (op, ds, gated) = (op.clone(), ds.clone(), gated.clone());
        tokio::spawn(async move {
            let attempt = Effects::new(gated).settle(SETTLE).attempt(&op);
            attempt.run(&*ds, |t| async { ds.send_refused(t) }).await
        })
    };
    gated.reached().await;
    wait_out_settle().await;
    let newer = effects(&f.peer).attempt(&op).run(&*ds, |t| async { ds.send_dropped(t) }).await;
    assert!(matches!(newer, Err(EffectError::Ambiguous(_))), "the newer attempt sends again: {newer:?}");
    let resent = f.peer.intent(&tag).await.unwrap().expect("the intent");
    gated.release();
    let woke = paused.await.expect("task");
    assert!(matches!(woke, Err(EffectError::Refused(_))), "{woke:?}");
    let after = f.ledger.intent(&tag).await.unwrap().expect("the intent");
    assert_eq!(
        (after.state, after.sent_at),
        (IntentState::Pending, resent.sent_at),
        "the old attempt's refusal released the newer send"
    );
    let next = effects(&f.ledger).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(next, Err(EffectError::Settling { .. })), "the next retry sent at once: {next:?}");
    assert_eq!(ds.sends(), 2, "the refused call and the newer one; nothing inside the newer one's window");
}

/// The ledger answers 1.5 s late (a queue for a connection, a busy writer) with a send stamp
/// 1 s ahead: the stamp is taken once the transaction holds its lock, so the call still goes
/// out (hole 4: a stamp taken before the wait answered 503).
pub async fn a_queue_for_the_ledger_does_not_refuse_the_send(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let slow = Gated::new(f.ledger.clone(), Step::DelayDecide(Duration::from_millis(1500)));
    let attempt = Effects::new(slow).settle(SETTLE).send_ahead(Duration::from_secs(1)).attempt(&op);
    let done = attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(done, Ok(Outcome::Done(_))), "{done:?}");
    assert_eq!(ds.sends(), 1);
}

/// The commit of a new intent's send stamp comes back after the stamped moment (a loaded disk:
/// once seen in CI as a healthy create answered 503): nothing was sent, so the stamp is taken
/// again and the call goes out, once.
pub async fn a_stamp_whose_commit_came_back_late_is_taken_again_and_sent_once(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let late = Gated::new(f.ledger.clone(), Step::LateDecide(Duration::from_millis(600)));
    let attempt = Effects::new(late).settle(SETTLE).send_ahead(Duration::from_millis(300)).attempt(&op);
    let done = attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(done, Ok(Outcome::Done(_))), "{done:?}");
    assert_eq!(ds.sends(), 1);
}

/// Every stamp's commit comes back late: the attempt gives up without sending anything, and a
/// retry waits out the settle window from the last stamp, then sends once.
pub async fn a_stamp_late_every_time_sends_nothing_and_the_retry_sends_once(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let late = Gated::new(f.ledger.clone(), Step::LateAnswers(Duration::from_millis(300)));
    let attempt = Effects::new(late).settle(SETTLE).send_ahead(Duration::from_millis(100)).attempt(&op);
    let given_up = attempt.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(given_up, Err(EffectError::SlowCommit)), "{given_up:?}");
    assert_eq!(ds.sends(), 0, "nothing was sent");
    let retry = effects(&f.peer).attempt(&op);
    let settling = retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(settling, Err(EffectError::Settling { .. })), "{settling:?}");
    wait_out_settle().await;
    let done = retry.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(done, Ok(Outcome::Done(_))), "{done:?}");
    assert_eq!(ds.sends(), 1);
}

/// Finished and rolled-back operations keep their mark: every step is refused (decide, stamp,
/// adopt, record, finish), until the retention passes and the mark is pruned.
pub async fn marks_refuse_every_step_until_the_retention(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_c, op) = fresh_op(&*f.store, "create").await;
    let a = effects(&f.ledger).attempt(&op);
    let done = a.run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    a.finish().await.unwrap();
    let tag = op.derive("thing").to_string();
    let l = &f.peer;
    assert!(matches!(a.finish().await, Err(EffectError::Finished)));
    assert!(matches!(l.stamp(op.id(), &tag, 0, SETTLE).await, Err(crate::LedgerError::Finished)));
    assert!(matches!(l.adopt(op.id(), &tag, "x").await, Err(crate::LedgerError::Finished)));
    assert!(l.record(op.id(), &tag, "x", IntentState::Done).await.is_err());
    let other = a.run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(other, Err(EffectError::Finished)), "{other:?}");
    assert_eq!(
        f.ledger.ownership(&tag, done.id(), now_micros()).await.unwrap(),
        crate::Ownership::Owned,
        "the finished operation owns its resource"
    );
    assert_eq!(f.ledger.prune(now_micros() - 3_600_000_000).await.unwrap(), 0, "kept until the retention");
    assert!(f.ledger.prune(now_micros() + 1).await.unwrap() >= 1, "pruned after it");
    assert_eq!(mark_of(&*f.ledger, op.id()).await, None);
    assert_eq!(ds.sends(), 1);
    let _ = Sent::Done(String::new());
}

/// An operation the service recorded in its own tables but whose request never reached the
/// ledger's first step, abandoned: `take_unbegun` fences it off (no late attempt can begin it),
/// once; and `intent` reads an intent by its tag.
pub async fn an_operation_that_never_began_is_fenced_off(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "create").await;
    let row = crate::OperationRow::unbegun(op.id(), "create", now_micros());
    assert!(f.ledger.take_unbegun(&row).await.unwrap(), "taken");
    assert!(!f.peer.take_unbegun(&row).await.unwrap(), "once");
    let late = effects(&f.peer).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(late, Err(EffectError::RolledBack)), "{late:?}");
    assert_eq!(ds.sends(), 0);
    assert!(f.ledger.rolled_back(op.id(), now_micros()).await.unwrap());

    // An attempt that began first keeps its operation.
    let (_claim, begun) = fresh_op(&*f.store, "create").await;
    let done = effects(&f.ledger).attempt(&begun).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
    assert!(!f.peer.take_unbegun(&crate::OperationRow { op_id: begun.id().to_owned(), ..row }).await.unwrap());
    let tag = begun.derive("thing").to_string();
    let intent = f.peer.intent(&tag).await.unwrap().expect("the intent by its tag");
    assert_eq!(
        (intent.op_id.as_str(), intent.state, intent.resource_id.as_deref()),
        (begun.id(), IntentState::Done, Some(done.id()))
    );
    assert_eq!(f.peer.intent("sk-no-such-tag").await.unwrap(), None);
}

/// A call that is idempotent downstream (a delete by id) whose answer was lost is sent again at
/// once by the retry, without waiting out the settle window; the operation ends with one effect.
pub async fn an_idempotent_call_is_sent_again_without_waiting(f: Fixture) {
    #[derive(Debug)]
    struct Idempotent(Arc<Downstream>);
    #[async_trait::async_trait]
    impl Effect for Idempotent {
        fn name(&self) -> &str {
            self.0.name()
        }
        async fn probe(&self, tag: &str) -> Result<Vec<String>, crate::CallError> {
            self.0.probe(tag).await
        }
        fn idempotent(&self) -> bool {
            true
        }
    }
    let ds = Arc::new(Downstream::new("thing", false));
    let effect = Idempotent(ds.clone());
    let (_claim, op) = fresh_op(&*f.store, "delete").await;
    let lost = effects(&f.ledger).attempt(&op).run(&effect, |t| async { ds.send_dropped(t) }).await;
    assert!(matches!(lost, Err(EffectError::Ambiguous(_))), "{lost:?}");
    let retry = effects(&f.peer).attempt(&op).run(&effect, |t| ds.send(t, Duration::ZERO)).await;
    assert!(matches!(retry, Ok(Outcome::Done(_))), "sent again at once, not told to wait: {retry:?}");
    assert_eq!((ds.sends(), ds.count()), (2, 1));
}

/// What an operation names as its subject is read back from its row, on every handle; an
/// operation that names none reads back `None`.
pub async fn an_operation_keeps_its_subject(f: Fixture) {
    let ds = Arc::new(Downstream::new("thing", false));
    let (_claim, op) = fresh_op(&*f.store, "delete").await;
    let op = op.with_subject("w-0042");
    effects(&f.ledger).attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("run");
    let row = f.peer.operation(op.id()).await.expect("read").expect("the row");
    assert_eq!(row.subject.as_deref(), Some("w-0042"));
    let (_claim, plain) = fresh_op(&*f.store, "create").await;
    effects(&f.ledger).attempt(&plain).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("run");
    assert_eq!(f.peer.operation(plain.id()).await.expect("read").expect("the row").subject, None);
}
