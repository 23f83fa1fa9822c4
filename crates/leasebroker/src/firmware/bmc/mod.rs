//! Where the flashes go: [`Bmc`], one small trait with two homes, each with one constructor.
//!
//! - [`ApiBmc::new`]: the BMCs behind the hypervisor API's `/v1/bmc` (the simulator's, or a
//!   hypervisor that serves that API). The BMC keeps each flash's tag, so a flash whose answer was
//!   lost is found by it; one nobody can find is sent again by the effect ledger's rules once its
//!   settle window has passed.
//! - [`RedfishBmc::new`](crate::hypervisor::RedfishBmc::new) (`--bmc-url redfish+...`): a
//!   Redfish service. A flash whose send was stamped is never sent again: it is found by its task,
//!   or ended by what the BMC's task list and firmware inventory say, `uncertain` when they say
//!   nothing.
//!
//! The two protocols keep different safety rules, so the trait is drawn at the flash's steps (send,
//! follow, settle what an abandoned request left) rather than at the wire calls: each home runs
//! its own rule behind the same four methods, and the request path, the ledger's effect and the
//! watcher call them without asking which home they have.

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use idempotency_effects::{Attempt, CallError, Effect, EffectError, Effects, Intent};
use leasebroker_api::FlashFirmware;

use super::count_end;
use crate::domain::{Domain, FlashEnd, FlashRow};
use crate::hypervisor::client::HvError;
use crate::service::{Hook, ServiceError, now_micros};

mod api;
mod redfish;

pub use api::ApiBmc;

/// What a flash's send step came to: the ledger's word, and where the BMC said its task is
/// followed (Redfish).
pub type SendResult = (Result<idempotency_effects::Outcome, EffectError>, Option<String>);

/// What a BMC says of a flash whose request was abandoned after its intent was recorded
/// ([`Bmc::settle_abandoned`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// The operation ended, now or by another pass or attempt meanwhile.
    Ended,
    /// Nothing to conclude yet: the BMC took the flash (adopted: the watcher follows it), its
    /// call may still land, or a task still runs that may be it.
    Wait,
    /// The BMC never took it and its call can no longer land: the abandon rule may fail it.
    NeverTaken,
}

/// The flash steps of one kind of BMC (module docs). Every error says whether the call may have
/// taken effect: a read that failed sends nothing, and a send whose answer was lost is found
/// again by its tag.
#[async_trait]
pub trait Bmc: Send + Sync + Debug {
    /// Whether the BMC took a flash carrying `tag`.
    async fn holds(&self, tag: &str) -> Result<bool, HvError>;

    /// Sends the flash of `row` (to `req.version`) under `attempt`, as the ledger decides for
    /// `effect`; or settles what an earlier attempt of the request sent. `None` when the
    /// operation was settled without sending.
    async fn send(
        &self,
        flashes: &Flashes,
        effect: &dyn Effect,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &Attempt,
    ) -> Result<Option<SendResult>, ServiceError>;

    /// Reads how the accepted flash of `row` stands, and ends its operation when the flash
    /// ended: `None` while it writes.
    async fn poll(&self, flashes: &Flashes, row: &FlashRow) -> Result<Option<FlashEnd>, CallError>;

    /// The watcher's look at an operation whose request was abandoned after it recorded the
    /// flash's intent (`intent`, pending) without learning whether the BMC took it: adopts a
    /// flash the BMC took, ends what the BMC's rules let it end, and says whether the abandon
    /// rule may fail the rest. `now` is the pass's clock, in microseconds.
    async fn settle_abandoned(
        &self,
        flashes: &Flashes,
        row: &FlashRow,
        intent: &Intent,
        now: i64,
    ) -> anyhow::Result<Abandoned>;
}

/// What a [`Bmc`]'s steps work with: the tables, the settle window, and the hook at the
/// handler's named steps.
#[derive(Debug, Clone)]
pub struct Flashes {
    /// The tables (and the effect ledger in them).
    pub domain: Domain,
    /// How long a sent call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
    /// What runs at the handler's named steps (nothing, outside tests).
    pub hook: Hook,
}

impl Flashes {
    /// The side-effect runner on the service's database.
    pub(super) fn effects(&self) -> Effects {
        Effects::new(self.domain.ledger()).settle(self.settle)
    }

    /// Ends the accepted operation `row`; counts and logs it when this call ended it.
    pub(super) async fn end(&self, row: &FlashRow, end: FlashEnd) -> Result<Option<FlashEnd>, CallError> {
        let ended = self.domain.finish_flash(&row.op_id, &end, now_micros()).await.map_err(CallError::ambiguous)?;
        if ended {
            count_end(&end);
            tracing::info!(op_id = %row.op_id, node_id = %row.node_id, outcome = %end.state(), error = end.error(), "operation ended");
        }
        Ok(Some(end))
    }
}
