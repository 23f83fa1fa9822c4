//! leasebroker's operations as the library's reaper asks about them: which way each kind ends
//! once abandoned, and what a create holds (and a delete does) in the service's own tables.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{Claim, Endpoint, IdempotencyKey, Principal, RecordId, Scope, Store};
use idempotency_effects::{Abandoned, Disposal, OperationRow};

use crate::domain::Domain;
use crate::hypervisor::client::HypervisorClient;
use crate::service::{CreateKeys, OpKind};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the reaper needs of the service to end its operations.
#[derive(Clone)]
pub(super) struct Operations {
    /// The idempotency store the service runs on.
    pub(super) store: Arc<dyn Store>,
    /// The domain tables.
    pub(super) domain: Domain,
    /// The hypervisor.
    pub(super) hypervisor: HypervisorClient,
    /// `--retention`: how long the `204` of a finished delete is kept.
    pub(super) retention: Duration,
}

impl std::fmt::Debug for Operations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operations").field("retention", &self.retention).finish_non_exhaustive()
    }
}

#[async_trait]
impl Abandoned for Operations {
    fn disposal(&self, op: &OperationRow) -> Disposal {
        match OpKind::parse(&op.kind) {
            Some(OpKind::Create) => Disposal::RollBack,
            Some(OpKind::Delete) => Disposal::Finish,
            Some(OpKind::Reboot) => Disposal::Keep,
            Some(OpKind::Flash) => Disposal::Watched,
            None => {
                tracing::warn!(op = %op.op_id, kind = %op.kind, "an operation of a kind this version does not know; left alone");
                Disposal::Aside
            }
        }
    }

    async fn finished(&self, op: &OperationRow) -> Result<bool, BoxError> {
        Ok(self.create_finished(op).await?)
    }

    async fn release(&self, op: &OperationRow) -> Result<(), BoxError> {
        Ok(self.release_create(op).await?)
    }

    async fn finish(&self, op: &OperationRow, claim: Option<&Claim>) -> Result<(), BoxError> {
        Ok(self.finish_delete(op, claim).await?)
    }

    fn rolled_back(&self, op: &OperationRow, undone: u64) {
        self.create_rolled_back(op, undone);
    }
}

/// The record scope an operation row names.
pub(crate) fn scope_of(op: &OperationRow) -> anyhow::Result<Scope> {
    let key = IdempotencyKey::try_from(op.idem_key.as_str()).map_err(|e| anyhow::anyhow!("stored key: {e}"))?;
    Ok(Scope::new(Principal::new(op.principal.as_str()), Endpoint::from_stored(op.endpoint.as_str()), key))
}

/// The record id an operation row names.
pub(super) fn record_id_of(op: &OperationRow) -> anyhow::Result<RecordId> {
    RecordId::from_hex(&op.record_id).ok_or_else(|| anyhow::anyhow!("stored record id {:?}", op.record_id))
}

/// The sub-keys of the create `op` (derived from its scope and record id: the record itself may
/// be gone).
pub(super) fn keys_of(op: &OperationRow) -> anyhow::Result<CreateKeys> {
    Ok(CreateKeys::of_scope(&scope_of(op)?, &record_id_of(op)?))
}
