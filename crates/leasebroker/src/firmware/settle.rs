//! Settling a flash an attempt sent without learning what came of it, shared by the request
//! path and the watcher: adopted when the BMC holds its tag, or ended by the firmware inventory.

use idempotency_effects::{Intent, IntentState};

use super::count_end;
use crate::domain::{Domain, DomainError, FlashRow};
use crate::hypervisor::client::HvError;
use crate::hypervisor::redfish::RedfishBmc;
use crate::service::now_micros;

/// Records that the BMC took the flash an earlier attempt sent (found by its tag): its intent
/// accepted in the ledger (the watcher follows it from there), the operation accepted.
pub(super) async fn adopt(domain: &Domain, row: &FlashRow, intent: &Intent) -> Result<(), DomainError> {
    let ledger = domain.ledger();
    match ledger.record(&intent.op_id, &intent.intent_id, &row.node_id, IntentState::Accepted).await {
        Ok(_) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {}
        Err(e) => return Err(e.into()),
    }
    domain.accept_flash(&row.op_id).await?;
    match ledger.finish(&intent.op_id, now_micros()).await {
        Ok(()) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The firmware inventory's word on a flash whose task is unknown: whether the node runs the
/// version. Asked only once the BMC runs no task: until then the flash may still be writing, and
/// failing it would free the node for a second, bricking one.
pub(super) async fn inventory_runs(bmc: &RedfishBmc, row: &FlashRow) -> Result<bool, HvError> {
    let target = bmc.target(&row.node_id).await?;
    bmc.runs_version(&target, &row.node_id, &row.version).await
}

/// Ends an operation whose flash was sent (its intent `intent` pending) by what the firmware
/// inventory says (`runs`: the node runs the version), and finishes its ledger operation: a
/// Redfish flash is never sent twice, so this is its end. True when this call ended it.
pub(super) async fn conclude_by_inventory(
    domain: &Domain,
    row: &FlashRow,
    intent: &Intent,
    runs: bool,
) -> Result<bool, DomainError> {
    const ABSENT: &str = "the BMC keeps no task for this flash and the node does not run the version";
    let ended = if runs {
        adopt(domain, row, intent).await?;
        domain.finish_flash(&row.op_id, true, None, now_micros()).await?
    } else {
        let ended = domain.fail_unaccepted_flash(&row.op_id, ABSENT, now_micros()).await?;
        match domain.ledger().finish(&intent.op_id, now_micros()).await {
            Ok(()) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {
            }
            Err(e) => return Err(e.into()),
        }
        ended
    };
    if ended {
        count_end(runs);
        tracing::info!(op_id = %row.op_id, succeeded = runs, "operation ended by the BMC's firmware inventory");
    }
    Ok(ended)
}
