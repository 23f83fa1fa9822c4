//! The reaper (SPEC 1.5): rolls back what operations nobody finished still hold, cleans up after
//! finished ones, and destroys VMs that landed twice for one boot. It runs on the sweeper's tick
//! (`--sweep-interval`), on every replica; each step is safe to race.
//!
//! The operations, their intents and their marks are the effect ledger's (`idempotency-effects`,
//! on the same database): every attempt of a create, a reboot or a delete writes the operation's
//! row there (its record's scope and id, and when the attempt started). On each tick the reaper reads the record of every
//! operation that is due (its `next_check_at` passed; at most 500 a tick, half the
//! longest due and half the latest due; a row the reaper waits on is put off to when it may
//! change), after an inventory sweep that deletes VMs with the service's tag nobody owns:
//! - the record completed: the operation finished; its intents are deleted and its row keeps a
//!   compact finished mark until the retention;
//! - an attempt holds the record (in flight, not stale): nothing to do yet;
//! - a create whose record failed or whose claim went stale, with no attempt for
//!   `--abandon-after` (and never sooner than the longest `Retry-After` the service may have told
//!   its last attempt, plus [`RETRY_GRACE`]: see [`Reaper::patience`]): it is rolled back. The reaper takes the record's claim by compare-and-set
//!   (so it never races a retry, on any replica), marks the operation as rolling back (every
//!   step of a create checks that mark in its own transaction, so an attempt still running after
//!   its claim went stale can take, call or show nothing more), waits out the settle window of
//!   the last call (if it has not passed, it looks again next tick), deletes the VM by tag if one exists,
//!   removes the record (so a later retry with that key runs as a new operation), then frees the
//!   lease and the node and forgets the operation;
//! - the record is gone (expired, or removed by a rollback that stopped half-way): a create that
//!   made no worker is rolled back the same way (nothing can resume it: a new record derives new
//!   sub-keys); anything else is forgotten.
//!
//! A delete cannot be rolled back (its VM may be gone already), so an abandoned delete is
//! finished instead: VM, worker, lease and node, with its tombstone, and the `204` stored under
//! its record. Reboots hold nothing, and a reboot cannot be undone: an abandoned reboot keeps its
//! record and intent until the record expires, so a late retry still finds what it did.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Store;
use idempotency_effects::{Effect, InventorySweep, Ledger, LedgerError, OperationRow};

use crate::domain::Domain;
use crate::hypervisor::client::HypervisorClient;
use crate::service::{Boot, now_micros};

mod abandoned_create;
mod abandoned_delete;
mod inventory;
mod tick;

pub use tick::SweepAndReap;
pub(crate) use tick::scope_of;

/// How long an in-flight record's attempt may go unrenewed before it counts as stuck (the
/// console's and `lbctl records list --stuck`'s ten minutes).
pub const STUCK_AFTER: Duration = Duration::from_secs(600);
/// The most due operations one backlog count reads.
const BACKLOG_CAP: u32 = 100_000;

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
    /// Finished operations forgotten.
    pub forgotten: u64,
    /// Operations left for a later tick (an attempt holds them, or a call may still land).
    pub waiting: u64,
    /// VMs with the service's tag that nobody owned, deleted by the inventory sweep.
    pub orphans_removed: u64,
}

/// The reaper's settings and handles.
#[derive(Clone)]
pub struct Reaper {
    /// The idempotency store the service runs on.
    pub store: Arc<dyn Store>,
    /// The domain tables.
    pub domain: Domain,
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`.
    pub abandon_after: Duration,
    /// How long past its `Retry-After` a retrying client may take to come back ([`RETRY_GRACE`]
    /// in the service): see [`Reaper::patience`].
    pub retry_grace: Duration,
    /// `--in-flight-ttl`: when a claim is stale.
    pub in_flight_ttl: Duration,
    /// `--retention`: how long tombstones are kept (longer than any record that could need them).
    pub retention: Duration,
    /// The inventory sweep (it remembers deletes whose answer was lost, to count each once).
    pub inventory: InventorySweep,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper")
            .field("settle", &self.settle)
            .field("abandon_after", &self.abandon_after)
            .field("retry_grace", &self.retry_grace)
            .finish_non_exhaustive()
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

impl Reaper {
    /// A reaper of the service on `domain` and `hypervisor`, finding records in `store`.
    pub fn new(store: Arc<dyn Store>, domain: Domain, hypervisor: HypervisorClient, s: ReaperSettings) -> Self {
        let boot: Arc<dyn Effect> = Arc::new(Boot { hypervisor: hypervisor.clone() });
        let inventory = InventorySweep::new(domain.ledger(), vec![boot], s.settle)
            .owned_by(Arc::new(inventory::WorkerVms(domain.clone())));
        Self {
            store,
            domain,
            hypervisor,
            settle: s.settle,
            abandon_after: s.abandon_after,
            retry_grace: s.retry_grace,
            in_flight_ttl: s.in_flight_ttl,
            retention: s.retention,
            inventory,
        }
    }

    fn ledger(&self) -> Arc<dyn Ledger> {
        self.domain.ledger()
    }

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

    /// Takes an abandoned operation's record, when it has one, for the reaper's own attempt: a
    /// reclaim as a retry's (its TTL, a new attempt's retention).
    async fn reclaim_record(&self, record: Option<&idempotency::Record>) -> Result<Reclaimed, idempotency::StoreError> {
        let Some(record) = record else { return Ok(Reclaimed::Held(None)) };
        let now = idempotency::now();
        let req = idempotency::ReclaimRequest {
            record,
            now,
            in_flight_ttl: self.in_flight_ttl,
            expires_at: idempotency::later(now, self.retention),
        };
        Ok(match self.store.reclaim(req).await? {
            Some(claim) => Reclaimed::Held(Some(claim)),
            None => Reclaimed::TakenFirst,
        })
    }

    /// Marks a finished operation so (its intents go, its mark stays until the retention; what
    /// its done effects made stays owned). An operation marked already is left as it is.
    async fn forget(&self, op: &OperationRow) -> anyhow::Result<()> {
        match self.ledger().finish(&op.op_id, now_micros()).await {
            Ok(()) | Err(LedgerError::Finished | LedgerError::RolledBack) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// What [`Reaper::reclaim_record`] came to.
enum Reclaimed {
    /// The reaper holds the record's claim (`None`: the operation has no record left).
    Held(Option<idempotency::Claim>),
    /// A retry, or another replica's reaper, reclaimed it first.
    TakenFirst,
}
