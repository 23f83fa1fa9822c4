//! The request side of a flash: [`Firmware`], which the firmware handler calls to start a flash
//! or resume what an earlier attempt of its request did, up to the BMC's acceptance.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use idempotency::ErrorChain;
use idempotency_effects::{Attempt, Decided, EffectError, Effects, IntentState, Sent};
use leasebroker_api::{FlashFirmware, NodeId, OperationId};

use super::call::FlashCall;
use super::settle::{Pending, SettleError, settle_pending};
use super::{count_end, keys};
use crate::domain::{Domain, DomainError, FlashEnd, FlashRow, FlashStart};
use crate::hypervisor::client::{FlashRequest, HvError, HypervisorClient};
use crate::hypervisor::redfish::{Firmware as Inventory, RedfishBmc, Target};
use crate::metric::FLASHES_SENT_TOTAL;
use crate::service::{Hook, RequestRecord, ServiceError, Step, call_error, effect_failed, now_micros};

/// The firmware service: starts flashes.
#[derive(Debug, Clone)]
pub struct Firmware {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor, whose API serves the BMCs too.
    pub hypervisor: HypervisorClient,
    /// How long a sent call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
    /// What runs at the handler's named steps (nothing, outside tests).
    pub hook: Hook,
}

/// What a flash's send step came to: the ledger's word, and where the BMC said its task is
/// followed (Redfish).
type SendResult = (Result<idempotency_effects::Outcome, EffectError>, Option<String>);

impl Firmware {
    /// Whether a flash under `op` must be refused because a worker holds the node: it has not
    /// started yet (a retry of a flash that started is answered with its operation whatever
    /// holds the node now), the body does not say `"force": true`, and the node is allocated.
    pub async fn refuses_in_use(
        &self,
        node_id: &str,
        req: &FlashFirmware,
        op: &RequestRecord,
    ) -> Result<bool, ServiceError> {
        // Not a node id at all: the flash answers that there is no such node.
        let Ok(node) = node_id.parse::<NodeId>() else { return Ok(false) };
        if req.force {
            return Ok(false);
        }
        let (op_id, _) = keys(op);
        if self.domain.flash_operation(&op_id).await?.is_some() {
            return Ok(false);
        }
        Ok(self.domain.node_allocated(&node).await?)
    }

    /// The side-effect runner on the service's database.
    fn effects(&self) -> Effects {
        Effects::new(self.domain.ledger()).settle(self.settle)
    }

    /// Starts flashing `node_id` to `req.version` under the request `op`, or resumes what an
    /// earlier attempt of it did. Returns the operation once the BMC accepted the flash (or
    /// refused it: then the operation has failed).
    pub async fn flash(
        &self,
        node_id: &str,
        req: &FlashFirmware,
        op: &RequestRecord,
    ) -> Result<FlashRow, ServiceError> {
        req.validate()?;
        let Ok(node) = node_id.parse::<NodeId>() else {
            return Err(ServiceError::NoSuchNode(node_id.to_owned()));
        };
        let (op_id, tag) = keys(op);
        let attempt = self.effects().attempt(&op.effects_op(crate::service::OpKind::Flash));
        let ledger_op = attempt.operation().id().to_owned();
        let row = match self.domain.start_flash(&op_id, &ledger_op, &node, &req.version, &tag, now_micros()).await? {
            FlashStart::Operation(row) => row,
            FlashStart::Conflict(open) => {
                tracing::info!(node_id, open = %open.op_id, state = %open.state, "another key's flash holds the node; refused");
                let uncertain = open.is_uncertain();
                return Err(ServiceError::OperationConflict { op_id: open.op_id.into(), uncertain });
            }
            FlashStart::NoNode => return Err(ServiceError::NoSuchNode(node_id.to_owned())),
        };
        if row.is_finished() || row.is_accepted() {
            return Ok(row);
        }
        let sent = match self.hypervisor.redfish() {
            Some(bmc) => match self.send_redfish(bmc, req, &row, &attempt).await? {
                Some(sent) => sent,
                None => return self.operation(&op_id).await,
            },
            None => self.send_native(req, &row, &attempt).await?,
        };
        self.after_send(&op_id, &attempt, sent).await?;
        self.operation(&op_id).await
    }

    /// The simulator's BMC API (docs/protocol.md#firmware-operations): the ledger's decision, then the flash call.
    async fn send_native(
        &self,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<SendResult, ServiceError> {
        let effect = self.effect(Some(row.node_id.clone()));
        let decided = attempt.decide(&effect).await.map_err(|e| effect_failed(e, "BMC"))?;
        let (hypervisor, node) = (&self.hypervisor, row.node_id.as_str());
        let sent = attempt
            .run_decided(&effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                let call = FlashRequest { version: req.version.clone(), tag };
                hypervisor.flash(node, &call).await.map_err(call_error)?;
                Ok(Sent::Accepted(node.to_owned()))
            })
            .await;
        Ok((sent, None))
    }

    /// A Redfish BMC: every read first (what an earlier attempt did, the node's `Systems`
    /// member, whether it already runs the version), then the ledger's decision with its send
    /// stamp, then the `SimpleUpdate` POST and nothing else, so the stamp guards the last
    /// network write. `None` when the operation was settled without sending.
    async fn send_redfish(
        &self,
        bmc: &RedfishBmc,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<Option<SendResult>, ServiceError> {
        let Some((target, decided)) = self.before_redfish_send(bmc, req, row, attempt).await? else {
            return Ok(None);
        };
        self.hook.at(Step::FlashSend).await;
        let effect = self.effect(Some(row.node_id.clone()));
        let (task, version, node) = (Mutex::new(None), req.version.as_str(), row.node_id.as_str());
        let (task_ref, domain, op_id) = (&task, &self.domain, &row.op_id);
        let sent = attempt
            .run_decided(&effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                let followed = bmc.flash(&target, version, &tag).await.map_err(call_error)?;
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

    /// Records what the send step came to: accepted (with where its task is followed), refused
    /// (the operation fails), or an error to answer.
    async fn after_send(
        &self,
        op_id: &OperationId,
        attempt: &Attempt,
        (sent, task): SendResult,
    ) -> Result<(), ServiceError> {
        match sent {
            Ok(_) => {
                self.domain.accept_flash(op_id, task.as_deref()).await?;
                finish(attempt).await?;
            }
            Err(EffectError::Refused(e)) => match e.status() {
                // The BMC refused: the operation fails, and the `202` says so.
                Some(status) => {
                    tracing::warn!(error = %ErrorChain(&e), %op_id, "the BMC refused the flash");
                    let end = FlashEnd::Failed(format!("the BMC refused the flash (status {status})"));
                    if self.domain.end_unaccepted_flash(op_id, &end, now_micros()).await? {
                        count_end(&end);
                    }
                    finish(attempt).await?;
                }
                // Never sent: the intent is released, a retry sends it without waiting.
                None => {
                    tracing::warn!(error = %ErrorChain(&e), %op_id, "the BMC is unreachable; the flash was not sent");
                    return Err(ServiceError::upstream("the BMC is unreachable"));
                }
            },
            // The flash pass settled the operation meanwhile: it answers as it is now.
            Err(EffectError::Finished | EffectError::RolledBack) => {}
            Err(e) => return Err(effect_failed(e, "BMC")),
        }
        Ok(())
    }

    /// The flash's effect, for the ledger (`node_id`: what a probe by tag reports found).
    fn effect(&self, node_id: Option<NodeId>) -> FlashCall {
        FlashCall { hypervisor: self.hypervisor.clone(), domain: self.domain.clone(), node_id }
    }

    /// The operation `op_id` as it is now.
    async fn operation(&self, op_id: &OperationId) -> Result<FlashRow, ServiceError> {
        self.domain.flash_operation(op_id).await?.ok_or_else(|| ServiceError::NoSuchOperation(op_id.to_string()))
    }

    /// On a Redfish BMC, what comes before the send (module docs): a flash sent by an earlier
    /// attempt is never sent again, but found by its task or settled by what the BMC serves; a
    /// node that already runs the version is not flashed. Every BMC read is done here, before
    /// the decision. Returns the node's target and the decided intent when the flash is to be
    /// sent now, `None` when the operation was settled without sending.
    async fn before_redfish_send(
        &self,
        bmc: &RedfishBmc,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<Option<(Target, Decided)>, ServiceError> {
        let op_id = &row.op_id;
        let ledger = self.domain.ledger();
        if let Some(intent) = ledger.intent(&row.tag).await.map_err(DomainError::from)? {
            match intent.state {
                IntentState::Pending => {
                    self.settle_redfish_pending(bmc, row, &intent).await?;
                    return Ok(None);
                }
                IntentState::Accepted | IntentState::Done => {
                    self.domain.accept_flash(op_id, None).await?;
                    return Ok(None);
                }
                IntentState::Failed => {} // definitely not sent: sent again below
            }
        }
        let target =
            bmc.target(row.node_id.as_str()).await.map_err(|e| bmc_unavailable(&e, "list the BMC's systems"))?;
        let ended = match &target {
            Target::NotListed { systems } => {
                Some(FlashEnd::Failed(format!("the BMC lists {systems} systems and none is {}", row.node_id)))
            }
            _ => {
                let seen = bmc
                    .firmware(&target, row.node_id.as_str(), &req.version)
                    .await
                    .map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
                if seen == Inventory::Runs {
                    tracing::info!(%op_id, "the node already runs this version; nothing to flash");
                }
                (seen == Inventory::Runs).then_some(FlashEnd::Succeeded)
            }
        };
        if let Some(end) = ended {
            if self.domain.end_unaccepted_flash(op_id, &end, now_micros()).await? {
                count_end(&end);
            }
            return Ok(None);
        }
        match attempt.decide(&self.effect(None)).await {
            // Another attempt sent it between the read above and this step: never twice.
            Ok(Decided::Existing(i)) if i.state == IntentState::Pending => {
                Err(effect_failed(EffectError::Contended, "BMC"))
            }
            Ok(decided) => Ok(Some((target, decided))),
            Err(EffectError::Finished | EffectError::RolledBack) => Ok(None),
            Err(e) => Err(effect_failed(e, "BMC")),
        }
    }

    /// A Redfish flash an earlier attempt sent without learning what came of it
    /// ([`settle_pending`]): adopted, ended, or an answer that says when to retry.
    async fn settle_redfish_pending(
        &self,
        bmc: &RedfishBmc,
        row: &FlashRow,
        intent: &idempotency_effects::Intent,
    ) -> Result<(), ServiceError> {
        match settle_pending(&self.effects(), &self.domain, bmc, row, intent).await {
            Ok(Pending::Adopted | Pending::Ended) => Ok(()),
            Ok(Pending::Settling(e)) => Err(effect_failed(e, "BMC")),
            Ok(Pending::Moved) => Err(effect_failed(EffectError::Contended, "BMC")),
            Ok(Pending::Busy) => Err(ServiceError::upstream(
                "the BMC still runs a task, which may be this flash; retry with the same key",
            )),
            Err(SettleError::Bmc(e)) => Err(bmc_unavailable(&e, "read what became of an earlier attempt's flash")),
            Err(SettleError::Domain(e)) => Err(e.into()),
        }
    }
}

/// Marks the flash's ledger operation finished (its accepted intent stays, for the watcher).
async fn finish(attempt: &Attempt) -> Result<(), DomainError> {
    match attempt.finish().await {
        Ok(()) | Err(EffectError::Finished | EffectError::RolledBack) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The answer when the BMC cannot be asked what the flash needs (a read: nothing was sent).
fn bmc_unavailable(e: &HvError, what: &str) -> ServiceError {
    tracing::warn!(error = %ErrorChain(e), "cannot {what}");
    ServiceError::upstream("the BMC does not answer; retry with the same key")
}
