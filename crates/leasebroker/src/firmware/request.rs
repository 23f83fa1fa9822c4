//! The request side of a flash: [`Firmware`], which the firmware handler calls to start a flash
//! or resume what an earlier attempt of its request did, up to the BMC's acceptance.

use std::sync::Arc;
use std::time::Duration;

use idempotency::ErrorChain;
use idempotency_effects::{Attempt, EffectError};
use leasebroker_api::{FlashFirmware, NodeId, OperationId};

use super::bmc::{Bmc, Flashes, SendResult};
use super::call::FlashCall;
use super::{count_end, keys};
use crate::domain::{Domain, DomainError, FlashEnd, FlashRow, FlashStart};
use crate::service::{Hook, RequestRecord, ServiceError, effect_failed, now_micros};

/// The firmware service: starts flashes.
#[derive(Debug, Clone)]
pub struct Firmware {
    /// The tables.
    pub domain: Domain,
    /// Where the flashes go.
    pub bmc: Arc<dyn Bmc>,
    /// How long a sent call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
    /// What runs at the handler's named steps (nothing, outside tests).
    pub hook: Hook,
}

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

    /// What the BMC's steps work with.
    fn flashes(&self) -> Flashes {
        Flashes { domain: self.domain.clone(), settle: self.settle, hook: self.hook.clone() }
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
        let attempt = self.flashes().effects().attempt(&op.effects_op(crate::service::OpKind::Flash));
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
        let effect = self.effect(Some(row.node_id.clone()));
        let Some(sent) = self.bmc.send(&self.flashes(), &effect, req, &row, &attempt).await? else {
            return self.operation(&op_id).await;
        };
        self.after_send(&op_id, &attempt, sent).await?;
        self.operation(&op_id).await
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
        FlashCall { bmc: self.bmc.clone(), flashes: self.flashes(), node_id }
    }

    /// The operation `op_id` as it is now.
    async fn operation(&self, op_id: &OperationId) -> Result<FlashRow, ServiceError> {
        self.domain.flash_operation(op_id).await?.ok_or_else(|| ServiceError::NoSuchOperation(op_id.to_string()))
    }
}

/// Marks the flash's ledger operation finished (its accepted intent stays, for the watcher).
async fn finish(attempt: &Attempt) -> Result<(), DomainError> {
    match attempt.finish().await {
        Ok(()) | Err(EffectError::Finished | EffectError::RolledBack) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
