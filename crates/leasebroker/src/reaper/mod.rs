//! The reaper (docs/protocol.md#side-effects): rolls back what operations nobody finished still hold, cleans up after
//! finished ones, and destroys VMs that landed twice for one boot. It runs on the sweeper's tick
//! (`--sweep-interval`), on every replica; each step is safe to race.
//!
//! It is the effect library's reaper ([`idempotency_effects::Reaper`]: the operations, their
//! intents and their marks are the effect ledger's, on the same database), told by
//! `Operations` (`operations.rs`) what each of leasebroker's operations is: every attempt of a create, a reboot,
//! a delete or a flash writes the operation's row there (its record's scope and id, and when the
//! attempt started). On each tick, after an inventory sweep that deletes VMs with the service's
//! tag nobody owns, the library's reaper reads the record of every operation that is due (its
//! `next_check_at` passed; at most 500 a tick, half the longest due and half the latest due; a
//! row the reaper waits on is put off to when it may change):
//! - an operation with an attempt within `--abandon-after` (and never sooner than the longest
//!   `Retry-After` the service may have told its last attempt, plus [`RETRY_GRACE`]: see
//!   [`Reaper::patience`]): nothing to do yet;
//! - the record completed: the operation finished; its intents are deleted and its row keeps a
//!   compact finished mark until the retention;
//! - an attempt holds the record (in flight, not stale): nothing to do yet;
//! - a create whose record failed, whose claim went stale, or whose record is gone: it is rolled
//!   back, unless its worker exists or was deleted (then it finished). The reaper takes the
//!   record's claim by compare-and-set (so it never races a retry, on any replica), marks the
//!   operation as rolling back (every step of a create checks that mark in its own transaction,
//!   so an attempt still running after its claim went stale can take, call or show nothing
//!   more), waits out the settle window of the last call (if it has not passed, it looks again
//!   then), deletes the VM by tag if one exists, removes the record (so a later retry with that
//!   key runs as a new operation), frees the lease and the node, and only then marks the
//!   operation rolled back: a step that fails leaves it rolling back, and a later tick goes on.
//!
//! A delete cannot be rolled back (its VM may be gone already), so an abandoned delete is
//! finished instead: VM, worker, lease and node, with its tombstone, and the `204` stored under
//! its record. Reboots hold nothing, and a reboot cannot be undone: an abandoned reboot keeps its
//! record and intent until the record expires, so a late retry still finds what it did. A flash
//! is settled by the firmware watcher; the reaper only marks one whose record completed finished.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Store;
use idempotency_effects::{Effect, InventorySweep, ReaperConfig};

use crate::domain::Domain;
use crate::hypervisor::client::HypervisorClient;
use crate::service::Boot;

mod abandoned_create;
mod abandoned_delete;
mod inventory;
mod operations;
mod tick;

use operations::Operations;
pub(crate) use operations::scope_of;
pub use tick::SweepAndReap;

/// How long an in-flight record's attempt may go unrenewed before it counts as stuck (the
/// console's and `lbctl records list --stuck`'s ten minutes).
pub const STUCK_AFTER: Duration = Duration::from_secs(600);
/// The most due operations one backlog count reads.
const BACKLOG_CAP: u32 = 100_000;
/// The most operations one tick looks at (half from each end of the due ones).
const PER_TICK: u32 = 500;

/// How long past the `Retry-After` it was given a retrying client may take to come back (the
/// answer's way to it, its own scheduling), before the reaper may roll its create back.
pub const RETRY_GRACE: Duration = Duration::from_secs(2);

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Abandoned creates rolled back.
    pub rolled_back: u64,
    /// VMs deleted: those of abandoned creates and second VMs of one boot.
    pub vms_deleted: u64,
    /// Operations marked finished (their record completed, or an abandoned delete finished).
    pub forgotten: u64,
    /// Operations left for a later tick (an attempt holds them, a call may still land, or a
    /// step failed).
    pub waiting: u64,
    /// VMs with the service's tag that nobody owned, deleted by the inventory sweep.
    pub orphans_removed: u64,
}

/// The reaper: the library's, with leasebroker's `Operations` (`operations.rs`), and the inventory sweep.
#[derive(Clone)]
pub struct Reaper {
    /// The library's reaper.
    reaper: idempotency_effects::Reaper,
    /// The idempotency store the service runs on (for the stuck-records gauge).
    store: Arc<dyn Store>,
    /// The domain tables.
    domain: Domain,
    /// `--retention`: how long tombstones are kept (longer than any record that could need them).
    retention: Duration,
    /// The inventory sweep (it remembers deletes whose answer was lost, to count each once).
    inventory: InventorySweep,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").field("config", self.reaper.config()).finish_non_exhaustive()
    }
}

/// The reaper's settings, as `serve` takes them.
#[derive(Debug, Clone, Copy)]
pub struct ReaperSettings {
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`.
    pub abandon_after: Duration,
    /// How long past its `Retry-After` a retrying client may take to come back.
    pub retry_grace: Duration,
    /// `--in-flight-ttl`.
    pub in_flight_ttl: Duration,
    /// `--retention`.
    pub retention: Duration,
}

impl ReaperSettings {
    /// How long after an operation's last attempt the reaper waits before it takes the operation
    /// as abandoned: `--abandon-after`, but never less than the longest `Retry-After` that
    /// attempt may have been told while a call of an earlier one could still land (the settle
    /// window from the send stamp, rounded up to whole seconds) plus the retry grace. A shorter
    /// wait rolls back a create whose client is doing what it was told: its retry then runs as a
    /// new operation and boots again.
    pub fn patience(&self) -> Duration {
        let promised = crate::service::longest_settle_retry_after(self.settle);
        self.abandon_after.max(promised + self.retry_grace)
    }
}

impl Reaper {
    /// A reaper of the service on `domain` and `hypervisor`, finding records in `store`.
    pub fn new(store: Arc<dyn Store>, domain: Domain, hypervisor: HypervisorClient, s: ReaperSettings) -> Self {
        let boot: Arc<dyn Effect> = Arc::new(Boot { hypervisor: hypervisor.clone() });
        let inventory = InventorySweep::new(domain.ledger(), vec![boot.clone()], s.settle)
            .owned_by(Arc::new(inventory::WorkerVms(domain.clone())));
        let config = ReaperConfig {
            settle: s.settle,
            abandon_after: s.patience(),
            in_flight_ttl: s.in_flight_ttl,
            retention: s.retention,
            batch: PER_TICK,
        };
        let operations =
            Operations { store: store.clone(), domain: domain.clone(), hypervisor, retention: s.retention };
        let reaper = idempotency_effects::Reaper::new(domain.ledger(), store.clone(), vec![boot], config)
            .service(Arc::new(operations));
        Self { reaper, store, domain, retention: s.retention, inventory }
    }

    /// How long after an operation's last attempt the reaper takes it as abandoned (see
    /// [`ReaperSettings::patience`]).
    pub fn patience(&self) -> Duration {
        self.reaper.config().abandon_after
    }
}
