//! The BMC call of a flash as the effect ledger runs it ([`FlashCall`]): found by its tag, and
//! polled (the simulator's BMC state, or a Redfish task) until the flash ended.

use async_trait::async_trait;
use idempotency_effects::{CallError, Effect, Progress};

use super::count_end;
use super::settle::inventory_runs;
use crate::domain::{Domain, DomainError, FlashRow};
use crate::hypervisor::client::{BmcNode, BmcState, HypervisorClient};
use crate::hypervisor::redfish::{RedfishBmc, TaskLookup, TaskOutcome};
use crate::service::{call_error, now_micros};

/// A firmware flash as the effect ledger runs it: long-running (accepted with `202`, finished
/// minutes later), found by the tag the BMC keeps (simulator: the BMCs holding it; Redfish: a
/// task whose payload carries it), never undone. Polling it reads the BMC and ends the
/// operation's row when the flash ended.
#[derive(Debug, Clone)]
pub(super) struct FlashCall {
    pub(super) hypervisor: HypervisorClient,
    pub(super) domain: Domain,
    /// The node flashed, for a probe (the watcher's instance has none: it polls by tag).
    pub(super) node_id: Option<String>,
}

#[async_trait]
impl Effect for FlashCall {
    fn name(&self) -> &str {
        "flash"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        let found = match self.hypervisor.redfish() {
            Some(bmc) => !matches!(bmc.find_task(tag).await.map_err(call_error)?, TaskLookup::NotFound { .. }),
            None => self.hypervisor.bmcs_by_tag(tag).await.map_err(call_error)? > 0,
        };
        Ok(found.then(|| self.node_id.clone().unwrap_or_default()).into_iter().collect())
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
            return Ok(if row.state == "succeeded" {
                Progress::Done
            } else {
                Progress::Failed(row.error.unwrap_or_default())
            });
        }
        if !row.is_accepted() {
            self.domain.accept_flash(&row.op_id).await.map_err(unavailable)?;
        }
        let ended = match self.hypervisor.redfish() {
            Some(bmc) => self.poll_redfish(bmc, &row).await?,
            None => self.poll_bmc(&row).await?,
        };
        Ok(match ended {
            None => Progress::Running,
            Some(Ok(())) => Progress::Done,
            Some(Err(reason)) => Progress::Failed(reason),
        })
    }
}

impl FlashCall {
    /// Ends the accepted operation `row`; counts and logs it when this call ended it.
    async fn end(&self, row: &FlashRow, result: Result<(), String>) -> Result<Option<Result<(), String>>, CallError> {
        let error = result.as_ref().err().map(String::as_str);
        let ended = self
            .domain
            .finish_flash(&row.op_id, result.is_ok(), error, now_micros())
            .await
            .map_err(CallError::ambiguous)?;
        if ended {
            count_end(result.is_ok());
            let outcome = if result.is_ok() { "succeeded" } else { "failed" };
            tracing::info!(op_id = %row.op_id, node_id = %row.node_id, outcome, error, "operation ended");
        }
        Ok(Some(result))
    }

    /// The simulator's BMC: its state says how the flash went.
    async fn poll_bmc(&self, row: &FlashRow) -> Result<Option<Result<(), String>>, CallError> {
        let Some(bmc) = self.hypervisor.bmc(&row.node_id).await.map_err(call_error)? else {
            return self.end(row, Err("the BMC no longer knows the node".into())).await;
        };
        match outcome(row, &bmc) {
            None => Ok(None),
            Some(Ok(())) => self.end(row, Ok(())).await,
            Some(Err(error)) => {
                if bmc.state == BmcState::Bricked {
                    self.domain.note_bricked(&row.node_id, now_micros()).await.map_err(CallError::ambiguous)?;
                }
                self.end(row, Err(error)).await
            }
        }
    }

    /// A Redfish BMC: the flash's task, found by its answer or by the tag; without one, the
    /// firmware inventory once nothing can still change it.
    async fn poll_redfish(&self, bmc: &RedfishBmc, row: &FlashRow) -> Result<Option<Result<(), String>>, CallError> {
        let task = match bmc.find_task(&row.tag).await.map_err(call_error)? {
            TaskLookup::Found(task) => task,
            TaskLookup::NotFound { busy: true } => return Ok(None),
            TaskLookup::NotFound { busy: false } => {
                let runs = inventory_runs(bmc, row).await.map_err(call_error)?;
                let absent = "the BMC keeps no task for this flash and the node does not run the version";
                return self.end(row, if runs { Ok(()) } else { Err(absent.into()) }).await;
            }
        };
        match bmc.task_outcome(&task).await.map_err(call_error)? {
            TaskOutcome::Running => Ok(None),
            TaskOutcome::Succeeded => {
                bmc.forget(&row.tag);
                self.end(row, Ok(())).await
            }
            TaskOutcome::Failed(reason) => {
                // Some BMCs fail the task of an image the machine already runs: that is done.
                let target = bmc.target(&row.node_id).await.map_err(call_error)?;
                let runs = bmc.runs_version(&target, &row.node_id, &row.version).await.map_err(call_error)?;
                bmc.forget(&row.tag);
                if runs {
                    tracing::info!(op_id = %row.op_id, reason, "the task failed, but the node runs the version");
                }
                self.end(row, if runs { Ok(()) } else { Err(reason) }).await
            }
            TaskOutcome::Gone => {
                // Its monitor is gone: look for the task by tag again next time, or read the
                // inventory.
                bmc.forget(&row.tag);
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
