//! The watcher of long-running effects: a lease on each accepted intent, taken by
//! compare-and-set, so when a watcher dies another takes over once its lease runs out.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::effect::{Effect, Progress};
use crate::ledger::{IntentState, Ledger, LedgerError};
use crate::{micros, now_micros};

/// What one watch step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Watched {
    /// Accepted effects this step polled (their lease held by this watcher).
    pub polled: u64,
    /// Of those, the ones this watcher started following (nobody held the lease, or another
    /// watcher's ran out): with several watchers, their sums count each effect followed once
    /// per watcher that followed it.
    pub taken: u64,
    /// Finished well.
    pub done: u64,
    /// Finished badly.
    pub failed: u64,
}

/// Watches accepted long-running effects to their end.
#[derive(Debug, Clone)]
pub struct Watcher {
    ledger: Arc<dyn Ledger>,
    effects: HashMap<String, Arc<dyn Effect>>,
    id: String,
    lease: Duration,
    batch: u32,
}

impl Watcher {
    /// A watcher named `id` (unique per process), holding each lease for `lease`.
    pub fn new(ledger: Arc<dyn Ledger>, effects: Vec<Arc<dyn Effect>>, id: &str, lease: Duration) -> Self {
        let effects = effects.into_iter().map(|e| (e.name().to_owned(), e)).collect();
        Self { ledger, effects, id: id.to_owned(), lease, batch: 100 }
    }

    /// The watcher's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The most accepted effects one step looks at (default 100).
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// One step: up to `batch` accepted effects whose lease expired (or is ours), the least
    /// recently watched first. Another's (or nobody's) lease is taken by compare-and-set before
    /// the poll; its own is renewed only once half of it is gone, so a watcher does not write
    /// every effect's row on every poll (on SQLite, one writer, that would queue every request
    /// behind it).
    pub async fn step(&self) -> Result<Watched, LedgerError> {
        let now = now_micros();
        let mut out = Watched::default();
        for intent in self.ledger.to_watch(&self.id, now, self.batch).await? {
            let ours = intent.watcher.as_deref() == Some(self.id.as_str());
            let renew = !ours || intent.watch_until.saturating_sub(now) <= micros(self.lease) / 2;
            let until = now.saturating_add(micros(self.lease));
            if renew && !self.ledger.take_watch(&intent.intent_id, &self.id, intent.watch_until, until).await? {
                continue; // another watcher took it
            }
            let Some(effect) = self.effects.get(&intent.effect) else { continue };
            out.polled += 1;
            if !ours {
                out.taken += 1;
            }
            let id = intent.resource_id.clone().unwrap_or_default();
            let end = match effect.poll(&intent.intent_id, &id).await {
                Ok(Progress::Running) => continue,
                Ok(Progress::Done) => IntentState::Done,
                Ok(Progress::Failed(reason)) => {
                    tracing::warn!(tag = %intent.intent_id, reason, "a long-running effect failed");
                    IntentState::Failed
                }
                Err(e) => {
                    tracing::warn!(tag = %intent.intent_id, error = %e, "cannot poll a long-running effect");
                    continue;
                }
            };
            if self.ledger.conclude(&intent.intent_id, &self.id, end).await? {
                if end == IntentState::Done {
                    out.done += 1;
                } else {
                    out.failed += 1;
                }
            }
        }
        Ok(out)
    }
}
