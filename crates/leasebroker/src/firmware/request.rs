//! The request side of a flash: [`Firmware`], which the firmware handler calls to start a flash
//! or resume what an earlier attempt of its request did, up to the BMC's acceptance.

use std::time::Duration;

use idempotency::ErrorChain;
use idempotency_effects::{Decided, EffectError, Effects, Intent, IntentState, Sent};
use leasebroker_api::{FlashFirmware, is_path_id};

use super::call::FlashCall;
use super::settle::{adopt, conclude_by_inventory, inventory_runs};
use super::{count_end, keys};
use crate::domain::{Domain, DomainError, FlashRow, FlashStart};
use crate::hypervisor::client::{FlashRequest, HvError, HypervisorClient};
use crate::hypervisor::redfish::{RedfishBmc, Target, TaskLookup};
use crate::metric::FLASHES_SENT_TOTAL;
use crate::service::{RequestRecord, ServiceError, call_error, effect_failed, now_micros};

/// The firmware service: starts flashes.
#[derive(Debug, Clone)]
pub struct Firmware {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor, whose API serves the BMCs too.
    pub hypervisor: HypervisorClient,
    /// How long a sent call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
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
        if req.force || !is_path_id(node_id) {
            return Ok(false);
        }
        let (op_id, _) = keys(op);
        if self.domain.flash_operation(&op_id).await?.is_some() {
            return Ok(false);
        }
        Ok(self.domain.node_allocated(node_id).await?)
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
        if !is_path_id(node_id) {
            return Err(ServiceError::NoSuchNode(node_id.to_owned()));
        }
        let (op_id, tag) = keys(op);
        let attempt = self.effects().attempt(&op.effects_op(crate::service::OpKind::Flash));
        let ledger_op = attempt.operation().id().to_owned();
        let row = match self.domain.start_flash(&op_id, &ledger_op, node_id, &req.version, &tag, now_micros()).await? {
            FlashStart::Operation(row) => row,
            FlashStart::Conflict(running) => {
                tracing::info!(node_id, running = %running.op_id, "a flash with another key runs on the node; refused");
                return Err(ServiceError::OperationConflict(running.op_id));
            }
            FlashStart::NoNode => return Err(ServiceError::NoSuchNode(node_id.to_owned())),
        };
        if row.is_finished() || row.is_accepted() {
            return Ok(row);
        }
        let effect = FlashCall {
            hypervisor: self.hypervisor.clone(),
            domain: self.domain.clone(),
            node_id: Some(row.node_id.clone()),
        };
        let decided = match self.hypervisor.redfish() {
            Some(bmc) => match self.before_redfish_send(bmc, req, &row, &attempt).await? {
                Some(decided) => decided,
                None => return self.operation(&op_id).await,
            },
            None => attempt.decide(&effect).await.map_err(|e| effect_failed(e, "BMC"))?,
        };
        let hypervisor = &self.hypervisor;
        let version = req.version.as_str();
        let target_node = row.node_id.as_str();
        let sent = attempt
            .run_decided(&effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                match hypervisor.redfish() {
                    Some(bmc) => {
                        let target = bmc.target(target_node).await.map_err(call_error)?;
                        bmc.flash(&target, version, &tag).await.map_err(call_error)?;
                    }
                    None => {
                        let call = FlashRequest { version: version.to_owned(), tag };
                        hypervisor.flash(target_node, &call).await.map_err(call_error)?;
                    }
                }
                Ok(Sent::Accepted(target_node.to_owned()))
            })
            .await;
        match sent {
            Ok(_) => {
                self.domain.accept_flash(&op_id).await?;
                finish(&attempt).await?;
            }
            Err(EffectError::Refused(e)) => match e.status() {
                // The BMC refused: the operation fails, and the `202` says so.
                Some(status) => {
                    tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC refused the flash");
                    let error = format!("the BMC refused the flash (status {status})");
                    if self.domain.fail_unaccepted_flash(&op_id, &error, now_micros()).await? {
                        count_end(false);
                    }
                    finish(&attempt).await?;
                }
                // Never sent: the intent is released, a retry sends it without waiting.
                None => {
                    tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC is unreachable; the flash was not sent");
                    return Err(ServiceError::upstream("the BMC is unreachable"));
                }
            },
            // The flash pass settled the operation meanwhile: it answers as it is now.
            Err(EffectError::Finished | EffectError::RolledBack) => {}
            Err(e) => return Err(effect_failed(e, "BMC")),
        }
        self.operation(&op_id).await
    }

    /// The operation `op_id` as it is now.
    async fn operation(&self, op_id: &str) -> Result<FlashRow, ServiceError> {
        self.domain.flash_operation(op_id).await?.ok_or_else(|| ServiceError::NoSuchOperation(op_id.to_owned()))
    }

    /// On a Redfish BMC, what comes before the send (module docs): a flash sent by an earlier
    /// attempt is never sent again, but found by its task or settled by the firmware inventory;
    /// a node that already runs the version is not flashed. Returns the decided intent when the
    /// flash is to be sent now, `None` when the operation was settled without sending.
    async fn before_redfish_send(
        &self,
        bmc: &RedfishBmc,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &idempotency_effects::Attempt,
    ) -> Result<Option<Decided>, ServiceError> {
        let op_id = row.op_id.as_str();
        let ledger = self.domain.ledger();
        if let Some(intent) = ledger.intent(&row.tag).await.map_err(DomainError::from)? {
            match intent.state {
                IntentState::Pending => {
                    self.settle_redfish_pending(bmc, row, &intent).await?;
                    return Ok(None);
                }
                IntentState::Accepted | IntentState::Done => {
                    self.domain.accept_flash(op_id).await?;
                    return Ok(None);
                }
                IntentState::Failed => {} // definitely not sent: sent again below
            }
        }
        let target = bmc.target(&row.node_id).await.map_err(|e| bmc_unavailable(&e, "list the BMC's systems"))?;
        let ended = match &target {
            Target::NotListed { systems } => {
                let error = format!("the BMC lists {systems} systems and none is {}", row.node_id);
                Some((false, Some(error)))
            }
            _ => {
                let runs = bmc
                    .runs_version(&target, &row.node_id, &req.version)
                    .await
                    .map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
                if runs {
                    tracing::info!(op_id, "the node already runs this version; nothing to flash");
                }
                runs.then_some((true, None))
            }
        };
        if let Some((succeeded, error)) = ended {
            if self.domain.end_unaccepted_flash(op_id, succeeded, error.as_deref(), now_micros()).await? {
                count_end(succeeded);
            }
            return Ok(None);
        }
        let effect = FlashCall { hypervisor: self.hypervisor.clone(), domain: self.domain.clone(), node_id: None };
        match attempt.decide(&effect).await {
            // Another attempt sent it between the read above and this step: never twice.
            Ok(Decided::Existing(i)) if i.state == IntentState::Pending => {
                Err(effect_failed(EffectError::Contended, "BMC"))
            }
            Ok(decided) => Ok(Some(decided)),
            Err(EffectError::Finished | EffectError::RolledBack) => Ok(None),
            Err(e) => Err(effect_failed(e, "BMC")),
        }
    }

    /// A Redfish flash an earlier attempt sent without learning what came of it: adopted when a
    /// task carries its tag; otherwise, once the settle window passed and the BMC runs no task,
    /// ended by the firmware inventory.
    async fn settle_redfish_pending(
        &self,
        bmc: &RedfishBmc,
        row: &FlashRow,
        intent: &Intent,
    ) -> Result<(), ServiceError> {
        let lookup =
            bmc.find_task(&row.tag).await.map_err(|e| bmc_unavailable(&e, "find the task of an earlier attempt"))?;
        let TaskLookup::NotFound { busy } = lookup else {
            tracing::info!(op_id = %row.op_id, "adopted the flash an earlier attempt sent: its task carries the tag");
            adopt(&self.domain, row, intent).await?;
            return Ok(());
        };
        self.effects().settling(intent).map_err(|e| effect_failed(e, "BMC"))?;
        if busy {
            return Err(ServiceError::upstream(
                "the BMC still runs a task, which may be this flash; retry with the same key",
            ));
        }
        let runs = inventory_runs(bmc, row).await.map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
        conclude_by_inventory(&self.domain, row, intent, runs).await?;
        Ok(())
    }
}

/// Marks the flash's ledger operation finished (its accepted intent stays, for the watcher).
async fn finish(attempt: &idempotency_effects::Attempt) -> Result<(), DomainError> {
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
