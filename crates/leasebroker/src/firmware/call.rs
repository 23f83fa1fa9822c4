//! The BMC call of a flash as the effect ledger runs it ([`FlashCall`]): found by its tag, and
//! polled (the simulator's BMC state, or a Redfish task) until the flash ended.

use async_trait::async_trait;
use idempotency_effects::{CallError, Effect, Progress};

use super::count_end;
use super::settle::end_without_task;
use crate::domain::{Domain, DomainError, FlashEnd, FlashRow};
use crate::hypervisor::client::{BmcNode, BmcState, HypervisorClient};
use crate::hypervisor::redfish::{Firmware, RedfishBmc, TaskLookup, TaskOutcome};
use crate::service::{call_error, now_micros};
use leasebroker_api::{NodeId, OperationState};

/// A firmware flash as the effect ledger runs it: long-running (accepted with `202`, finished
/// minutes later), found by the tag the BMC keeps (simulator: the BMCs holding it; Redfish: a
/// task whose payload carries it), never undone. Polling it reads the BMC and ends the
/// operation's row when the flash ended.
#[derive(Debug, Clone)]
pub(super) struct FlashCall {
    pub(super) hypervisor: HypervisorClient,
    pub(super) domain: Domain,
    /// The node flashed, for a probe (the watcher's instance has none: it polls by tag).
    pub(super) node_id: Option<NodeId>,
}

#[async_trait]
impl Effect for FlashCall {
    fn name(&self) -> &str {
        "flash"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        let found = match self.hypervisor.redfish() {
            Some(bmc) => matches!(bmc.find_task(tag).await.map_err(call_error)?, TaskLookup::Found(_)),
            None => self.hypervisor.bmcs_by_tag(tag).await.map_err(call_error)? > 0,
        };
        let node = self.node_id.as_ref().map(NodeId::to_string).unwrap_or_default();
        Ok(found.then_some(node).into_iter().collect())
    }

    fn keeps(&self) -> bool {
        false
    }

    fn long_running(&self) -> bool {
        true
    }

    async fn poll(&self, tag: &str, _id: &str) -> Result<Progress, CallError> {
        let unavailable = |e: DomainError| CallError::ambiguous(e);
        let Some(row) = self.domain.flash_by_tag(tag).await.map_err(unavailable)? else {
            return Ok(Progress::Failed("no operation carries this flash's tag".into()));
        };
        if row.is_finished() {
            return Ok(if row.state == OperationState::Succeeded {
                Progress::Done
            } else {
                Progress::Failed(row.error.unwrap_or_default())
            });
        }
        if !row.is_accepted() {
            self.domain.accept_flash(&row.op_id, None).await.map_err(unavailable)?;
        }
        let ended = match self.hypervisor.redfish() {
            Some(bmc) => self.poll_redfish(bmc, &row).await?,
            None => self.poll_bmc(&row).await?,
        };
        Ok(match ended {
            None => Progress::Running,
            Some(FlashEnd::Succeeded) => Progress::Done,
            // Uncertain included: nothing more is done for it until an operator resolves it.
            Some(end) => Progress::Failed(end.error().unwrap_or_default().to_owned()),
        })
    }
}

impl FlashCall {
    /// Ends the accepted operation `row`; counts and logs it when this call ended it.
    async fn end(&self, row: &FlashRow, end: FlashEnd) -> Result<Option<FlashEnd>, CallError> {
        let ended = self.domain.finish_flash(&row.op_id, &end, now_micros()).await.map_err(CallError::ambiguous)?;
        if ended {
            count_end(&end);
            tracing::info!(op_id = %row.op_id, node_id = %row.node_id, outcome = %end.state(), error = end.error(), "operation ended");
        }
        Ok(Some(end))
    }

    /// The simulator's BMC: its state says how the flash went.
    async fn poll_bmc(&self, row: &FlashRow) -> Result<Option<FlashEnd>, CallError> {
        let Some(bmc) = self.hypervisor.bmc(row.node_id.as_str()).await.map_err(call_error)? else {
            return self.end(row, FlashEnd::Failed("the BMC no longer knows the node".into())).await;
        };
        match outcome(row, &bmc) {
            None => Ok(None),
            Some(Ok(())) => self.end(row, FlashEnd::Succeeded).await,
            Some(Err(error)) => {
                if bmc.state == BmcState::Bricked {
                    self.domain.note_bricked(&row.node_id, now_micros()).await.map_err(CallError::ambiguous)?;
                }
                self.end(row, FlashEnd::Failed(error)).await
            }
        }
    }

    /// A Redfish BMC: the flash's task, where the operation row says (kept from the BMC's
    /// answer, so any replica follows it) or found by the tag; without one, what the BMC's task
    /// list and inventory say once nothing can still change it.
    async fn poll_redfish(&self, bmc: &RedfishBmc, row: &FlashRow) -> Result<Option<FlashEnd>, CallError> {
        let unavailable = |e: DomainError| CallError::ambiguous(e);
        let task = match &row.task_uri {
            Some(task) => task.clone(),
            None => match bmc.find_task(&row.tag).await.map_err(call_error)? {
                TaskLookup::Found(task) => {
                    self.domain.follow_flash_task(&row.op_id, Some(&task)).await.map_err(unavailable)?;
                    task
                }
                lookup => {
                    return match end_without_task(bmc, row, &lookup).await.map_err(call_error)? {
                        Some(end) => self.end(row, end).await,
                        None => Ok(None),
                    };
                }
            },
        };
        match bmc.task_outcome(&task).await.map_err(call_error)? {
            TaskOutcome::Running => Ok(None),
            TaskOutcome::Succeeded => self.end(row, FlashEnd::Succeeded).await,
            TaskOutcome::Failed(reason) => {
                // Some BMCs fail the task of an image the machine already runs: that is done.
                let runs =
                    bmc.runs_version(row.node_id.as_str(), &row.version).await.map_err(call_error)? == Firmware::Runs;
                if runs {
                    tracing::info!(op_id = %row.op_id, reason, "the task failed, but the node runs the version");
                }
                self.end(row, if runs { FlashEnd::Succeeded } else { FlashEnd::Failed(reason) }).await
            }
            TaskOutcome::Gone => {
                // Its monitor is gone: look for the task by tag again next time, or read the
                // inventory.
                self.domain.follow_flash_task(&row.op_id, None).await.map_err(unavailable)?;
                Ok(None)
            }
        }
    }
}

/// What the BMC's state says of an accepted flash: `None` while it writes, `Ok` when the node
/// runs the version, `Err` with the reason when it failed.
fn outcome(row: &FlashRow, bmc: &BmcNode) -> Option<Result<(), String>> {
    if !bmc.flash_tags.contains(&row.tag) {
        return Some(Err("the BMC has no record of this flash".to_owned()));
    }
    match bmc.state {
        BmcState::Flashing => None,
        BmcState::Bricked => Some(Err("the node is bricked: a second flash started while one was writing".to_owned())),
        BmcState::Ok if bmc.firmware == row.version => Some(Ok(())),
        BmcState::Ok => Some(Err(format!(
            "the flash failed its verification: the node still runs {}",
            bmc.firmware.chars().take(64).collect::<String>()
        ))),
    }
}
