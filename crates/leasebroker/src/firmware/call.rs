//! The BMC call of a flash as the effect ledger runs it ([`FlashCall`]): found by its tag, and
//! polled (through the [`Bmc`]) until the flash ended.

use std::sync::Arc;

use async_trait::async_trait;
use idempotency_effects::{CallError, Effect, Progress};

use super::bmc::{Bmc, Flashes};
use crate::domain::{DomainError, FlashEnd};
use crate::service::call_error;
use leasebroker_api::{NodeId, OperationState};

/// A firmware flash as the effect ledger runs it: long-running (accepted with `202`, finished
/// minutes later), found by the tag the BMC keeps ([`Bmc::holds`]), never undone. Polling it
/// reads the BMC and ends the operation's row when the flash ended.
#[derive(Debug, Clone)]
pub(super) struct FlashCall {
    pub(super) bmc: Arc<dyn Bmc>,
    pub(super) flashes: Flashes,
    /// The node flashed, for a probe (the watcher's instance has none: it polls by tag).
    pub(super) node_id: Option<NodeId>,
}

#[async_trait]
impl Effect for FlashCall {
    fn name(&self) -> &str {
        "flash"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        let found = self.bmc.holds(tag).await.map_err(call_error)?;
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
        let domain = &self.flashes.domain;
        let unavailable = |e: DomainError| CallError::ambiguous(e);
        let Some(row) = domain.flash_by_tag(tag).await.map_err(unavailable)? else {
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
            domain.accept_flash(&row.op_id, None).await.map_err(unavailable)?;
        }
        Ok(match self.bmc.poll(&self.flashes, &row).await? {
            None => Progress::Running,
            Some(FlashEnd::Succeeded) => Progress::Done,
            // Uncertain included: nothing more is done for it until an operator resolves it.
            Some(end) => Progress::Failed(end.error().unwrap_or_default().to_owned()),
        })
    }
}
