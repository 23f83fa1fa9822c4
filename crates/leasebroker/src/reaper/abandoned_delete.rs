//! An abandoned delete, finished (a delete cannot be rolled back): its VM, worker, lease and
//! node, with its tombstone, and the `204` stored under its record.

use idempotency::{ErrorChain, Record, RecordId, Scope};
use idempotency_effects::OperationRow;

use super::{ReapReport, Reaper, Reclaimed};
use crate::metric::DELETES_FINISHED_TOTAL;
use crate::service::{micros, now_micros};

impl Reaper {
    /// Finishes an abandoned delete (a delete cannot be rolled back: its VM may be gone already):
    /// takes the record's claim, deletes the VM and then the worker, lease and node with the
    /// delete's tombstone, and stores the `204` the handler would have, so a late retry with
    /// the same key replays it.
    pub(super) async fn finish_delete(
        &self,
        op: &OperationRow,
        record: Option<Record>,
        scope: Scope,
        report: &mut ReapReport,
    ) -> anyhow::Result<Option<i64>> {
        let claim = match self.reclaim_record(record.as_ref()).await? {
            Reclaimed::Held(claim) => claim,
            // A retry (or another replica's reaper) took it first: look again later.
            Reclaimed::TakenFirst => return Ok(Some(now_micros().saturating_add(micros(self.settle)))),
        };
        let Some(record_id) = RecordId::from_hex(&op.record_id) else {
            return Ok(Some(now_micros().saturating_add(micros(self.retention)))); // unreadable: set aside
        };
        let tombstone = idempotency::derive(&scope, &record_id, "delete");
        // The worker, as the delete named it on its row. A row begun before the ledger kept it
        // (a rolling upgrade) has none; its endpoint is `DELETE /v1/workers/{id}`.
        let worker_id = match &op.subject {
            Some(worker) => worker.as_str(),
            None => op.endpoint.rsplit('/').next().unwrap_or_default(),
        };
        let mut finished = false;
        if let Some(w) = self.domain.worker(&op.principal, worker_id).await? {
            if let Err(e) = self.hypervisor.delete(&w.vm_id).await {
                if let Some(claim) = &claim {
                    self.store.fail(claim).await?;
                }
                anyhow::bail!("cannot delete the abandoned delete's VM: {e}");
            }
            finished = self.domain.delete_worker(&op.principal, worker_id, tombstone.as_str(), now_micros()).await?;
            if let Err(e) = self.ledger().disown(&w.vm_id).await {
                tracing::warn!(error = %ErrorChain(&e), vm_id = %w.vm_id, "cannot disown a deleted worker's VM");
            }
        }
        let ours = self.domain.tombstone(tombstone.as_str()).await?.is_some_and(|w| w == worker_id);
        if let Some(claim) = &claim {
            if ours {
                let no_content = idempotency::StoredResponse {
                    status: 204,
                    headers: Vec::new(),
                    body: idempotency::StoredBody::encode(Default::default(), usize::MAX),
                };
                self.store.complete(claim, &no_content, idempotency::later(idempotency::now(), self.retention)).await?;
            } else {
                // It never found the worker: nothing was done, so the key runs afresh.
                self.store.remove(claim).await?;
            }
        }
        self.forget(op).await?;
        if finished {
            metrics::counter!(DELETES_FINISHED_TOTAL).increment(1);
            tracing::info!(op = %op.op_id, key = %op.idem_key, principal = %op.principal, worker = %worker_id,
                "abandoned delete finished");
            crate::activity::record(
                crate::activity::ActionKind::DeleteFinished,
                format!("worker {worker_id}, key {} of {}", op.idem_key, op.principal),
            );
        }
        report.forgotten += 1;
        Ok(None)
    }
}
