//! The flash steps on a Redfish BMC ([`RedfishBmc`], `--bmc-url redfish+...`): a flash whose send
//! was stamped is never sent again (the firmware module's docs say why and how).

use std::sync::Mutex;
use std::sync::PoisonError;

use async_trait::async_trait;
use idempotency::ErrorChain;
use idempotency_effects::{Attempt, CallError, Decided, Effect, EffectError, Intent, IntentState, Sent};
use leasebroker_api::FlashFirmware;

use super::{Abandoned, Bmc, Flashes, SendResult};
use crate::domain::{DomainError, FlashEnd, FlashRow};
use crate::firmware::count_end;
use crate::firmware::settle::{Pending, SettleError, end_without_task, settle_pending};
use crate::hypervisor::client::HvError;
use crate::hypervisor::redfish::{Firmware as Inventory, RedfishBmc, Target, TaskLookup, TaskOutcome};
use crate::metric::FLASHES_SENT_TOTAL;
use crate::service::{ServiceError, Step, call_error, effect_failed, now_micros};

#[async_trait]
impl Bmc for RedfishBmc {
    /// A task whose payload carries the tag.
    async fn holds(&self, tag: &str) -> Result<bool, HvError> {
        Ok(matches!(self.find_task(tag).await?, TaskLookup::Found(_)))
    }

    /// Every read first (what an earlier attempt did, the node's `Systems` member, whether it
    /// already runs the version), then the ledger's decision with its send stamp, then the
    /// `SimpleUpdate` POST and nothing else, so the stamp guards the last network write.
    async fn send(
        &self,
        flashes: &Flashes,
        effect: &dyn Effect,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<Option<SendResult>, ServiceError> {
        let Some((target, decided)) = before_send(self, flashes, effect, req, row, attempt).await? else {
            return Ok(None);
        };
        flashes.hook.at(Step::FlashSend).await;
        let (task, version, node) = (Mutex::new(None), req.version.as_str(), row.node_id.as_str());
        let (task_ref, domain, op_id) = (&task, &flashes.domain, &row.op_id);
        let sent = attempt
            .run_decided(effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                let followed = self.flash(&target, version, &tag).await.map_err(call_error)?;
                // Kept before the ledger records the flash accepted: from then on any replica's
                // watcher may take it, and must find where its task is.
                if let Some(task) = &followed
                    && let Err(e) = domain.follow_flash_task(op_id, Some(task)).await
                {
                    tracing::warn!(error = %ErrorChain(&e), %op_id, "cannot keep where the flash's task is; kept on acceptance");
                }
                *task_ref.lock().unwrap_or_else(PoisonError::into_inner) = followed;
                Ok(Sent::Accepted(node.to_owned()))
            })
            .await;
        Ok(Some((sent, task.into_inner().unwrap_or_else(PoisonError::into_inner))))
    }

    /// The flash's task, where the operation row says (kept from the BMC's answer, so any
    /// replica follows it) or found by the tag; without one, what the BMC's task list and
    /// inventory say once nothing can still change it.
    async fn poll(&self, flashes: &Flashes, row: &FlashRow) -> Result<Option<FlashEnd>, CallError> {
        let unavailable = |e: DomainError| CallError::ambiguous(e);
        let task = match &row.task_uri {
            Some(task) => task.clone(),
            None => match self.find_task(&row.tag).await.map_err(call_error)? {
                TaskLookup::Found(task) => {
                    flashes.domain.follow_flash_task(&row.op_id, Some(&task)).await.map_err(unavailable)?;
                    task
                }
                lookup => {
                    return match end_without_task(self, row, &lookup).await.map_err(call_error)? {
                        Some(end) => flashes.end(row, end).await,
                        None => Ok(None),
                    };
                }
            },
        };
        match self.task_outcome(&task).await.map_err(call_error)? {
            TaskOutcome::Running => Ok(None),
            TaskOutcome::Succeeded => flashes.end(row, FlashEnd::Succeeded).await,
            TaskOutcome::Failed(reason) => {
                // Some BMCs fail the task of an image the machine already runs: that is done.
                let runs =
                    self.runs_version(row.node_id.as_str(), &row.version).await.map_err(call_error)? == Inventory::Runs;
                if runs {
                    tracing::info!(op_id = %row.op_id, reason, "the task failed, but the node runs the version");
                }
                flashes.end(row, if runs { FlashEnd::Succeeded } else { FlashEnd::Failed(reason) }).await
            }
            TaskOutcome::Gone => {
                // Its monitor is gone: look for the task by tag again next time, or read the
                // inventory.
                flashes.domain.follow_flash_task(&row.op_id, None).await.map_err(unavailable)?;
                Ok(None)
            }
        }
    }

    /// Never sent again: what the BMC serves decides ([`settle_pending`]); the abandon rule
    /// never fails a flash whose send was stamped.
    async fn settle_abandoned(
        &self,
        flashes: &Flashes,
        row: &FlashRow,
        intent: &Intent,
        _now: i64,
    ) -> anyhow::Result<Abandoned> {
        let pending = settle_pending(&flashes.effects(), &flashes.domain, self, row, intent).await?;
        Ok(if matches!(pending, Pending::Ended) { Abandoned::Ended } else { Abandoned::Wait })
    }
}

/// What comes before the send (the firmware module's docs): a flash sent by an earlier attempt
/// is never sent again, but found by its task or settled by what the BMC serves; a node that
/// already runs the version is not flashed. Every BMC read is done here, before the decision.
/// Returns the node's target and the decided intent when the flash is to be sent now, `None`
/// when the operation was settled without sending.
async fn before_send(
    bmc: &RedfishBmc,
    flashes: &Flashes,
    effect: &dyn Effect,
    req: &FlashFirmware,
    row: &FlashRow,
    attempt: &Attempt,
) -> Result<Option<(Target, Decided)>, ServiceError> {
    let (op_id, domain) = (&row.op_id, &flashes.domain);
    if let Some(intent) = domain.ledger().intent(&row.tag).await.map_err(DomainError::from)? {
        match intent.state {
            IntentState::Pending => {
                settle_earlier(bmc, flashes, row, &intent).await?;
                return Ok(None);
            }
            IntentState::Accepted | IntentState::Done => {
                domain.accept_flash(op_id, None).await?;
                return Ok(None);
            }
            IntentState::Failed => {} // definitely not sent: sent again below
        }
    }
    let target = bmc.target(row.node_id.as_str()).await.map_err(|e| unavailable(&e, "list the BMC's systems"))?;
    let ended = match &target {
        Target::NotListed { systems } => {
            Some(FlashEnd::Failed(format!("the BMC lists {systems} systems and none is {}", row.node_id)))
        }
        _ => {
            let seen = bmc
                .firmware(&target, row.node_id.as_str(), &req.version)
                .await
                .map_err(|e| unavailable(&e, "read the firmware inventory"))?;
            if seen == Inventory::Runs {
                tracing::info!(%op_id, "the node already runs this version; nothing to flash");
            }
            (seen == Inventory::Runs).then_some(FlashEnd::Succeeded)
        }
    };
    if let Some(end) = ended {
        if domain.end_unaccepted_flash(op_id, &end, now_micros()).await? {
            count_end(&end);
        }
        return Ok(None);
    }
    match attempt.decide(effect).await {
        // Another attempt sent it between the read above and this step: never twice.
        Ok(Decided::Existing(i)) if i.state == IntentState::Pending => {
            Err(effect_failed(EffectError::Contended, "BMC"))
        }
        Ok(decided) => Ok(Some((target, decided))),
        Err(EffectError::Finished | EffectError::RolledBack) => Ok(None),
        Err(e) => Err(effect_failed(e, "BMC")),
    }
}

/// A flash an earlier attempt sent without learning what came of it ([`settle_pending`]):
/// adopted, ended, or an answer that says when to retry.
async fn settle_earlier(
    bmc: &RedfishBmc,
    flashes: &Flashes,
    row: &FlashRow,
    intent: &Intent,
) -> Result<(), ServiceError> {
    match settle_pending(&flashes.effects(), &flashes.domain, bmc, row, intent).await {
        Ok(Pending::Adopted | Pending::Ended) => Ok(()),
        Ok(Pending::Settling(e)) => Err(effect_failed(e, "BMC")),
        Ok(Pending::Moved) => Err(effect_failed(EffectError::Contended, "BMC")),
        Ok(Pending::Busy) => {
            Err(ServiceError::upstream("the BMC still runs a task, which may be this flash; retry with the same key"))
        }
        Err(SettleError::Bmc(e)) => Err(unavailable(&e, "read what became of an earlier attempt's flash")),
        Err(SettleError::Domain(e)) => Err(e.into()),
    }
}

/// The answer when the BMC cannot be asked what the flash needs (a read: nothing was sent).
fn unavailable(e: &HvError, what: &str) -> ServiceError {
    tracing::warn!(error = %ErrorChain(e), "cannot {what}");
    ServiceError::upstream("the BMC does not answer; retry with the same key")
}
