//! Settling a flash an attempt sent without learning what came of it, shared by the request
//! path and the watcher: adopted when the BMC holds its tag, or ended by what the BMC's task
//! list and firmware inventory say, `uncertain` when they say nothing.

use std::time::Duration;

use idempotency_effects::{EffectError, Effects, Intent, IntentState, LedgerError};

use super::count_end;
use crate::domain::{Domain, DomainError, FlashEnd, FlashRow};
use crate::hypervisor::client::HvError;
use crate::hypervisor::redfish::{Firmware, RedfishBmc, TaskLookup};
use crate::service::now_micros;

/// Why an operation fails when the BMC keeps no task for its flash and its inventory, read once
/// no task runs, does not show the version.
pub(super) const ABSENT: &str = "the BMC keeps no task for this flash and the node does not run the version";
/// Why an operation is uncertain on a BMC that lists no tasks (whether the flash still writes
/// cannot be read) while its inventory does not show the version yet.
const UNLISTED: &str = "the BMC lists no tasks, so whether this flash still writes cannot be read, and the node \
                        does not run the version: check the machine and resolve the operation";
/// Why an operation is uncertain on a BMC that serves no firmware inventory.
const NO_INVENTORY: &str = "the BMC keeps no task for this flash and serves no firmware inventory, so what came of \
                            it cannot be read: check the machine and resolve the operation";

/// Records that the BMC took the flash an earlier attempt sent (found by its tag, its task at
/// `task`): its intent accepted in the ledger (the watcher follows it from there), the operation
/// accepted.
pub(super) async fn adopt(
    domain: &Domain,
    row: &FlashRow,
    intent: &Intent,
    task: Option<&str>,
) -> Result<(), DomainError> {
    let ledger = domain.ledger();
    if task.is_some() {
        // Before the ledger records it accepted: any replica's watcher may take it from then on.
        domain.follow_flash_task(&row.op_id, task).await?;
    }
    match ledger.record(&intent.op_id, &intent.intent_id, row.node_id.as_str(), IntentState::Accepted).await {
        Ok(_) | Err(LedgerError::Finished | LedgerError::RolledBack) => {}
        Err(e) => return Err(e.into()),
    }
    domain.accept_flash(&row.op_id, task).await?;
    finish_ledger_op(domain, &intent.op_id).await
}

/// Marks the flash's ledger operation finished (it may be already).
async fn finish_ledger_op(domain: &Domain, op_id: &str) -> Result<(), DomainError> {
    match domain.ledger().finish(op_id, now_micros()).await {
        Ok(()) | Err(LedgerError::Finished | LedgerError::RolledBack) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// How a flash whose task cannot be followed ended, by what the BMC serves (`lookup`: its task
/// list's word): the node's inventory shows the version, succeeded; a BMC that lists tasks, runs
/// none, and whose inventory does not show it, failed; anything that cannot be read, uncertain.
/// `None` while a task still runs (it may be this flash) or one carries the tag.
pub(super) async fn end_without_task(
    bmc: &RedfishBmc,
    row: &FlashRow,
    lookup: &TaskLookup,
) -> Result<Option<FlashEnd>, HvError> {
    if matches!(lookup, TaskLookup::Found(_) | TaskLookup::NotFound { busy: true }) {
        return Ok(None);
    }
    Ok(Some(match (bmc.runs_version(row.node_id.as_str(), &row.version).await?, lookup) {
        (Firmware::Runs, _) => FlashEnd::Succeeded,
        (Firmware::Absent, TaskLookup::NotFound { .. }) => FlashEnd::Failed(ABSENT.to_owned()),
        (Firmware::Absent, _) => FlashEnd::Uncertain(UNLISTED.to_owned()),
        (Firmware::NotServed, _) => FlashEnd::Uncertain(NO_INVENTORY.to_owned()),
    }))
}

/// What [`settle_pending`] came to.
#[derive(Debug)]
pub(super) enum Pending {
    /// A task carries the flash's tag: adopted, the watcher follows it.
    Adopted,
    /// The operation ended, now or by another pass or attempt meanwhile.
    Ended,
    /// A call may still land: the settle window since the send stamp has not passed
    /// ([`EffectError::Settling`], with the seconds left).
    Settling(EffectError),
    /// A task still runs on the BMC, which may be this flash.
    Busy,
    /// The send stamp moved since it was read: an attempt took it again and may be sending.
    Moved,
}

/// Why [`settle_pending`] could not tell.
#[derive(Debug, thiserror::Error)]
pub(super) enum SettleError {
    /// The BMC did not answer a read.
    #[error("the BMC did not answer")]
    Bmc(#[from] HvError),
    /// The database failed.
    #[error(transparent)]
    Domain(#[from] DomainError),
}

/// How far ahead of the clock the stamp that fences a conclusion lies: none (nothing is sent
/// under it; should the conclusion not follow, the next look waits a settle window from it).
const FENCE_AHEAD: Duration = Duration::ZERO;

/// A Redfish flash an attempt sent (its intent pending) without learning what came of it:
/// adopted when a task carries its tag; else, once the settle window has passed since its send
/// stamp and no task runs, ended by the firmware inventory ([`end_without_task`]).
///
/// Before it ends the operation it moves the send stamp from the value it read, by
/// compare-and-set: an attempt that wakes from a pause and would stamp again from that value
/// finds it moved and sends nothing, and an attempt that moved it first (it may be sending now)
/// makes this answer [`Pending::Moved`], to be looked at again once its window has passed.
pub(super) async fn settle_pending(
    effects: &Effects,
    domain: &Domain,
    bmc: &RedfishBmc,
    row: &FlashRow,
    intent: &Intent,
) -> Result<Pending, SettleError> {
    let lookup = bmc.find_task(&row.tag).await?;
    if let TaskLookup::Found(task) = &lookup {
        tracing::info!(op_id = %row.op_id, "adopted a flash an earlier attempt sent: its task carries the tag");
        adopt(domain, row, intent, Some(task)).await?;
        return Ok(Pending::Adopted);
    }
    if let Err(e) = effects.settling(intent) {
        return Ok(Pending::Settling(e));
    }
    let Some(end) = end_without_task(bmc, row, &lookup).await? else { return Ok(Pending::Busy) };
    let ledger = domain.ledger();
    match ledger.stamp(&intent.op_id, &intent.intent_id, intent.sent_at, FENCE_AHEAD).await {
        Ok(Some(_)) => {}
        Ok(None) => return Ok(Pending::Moved),
        Err(LedgerError::Finished | LedgerError::RolledBack) => return Ok(Pending::Ended),
        Err(e) => return Err(DomainError::from(e).into()),
    }
    conclude(domain, row, intent, &end).await?;
    Ok(Pending::Ended)
}

/// Ends an operation whose flash was sent (its intent `intent` pending, its stamp fenced) as
/// `end` says, and finishes its ledger operation: a Redfish flash is never sent twice, so this
/// is its end. True when this call ended it.
async fn conclude(domain: &Domain, row: &FlashRow, intent: &Intent, end: &FlashEnd) -> Result<bool, DomainError> {
    let now = now_micros();
    let ended = match end {
        FlashEnd::Succeeded => {
            adopt(domain, row, intent, None).await?;
            domain.finish_flash(&row.op_id, end, now).await?
        }
        FlashEnd::Failed(_) | FlashEnd::Uncertain(_) => {
            let ended = domain.end_unaccepted_flash(&row.op_id, end, now).await?;
            finish_ledger_op(domain, &intent.op_id).await?;
            ended
        }
    };
    if ended {
        count_end(end);
        tracing::info!(op_id = %row.op_id, outcome = %end.state(), error = end.error(), "operation ended by what the BMC serves");
    }
    Ok(ended)
}
