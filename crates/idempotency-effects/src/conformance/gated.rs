//! A ledger that holds a caller at one named step until told to go on: a stalled attempt,
//! placed exactly (a frozen VM, a SIGSTOP, a database stall), without timing.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::ledger::{Decided, Intent, IntentState, Ledger, LedgerError, NewIntent, OperationRow};

/// The step a [`Gated`] ledger holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// [`Ledger::decide`].
    Decide,
    /// [`Ledger::stamp`].
    Stamp,
    /// [`Ledger::adopt`].
    Adopt,
    /// [`Ledger::release`].
    Release,
    /// [`Ledger::due`] (a reaper's tick, after it began).
    Due,
    /// [`Ledger::take_for_rollback`] (a reaper that holds the record's claim).
    TakeForRollback,
    /// A delay before [`Ledger::decide`] (a queue for a connection), not a gate.
    DelayDecide(Duration),
    /// The first [`Ledger::decide`]'s answer comes back this long after the ledger took it (a
    /// commit slow to return), not a gate.
    LateDecide(Duration),
    /// Every [`Ledger::decide`]'s and [`Ledger::stamp`]'s answer comes back this long after the
    /// ledger took it, not a gate.
    LateAnswers(Duration),
}

/// Wraps a ledger; the first call of the gated step waits (before it reaches the ledger) until
/// [`Gated::release`], after signalling [`Gated::reached`].
pub struct Gated {
    inner: Arc<dyn Ledger>,
    step: Step,
    armed: AtomicBool,
    reached: Notify,
    go: Notify,
}

impl fmt::Debug for Gated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated").field("step", &self.step).finish()
    }
}

impl Gated {
    /// `inner`, gated at `step`.
    pub fn new(inner: Arc<dyn Ledger>, step: Step) -> Arc<Self> {
        Arc::new(Self { inner, step, armed: AtomicBool::new(true), reached: Notify::new(), go: Notify::new() })
    }

    /// Waits until a caller is held at the step.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the held caller go on.
    pub fn release(&self) {
        self.go.notify_one();
    }

    async fn at(&self, step: Step) {
        match self.step {
            Step::DelayDecide(d) if step == Step::Decide => tokio::time::sleep(d).await,
            Step::DelayDecide(_) | Step::LateDecide(_) | Step::LateAnswers(_) => {}
            _ if step == self.step && self.armed.swap(false, Ordering::SeqCst) => {
                self.reached.notify_one();
                self.go.notified().await;
            }
            _ => {}
        }
    }

    /// After the ledger took `step`: holds its answer back when told to.
    async fn answered(&self, step: Step) {
        match self.step {
            Step::LateDecide(d) if step == Step::Decide && self.armed.swap(false, Ordering::SeqCst) => {
                tokio::time::sleep(d).await
            }
            Step::LateAnswers(d) if matches!(step, Step::Decide | Step::Stamp) => tokio::time::sleep(d).await,
            _ => {}
        }
    }
}

#[async_trait]
impl Ledger for Gated {
    async fn decide(&self, op: &OperationRow, intent: &NewIntent, ahead: Duration) -> Result<Decided, LedgerError> {
        self.at(Step::Decide).await;
        let decided = self.inner.decide(op, intent, ahead).await;
        self.answered(Step::Decide).await;
        decided
    }
    async fn stamp(
        &self,
        op_id: &str,
        intent_id: &str,
        seen: i64,
        ahead: Duration,
    ) -> Result<Option<i64>, LedgerError> {
        self.at(Step::Stamp).await;
        let stamped = self.inner.stamp(op_id, intent_id, seen, ahead).await;
        self.answered(Step::Stamp).await;
        stamped
    }
    async fn adopt(&self, op_id: &str, intent_id: &str, candidate: &str) -> Result<String, LedgerError> {
        self.at(Step::Adopt).await;
        self.inner.adopt(op_id, intent_id, candidate).await
    }
    async fn record(&self, op_id: &str, intent_id: &str, id: &str, state: IntentState) -> Result<String, LedgerError> {
        self.inner.record(op_id, intent_id, id, state).await
    }
    async fn release(&self, intent_id: &str, sent_at: i64) -> Result<bool, LedgerError> {
        self.at(Step::Release).await;
        self.inner.release(intent_id, sent_at).await
    }
    async fn finish(&self, op_id: &str, now: i64) -> Result<(), LedgerError> {
        self.inner.finish(op_id, now).await
    }
    async fn operation(&self, op_id: &str) -> Result<Option<OperationRow>, LedgerError> {
        self.inner.operation(op_id).await
    }
    async fn intents(&self, op_id: &str) -> Result<Vec<Intent>, LedgerError> {
        self.inner.intents(op_id).await
    }
    async fn due(&self, now: i64, limit: u32) -> Result<Vec<OperationRow>, LedgerError> {
        self.at(Step::Due).await;
        self.inner.due(now, limit).await
    }
    async fn put_off(&self, op_id: &str, at: i64) -> Result<(), LedgerError> {
        self.inner.put_off(op_id, at).await
    }
    async fn take_for_rollback(&self, op_id: &str, seen: i64) -> Result<bool, LedgerError> {
        self.at(Step::TakeForRollback).await;
        self.inner.take_for_rollback(op_id, seen).await
    }
    async fn intent(&self, intent_id: &str) -> Result<Option<Intent>, LedgerError> {
        self.inner.intent(intent_id).await
    }
    async fn take_unbegun(&self, op: &OperationRow) -> Result<bool, LedgerError> {
        self.inner.take_unbegun(op).await
    }
    async fn rolled_back(&self, op_id: &str, now: i64) -> Result<bool, LedgerError> {
        self.inner.rolled_back(op_id, now).await
    }
    async fn prune(&self, before: i64) -> Result<u64, LedgerError> {
        self.inner.prune(before).await
    }
    async fn ownership(&self, tag: &str, id: &str, settled_before: i64) -> Result<crate::Ownership, LedgerError> {
        self.inner.ownership(tag, id, settled_before).await
    }
    async fn disown(&self, id: &str) -> Result<u64, LedgerError> {
        self.inner.disown(id).await
    }
    async fn to_watch(&self, watcher: &str, now: i64, limit: u32) -> Result<Vec<Intent>, LedgerError> {
        self.inner.to_watch(watcher, now, limit).await
    }
    async fn take_watch(&self, intent_id: &str, watcher: &str, seen: i64, until: i64) -> Result<bool, LedgerError> {
        self.inner.take_watch(intent_id, watcher, seen, until).await
    }
    async fn conclude(&self, intent_id: &str, watcher: &str, state: IntentState) -> Result<bool, LedgerError> {
        self.inner.conclude(intent_id, watcher, state).await
    }
    async fn insert_operations(&self, rows: &[OperationRow]) -> Result<(), LedgerError> {
        self.inner.insert_operations(rows).await
    }
}
