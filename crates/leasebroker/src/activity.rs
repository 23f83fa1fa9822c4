//! What the reaper and the inventory sweep did lately, for the console (docs/protocol.md#operating-it): a bounded
//! in-memory ring of this process's recent actions.
//!
//! The service keeps no table of these actions (their totals are metrics counters, their details
//! log lines), so each one is also put here, newest last, at most [`CAPACITY`] of them. The ring
//! is process-wide, like the metrics recorder: the reaper, the sweeper and the duplicate check
//! feed it wherever they run, and the console reads it. It holds this process's actions only:
//! with several replicas, each console shows what its own reaper did.

use std::collections::VecDeque;
use std::sync::Mutex;

/// How many actions the ring keeps.
pub const CAPACITY: usize = 200;

/// What was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActionKind {
    /// The reaper rolled back an abandoned create (its VM, lease and node).
    RolledBack,
    /// The reaper finished an abandoned delete.
    DeleteFinished,
    /// The inventory sweep deleted a VM nobody owned.
    OrphanRemoved,
    /// A second VM of one boot was deleted.
    DuplicateDestroyed,
    /// The reaper forgot finished operations (a count per pass).
    OperationsForgotten,
    /// The sweeper deleted expired idempotency records (a count per pass).
    RecordsSwept,
}

impl ActionKind {
    /// A short name for people.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RolledBack => "rolled back an abandoned create",
            Self::DeleteFinished => "finished an abandoned delete",
            Self::OrphanRemoved => "deleted an orphan VM (inventory sweep)",
            Self::DuplicateDestroyed => "deleted a duplicate VM",
            Self::OperationsForgotten => "forgot finished operations",
            Self::RecordsSwept => "swept expired records",
        }
    }
}

/// One action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// When, in µs since the epoch.
    pub at: i64,
    /// What.
    pub kind: ActionKind,
    /// On what: an operation, its key and principal, a VM, a count.
    pub detail: String,
}

static RECENT: Mutex<VecDeque<Action>> = Mutex::new(VecDeque::new());

/// Notes that `kind` was done on `detail`, now; the oldest action goes when the ring is full.
pub fn record(kind: ActionKind, detail: impl Into<String>) {
    let action = Action { at: idempotency::now().timestamp_micros(), kind, detail: detail.into() };
    let mut ring = RECENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if ring.len() == CAPACITY {
        ring.pop_front();
    }
    ring.push_back(action);
}

/// The latest `limit` actions, newest first.
pub fn recent(limit: usize) -> Vec<Action> {
    let ring = RECENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    ring.iter().rev().take(limit).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_latest_actions_newest_first_and_stays_bounded() {
        for i in 0..CAPACITY + 50 {
            record(ActionKind::OrphanRemoved, format!("ring-test-{i}"));
        }
        let all = recent(usize::MAX);
        assert!(all.len() <= CAPACITY, "{} actions kept", all.len());
        let ours: Vec<&str> =
            all.iter().filter(|a| a.detail.starts_with("ring-test-")).map(|a| a.detail.as_str()).collect();
        // Tests in this process may record too, but never more than the capacity in all.
        assert_eq!(ours.first().copied(), Some(format!("ring-test-{}", CAPACITY + 49).as_str()));
        assert!(!ours.contains(&"ring-test-0"), "the oldest went first");
        assert_eq!(recent(3).len(), 3);
    }
}
