//! An abandoned delete, finished (a delete cannot be rolled back): its VM, worker, lease and
//! node, with its tombstone, and the `204` stored under its record.

use idempotency::{Claim, ErrorChain};
use idempotency_effects::OperationRow;

use super::operations::{Operations, record_id_of, scope_of};
use crate::metric::DELETES_FINISHED_TOTAL;
use crate::service::now_micros;

impl Operations {
    /// Finishes an abandoned delete, holding its record's `claim` (`None`: the record is gone):
    /// deletes the VM and then the worker, lease and node with the delete's tombstone, and
    /// stores the `204` the handler would have, so a late retry with the same key replays it.
    /// The library's reaper gives the claim back on an error and marks the operation finished
    /// after it.
    pub(super) async fn finish_delete(&self, op: &OperationRow, claim: Option<&Claim>) -> anyhow::Result<()> {
        let tombstone = idempotency::derive(&scope_of(op)?, &record_id_of(op)?, "delete");
        // The worker, as the delete named it on its row. A row begun before the ledger kept it
        // (a rolling upgrade) has none; its endpoint is `DELETE /v1/workers/{id}`.
        let worker_id = match &op.subject {
            Some(worker) => worker.as_str(),
            None => op.endpoint.rsplit('/').next().unwrap_or_default(),
        };
        let principal = idempotency::Principal::new(op.principal.as_str());
        // Not an id at all (the handler refused it): there is no worker to delete.
        let worker = worker_id.parse::<leasebroker_api::WorkerId>().ok();
        let mut finished = false;
        if let Some(id) = &worker
            && let Some(w) = self.domain.worker(&principal, id).await?
        {
            if let Err(e) = self.hypervisor.delete(&w.vm_id).await {
                anyhow::bail!("cannot delete the abandoned delete's VM: {e}");
            }
            finished = self.domain.delete_worker(&principal, id, tombstone.as_str(), now_micros()).await?;
            if let Err(e) = self.domain.ledger().disown(&w.vm_id).await {
                tracing::warn!(error = %ErrorChain(&e), vm_id = %w.vm_id, "cannot disown a deleted worker's VM");
            }
        }
        let ours = self.domain.tombstone(tombstone.as_str()).await?.is_some_and(|w| w.as_str() == worker_id);
        if let Some(claim) = claim {
            if ours {
                let no_content = idempotency::StoredResponse {
                    status: 204,
                    headers: Vec::new(),
                    body: idempotency::StoredBody::encode(Default::default(), usize::MAX),
                };
                let expires_at = idempotency::later(idempotency::now(), self.retention);
                self.store.complete(claim, &no_content, expires_at).await?;
            } else {
                // It never found the worker: nothing was done, so the key runs afresh.
                self.store.remove(claim).await?;
            }
        }
        if finished {
            metrics::counter!(DELETES_FINISHED_TOTAL).increment(1);
            tracing::info!(op = %op.op_id, key = %op.idem_key, principal = %op.principal, worker = %worker_id,
                "abandoned delete finished");
            crate::activity::record(
                crate::activity::ActionKind::DeleteFinished,
                format!("worker {worker_id}, key {} of {}", op.idem_key, op.principal),
            );
        }
        Ok(())
    }
}
