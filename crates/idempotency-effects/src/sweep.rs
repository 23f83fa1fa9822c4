//! The inventory sweep: nothing runs downstream that nobody owns.

use std::sync::Arc;
use std::time::Duration;

use crate::effect::{CallError, Effect};
use crate::ledger::{Ledger, LedgerError};
use crate::{micros, now_micros};

/// The prefix of every derived sub-key, so of every tag this library stamps.
pub const TAG_PREFIX: &str = "sk-";

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// Resources listed with our tag prefix.
    pub listed: u64,
    /// Orphans undone (each counted once, when it was still there).
    pub undone: u64,
    /// Effects whose listing or undo failed (tried again next sweep).
    pub errors: u64,
}

/// An error of a sweep step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SweepError {
    /// The ledger failed.
    #[error("the effect ledger failed")]
    Ledger(#[from] LedgerError),
}

/// Lists what carries this service's tags downstream (each effect that can list) and undoes
/// whatever no live operation and no finished one owns, once its last send is older than the
/// settle window: a call that landed after its operation was rolled back, a duplicate that
/// landed after its operation finished. Every replica may run it; a resource is counted by the
/// replica whose undo found it there.
#[derive(Debug, Clone)]
pub struct InventorySweep {
    ledger: Arc<dyn Ledger>,
    effects: Vec<Arc<dyn Effect>>,
    settle: Duration,
    prefix: String,
}

impl InventorySweep {
    /// A sweep of `effects` (those that can list and undo) against `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>, effects: Vec<Arc<dyn Effect>>, settle: Duration) -> Self {
        Self { ledger, effects, settle, prefix: TAG_PREFIX.to_owned() }
    }

    /// One sweep.
    pub async fn sweep(&self) -> Result<Swept, SweepError> {
        let mut out = Swept::default();
        for effect in self.effects.iter().filter(|e| e.can_list() && e.can_undo()) {
            let listed = match effect.list(&self.prefix).await {
                Ok(l) => l,
                Err(e) => {
                    out.errors += 1;
                    tracing::warn!(effect = effect.name(), error = %e, "inventory sweep: cannot list");
                    continue;
                }
            };
            for item in listed {
                out.listed += 1;
                let settled_before = now_micros().saturating_sub(micros(self.settle));
                if self.ledger.owns(&item.tag, &item.id, settled_before).await? {
                    continue;
                }
                match effect.undo(&item.id).await {
                    Ok(true) => {
                        out.undone += 1;
                        tracing::warn!(effect = effect.name(), tag = %item.tag, id = %item.id,
                            "inventory sweep: undid a resource that no operation owns");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        out.errors += 1;
                        log_undo_failed(effect.name(), &item.id, &e);
                    }
                }
            }
        }
        Ok(out)
    }
}

fn log_undo_failed(effect: &str, id: &str, e: &CallError) {
    tracing::warn!(effect, id, error = %e, "inventory sweep: undo failed; trying again next sweep");
}
