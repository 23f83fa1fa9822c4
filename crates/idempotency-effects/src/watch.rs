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
    /// Accepted effects whose lease this step took and polled.
    pub polled: u64,
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

    /// One step: up to 100 accepted effects whose lease expired (or is ours), the least
    /// recently watched first; each lease is taken by compare-and-set before its poll.
    pub async fn step(&self) -> Result<Watched, LedgerError> {
        let now = now_micros();
        let mut out = Watched::default();
        for intent in self.ledger.to_watch(&self.id, now, self.batch).await? {
            let until = now.saturating_add(micros(self.lease));
            if !self.ledger.take_watch(&intent.intent_id, &self.id, intent.watch_until, until).await? {
                continue; // another watcher took it
            }
            let Some(effect) = self.effects.get(&intent.effect) else { continue };
            out.polled += 1;
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
