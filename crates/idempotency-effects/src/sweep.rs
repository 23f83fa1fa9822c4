//! The inventory sweep: nothing runs downstream that nobody owns.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use crate::effect::{CallError, Effect, Undone};
use crate::ledger::{Ledger, LedgerError, Ownership};
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
    /// Resources listed whose tag this ledger never issued (another service's, on a downstream
    /// two services share): left alone.
    pub foreign: u64,
}

/// An error of a sweep step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SweepError {
    /// The ledger failed.
    #[error("the effect ledger failed")]
    Ledger(#[from] LedgerError),
    /// The service's [`Owner`] could not tell.
    #[error("the service cannot tell who owns a resource")]
    Owner(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Undos whose answer was lost, by (effect, id): the tag and why, to count each once it is gone.
type Unconfirmed = HashMap<(String, String), (String, Undone)>;

/// What a service owns itself, beside the ledger: a resource its own tables point at (a worker
/// row's VM). The inventory sweep never undoes what this says is owned.
#[async_trait]
pub trait Owner: Send + Sync + std::fmt::Debug {
    /// Whether the service's own tables own the resource `id` of `effect`. An error leaves the
    /// resource alone this sweep.
    async fn owns(&self, effect: &str, id: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>>;
}

/// Lists what carries this service's tags downstream (each effect that can list) and undoes
/// whatever no live operation and no finished one owns, once its last send is older than the
/// settle window: a call that landed after its operation was rolled back, a duplicate that
/// landed after its operation finished. Only what carries a tag this ledger issued is ever
/// undone: a tag it never saw belongs to another service on a shared downstream (two
/// deployments on one libvirt host) and is counted in [`Swept::foreign`], left alone. Every
/// replica may run it; a resource is counted by the replica whose undo found it there.
#[derive(Debug, Clone)]
pub struct InventorySweep {
    ledger: Arc<dyn Ledger>,
    effects: Vec<Arc<dyn Effect>>,
    settle: Duration,
    prefix: String,
    owner: Option<Arc<dyn Owner>>,
    /// Undos whose answer was lost (a timeout): counted once, when the resource is gone.
    unconfirmed: Arc<Mutex<Unconfirmed>>,
}

impl InventorySweep {
    /// A sweep of `effects` (those that can list and undo) against `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>, effects: Vec<Arc<dyn Effect>>, settle: Duration) -> Self {
        Self { ledger, effects, settle, prefix: TAG_PREFIX.to_owned(), owner: None, unconfirmed: Arc::default() }
    }

    /// What the service owns itself, beside the ledger (see [`Owner`]).
    pub fn owned_by(mut self, owner: Arc<dyn Owner>) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Who owns `item` of `effect`: the ledger, or the service's own tables.
    async fn ownership(&self, effect: &str, item: &crate::Tagged) -> Result<Ownership, SweepError> {
        let settled_before = now_micros().saturating_sub(micros(self.settle));
        let ledger = self.ledger.ownership(&item.tag, &item.id, settled_before).await?;
        if ledger == Ownership::Owned {
            return Ok(Ownership::Owned);
        }
        match &self.owner {
            Some(owner) if owner.owns(effect, &item.id).await.map_err(SweepError::Owner)? => Ok(Ownership::Owned),
            _ => Ok(ledger),
        }
    }

    /// An undo of `id` whose answer was lost: remembered, and counted once it is gone.
    fn unconfirmed(&self) -> std::sync::MutexGuard<'_, Unconfirmed> {
        self.unconfirmed.lock().unwrap_or_else(PoisonError::into_inner)
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
            // An undo whose answer was lost and whose resource is gone now: it was done.
            let listed_ids: HashSet<&str> = listed.iter().map(|i| i.id.as_str()).collect();
            let gone: Vec<((String, String), (String, Undone))> = self
                .unconfirmed()
                .extract_if(|(name, id), _| name == effect.name() && !listed_ids.contains(id.as_str()))
                .collect();
            for ((_, id), (tag, why)) in gone {
                out.undone += 1;
                effect.undone(&tag, &id, &why);
            }
            // Who owns what, first: a resource nobody owns beside one its tag's operation kept is
            // a duplicate of it (a call that landed after the operation finished), not an orphan.
            let mut unowned = Vec::new();
            let mut kept: HashMap<&str, &str> = HashMap::new();
            for item in &listed {
                out.listed += 1;
                match self.ownership(effect.name(), item).await {
                    Ok(Ownership::Owned) => {
                        kept.insert(item.tag.as_str(), item.id.as_str());
                    }
                    Ok(Ownership::Unowned) => unowned.push(item),
                    Ok(Ownership::Foreign) => out.foreign += 1,
                    Err(SweepError::Ledger(e)) => return Err(SweepError::Ledger(e)),
                    Err(e) => {
                        out.errors += 1;
                        tracing::warn!(effect = effect.name(), id = %item.id, error = %e,
                            "inventory sweep: cannot tell who owns a resource; leaving it");
                    }
                }
            }
            for item in unowned {
                let why = match kept.get(item.tag.as_str()) {
                    Some(k) => Undone::Duplicate { kept: (*k).to_owned() },
                    None => Undone::Orphan,
                };
                let key = (effect.name().to_owned(), item.id.clone());
                match effect.undo(&item.id).await {
                    Ok(existed) => {
                        // Counted now, unless an earlier sweep's undo of it (answer lost) is
                        // what removed it: that one is counted here instead, once.
                        let earlier = self.unconfirmed().remove(&key).is_some();
                        if existed || earlier {
                            out.undone += 1;
                            effect.undone(&item.tag, &item.id, &why);
                            tracing::warn!(effect = effect.name(), tag = %item.tag, id = %item.id, ?why,
                                "inventory sweep: undid a resource that no operation owns");
                        }
                    }
                    Err(e) => {
                        out.errors += 1;
                        if !e.is_definite() {
                            self.unconfirmed().insert(key, (item.tag.clone(), why));
                        }
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
