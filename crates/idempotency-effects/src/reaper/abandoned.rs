//! What a service tells the reaper about its own operations: which way each kind ends once
//! abandoned, and what the service itself holds and does for it.

use async_trait::async_trait;
use idempotency::Claim;

use crate::ledger::OperationRow;

/// A service's error, from one of its [`Abandoned`] steps, or the reaper's.
pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which way an abandoned operation ends ([`Abandoned::disposal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Disposal {
    /// Rolled back (a create): what its effects made is undone (found by tag, and what its
    /// intents recorded), its record removed (so a later retry with the key runs afresh), what
    /// it holds in the service's tables released ([`Abandoned::release`]), and it is marked
    /// rolled back. The default.
    RollBack,
    /// Finished by the service (a delete cannot be rolled back: its resource may be gone
    /// already): holding the record's claim, the service does what the handler would have and
    /// completes or removes the record ([`Abandoned::finish`]); the operation is marked finished.
    Finish,
    /// Kept as it is (a reboot: nothing held, nothing to undo) until its record expires, so a
    /// late retry still finds what it did; then marked finished.
    Keep,
    /// Settled by another task (the watcher of a long-running effect): the reaper only marks it
    /// finished once its record completed.
    Watched,
    /// Not the reaper's to judge (a kind this version of the service does not know): looked at
    /// again after the retention.
    Aside,
}

/// What a service does about its abandoned operations, for the [`crate::Reaper`]. Every method
/// has a default: a service with nothing of its own to release rolls every operation back.
///
/// The steps may run twice for one operation (a reaper that stopped half-way goes on at its next
/// tick; two replicas' reapers may both reach a step before one of them marks the operation),
/// so each must be idempotent.
#[async_trait]
pub trait Abandoned: Send + Sync + std::fmt::Debug {
    /// Which way `op` ends once abandoned (from its row: its kind). Default:
    /// [`Disposal::RollBack`].
    fn disposal(&self, op: &OperationRow) -> Disposal {
        let _ = op;
        Disposal::RollBack
    }

    /// Whether the service's own tables show `op` finished (its result exists: a worker row),
    /// though its ledger row was never marked so. Then the reaper marks it finished instead of
    /// rolling it back. Asked of live operations to be rolled back. Default: false.
    async fn finished(&self, op: &OperationRow) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
        let _ = op;
        Ok(false)
    }

    /// Releases what `op` took in the service's own tables (a node, a lease), on a rollback:
    /// after its effects were undone and its record removed, before it is marked rolled back.
    /// Default: nothing to release.
    async fn release(&self, op: &OperationRow) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let _ = op;
        Ok(())
    }

    /// Finishes an abandoned operation of [`Disposal::Finish`], holding its record's `claim`
    /// (`None`: the record is gone): does what its handler would have and completes the record
    /// with the answer (or removes it, when nothing was done). An error fails the claim, and the
    /// reaper tries again later. Default: an error (a service that returns
    /// [`Disposal::Finish`] implements it).
    async fn finish(
        &self,
        op: &OperationRow,
        claim: Option<&Claim>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let _ = claim;
        Err(format!("the service cannot finish an abandoned {:?} operation", op.kind).into())
    }

    /// Told once the reaper marked `op` rolled back, `undone` the resources it undid for it
    /// (for the service's metrics and audit log). Told once per operation, by the reaper that
    /// marked it. Does nothing by default.
    fn rolled_back(&self, op: &OperationRow, undone: u64) {
        let _ = (op, undone);
    }
}

/// The [`Abandoned`] of a service that says nothing: every operation is rolled back.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RollBackAll;

impl Abandoned for RollBackAll {}
