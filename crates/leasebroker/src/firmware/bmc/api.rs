//! [`ApiBmc`]: the BMCs behind the hypervisor API's `/v1/bmc` (docs/protocol.md#firmware-operations).

use async_trait::async_trait;
use idempotency_effects::{Attempt, CallError, Effect, Intent, Sent};
use leasebroker_api::FlashFirmware;

use super::{Abandoned, Bmc, Flashes, SendResult};
use crate::domain::{FlashEnd, FlashRow};
use crate::firmware::settle::adopt;
use crate::hypervisor::client::{BmcNode, BmcState, FlashRequest, HvError, HypervisorClient};
use crate::metric::FLASHES_SENT_TOTAL;
use crate::service::{ServiceError, call_error, effect_failed, micros, now_micros};

/// The BMCs of the hypervisor API: each keeps the tags of the flashes it took, and its state says
/// how the last one went. A flash whose answer was lost is found by its tag; one the BMC never
/// took is sent again by the effect ledger's rules once its settle window has passed.
#[derive(Debug, Clone)]
pub struct ApiBmc(HypervisorClient);

impl ApiBmc {
    /// The BMCs behind `hypervisor`'s API.
    pub fn new(hypervisor: HypervisorClient) -> Self {
        Self(hypervisor)
    }
}

#[async_trait]
impl Bmc for ApiBmc {
    /// `GET /v1/bmc?tag=T` lists a node.
    async fn holds(&self, tag: &str) -> Result<bool, HvError> {
        Ok(self.0.bmcs_by_tag(tag).await? > 0)
    }

    /// The ledger's decision, then the flash call (`POST /v1/bmc/{node_id}/flash`).
    async fn send(
        &self,
        _flashes: &Flashes,
        effect: &dyn Effect,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<Option<SendResult>, ServiceError> {
        let decided = attempt.decide(effect).await.map_err(|e| effect_failed(e, "BMC"))?;
        let (hypervisor, node) = (&self.0, row.node_id.as_str());
        let sent = attempt
            .run_decided(effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                let call = FlashRequest { version: req.version.clone(), tag };
                hypervisor.flash(node, &call).await.map_err(call_error)?;
                Ok(Sent::Accepted(node.to_owned()))
            })
            .await;
        Ok(Some((sent, None)))
    }

    /// The node's BMC state says how the flash went.
    async fn poll(&self, flashes: &Flashes, row: &FlashRow) -> Result<Option<FlashEnd>, CallError> {
        let Some(bmc) = self.0.bmc(row.node_id.as_str()).await.map_err(call_error)? else {
            return flashes.end(row, FlashEnd::Failed("the BMC no longer knows the node".into())).await;
        };
        match outcome(row, &bmc) {
            None => Ok(None),
            Some(Ok(())) => flashes.end(row, FlashEnd::Succeeded).await,
            Some(Err(error)) => {
                if bmc.state == BmcState::Bricked {
                    flashes.domain.note_bricked(&row.node_id, now_micros()).await.map_err(CallError::ambiguous)?;
                }
                flashes.end(row, FlashEnd::Failed(error)).await
            }
        }
    }

    /// A flash the BMC holds by tag is adopted; one it does not hold waits out its settle window
    /// (its call may still land), then the abandon rule may fail it.
    async fn settle_abandoned(
        &self,
        flashes: &Flashes,
        row: &FlashRow,
        intent: &Intent,
        now: i64,
    ) -> anyhow::Result<Abandoned> {
        if self.holds(&row.tag).await? {
            adopt(&flashes.domain, row, intent, None).await?;
            tracing::info!(op_id = %row.op_id, "adopted a flash whose request was abandoned after sending it");
            return Ok(Abandoned::Wait);
        }
        if now.saturating_sub(intent.sent_at) < micros(flashes.settle) {
            return Ok(Abandoned::Wait); // its call may still land
        }
        Ok(Abandoned::NeverTaken)
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
