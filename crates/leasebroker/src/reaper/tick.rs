//! The reaper's tick: the loop that runs the sweeper and then one reaper pass, and the pass
//! itself (inventory, gauges, the operations due and the verdict on each, pruning).

use std::time::Duration;

use idempotency::{Endpoint, ErrorChain, IdempotencyKey, Principal, Record, RecordState, Scope, Sweeper};
use idempotency_effects::{Mark, OperationRow};

use super::{BACKLOG_CAP, ReapReport, Reaper, STUCK_AFTER};
use crate::background::Pass;
use crate::metric::{FORGOTTEN_TOTAL, REAPER_BACKLOG, RECORDS_STUCK_IN_FLIGHT};
use crate::service::{OpKind, micros, now_micros};

/// The most operations one tick looks at (half from each end of the due ones).
const PER_TICK: u32 = 500;

/// What to do with one operation.
enum Verdict {
    Forget,
    RollBack(Option<Record>),
    FinishDelete(Option<Record>),
    /// Nothing yet: look again at this moment (µs since the epoch).
    Wait(i64),
}

impl Reaper {
    /// One pass: the inventory (late landings, orphans), then the operations due, then old
    /// marks and tombstones.
    pub async fn run_once(&self) -> ReapReport {
        let mut report = ReapReport::default();
        self.sweep_inventory(&mut report).await;
        self.reap_operations(&mut report).await;
        self.read_gauges().await;
        let before = now_micros().saturating_sub(micros(self.retention));
        match self.domain.prune(before).await {
            Ok(n) if n > 0 => tracing::debug!(pruned = n, "old tombstones deleted"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "pruning tombstones failed; trying again next tick"),
        }
        match self.ledger().prune(before).await {
            Ok(n) if n > 0 => tracing::debug!(pruned = n, "old operation marks deleted"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "pruning operation marks failed; trying again next tick"),
        }
        report
    }

    /// Sets [`REAPER_BACKLOG`] and [`RECORDS_STUCK_IN_FLIGHT`]; a read that fails leaves its
    /// gauge as it was (the store-unavailable alert speaks for that).
    async fn read_gauges(&self) {
        match self.domain.operations_due_count(now_micros(), BACKLOG_CAP).await {
            Ok(n) => metrics::gauge!(REAPER_BACKLOG).set(n as f64),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "cannot count the reaper's backlog"),
        }
        let now = idempotency::now();
        let query = idempotency::RecordQuery {
            state: Some(idempotency::RecordState::InFlight),
            principal: None,
            started_before: Some(now - chrono::Duration::from_std(STUCK_AFTER).unwrap_or(chrono::Duration::MAX)),
            now,
            limit: idempotency::MAX_PAGE,
            cursor: None,
        };
        match self.store.list_records(&query).await {
            Ok(page) => metrics::gauge!(RECORDS_STUCK_IN_FLIGHT).set(page.records.len() as f64),
            Err(e) => tracing::debug!(error = %ErrorChain(&e), "cannot count the records stuck in flight"),
        }
    }

    /// Looks at the operations due (at most [`PER_TICK`]); each one the reaper must wait on is
    /// put off to when it may change, so it never delays another.
    async fn reap_operations(&self, report: &mut ReapReport) {
        let now = now_micros();
        let due = match self.ledger().due(now, PER_TICK).await {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "reaper cannot read operations; trying again next tick");
                return;
            }
        };
        for op in due {
            let again = match self.reap(&op, now, report).await {
                Ok(again) => again,
                Err(e) => {
                    tracing::warn!(op = %op.op_id, error = %format!("{e:#}"), "reaper step failed; trying again later");
                    Some(now_micros().saturating_add(micros(self.settle.max(Duration::from_secs(1)))))
                }
            };
            if let Some(at) = again {
                report.waiting += 1;
                if let Err(e) = self.ledger().put_off(&op.op_id, at).await {
                    tracing::warn!(op = %op.op_id, error = %ErrorChain(&e), "cannot put off an operation");
                }
            }
        }
    }

    /// Decides on one operation and acts on it. Returns when to look at it again, if the
    /// reaper must wait on it.
    async fn reap(&self, op: &OperationRow, now: i64, report: &mut ReapReport) -> anyhow::Result<Option<i64>> {
        let settle = micros(self.settle);
        let Some(kind) = OpKind::parse(&op.kind) else {
            tracing::warn!(op = %op.op_id, kind = %op.kind, "an operation of a kind this version does not know; left alone");
            return Ok(Some(now.saturating_add(micros(self.retention))));
        };
        // A flash is settled by the firmware watcher's pass (it adopts or fails what its request
        // left): the reaper only marks one whose record completed finished.
        if kind == OpKind::Flash {
            let completed = match scope_of(op) {
                Ok(scope) => self
                    .store
                    .get(&scope)
                    .await?
                    .is_some_and(|r| r.record_id.to_hex() == op.record_id && r.state == RecordState::Completed),
                Err(_) => false, // moved from before the ledger: no scope kept
            };
            if !completed {
                return Ok(Some(now.saturating_add(micros(self.retention))));
            }
            self.forget(op).await?;
            report.forgotten += 1;
            return Ok(None);
        }
        if op.last_attempt_at > now.saturating_sub(settle) {
            return Ok(Some(op.last_attempt_at.saturating_add(settle))); // an attempt runs or just ran
        }
        let scope = scope_of(op)?;
        let record = self.store.get(&scope).await?.filter(|r| r.record_id.to_hex() == op.record_id);
        let abandoned_at = op.last_attempt_at.saturating_add(micros(self.patience()));
        let abandoned = abandoned_at <= now;
        let verdict = match &record {
            // Taken for a rollback by a tick that stopped half-way: the rollback goes on.
            _ if op.mark == Mark::RollingBack && kind == OpKind::Create => Verdict::RollBack(record.clone()),
            None if kind == OpKind::Create => Verdict::RollBack(None),
            None if kind == OpKind::Delete => Verdict::FinishDelete(None),
            None => Verdict::Forget,
            Some(r) if r.state == RecordState::Completed => Verdict::Forget,
            // Reboots hold nothing and are never undone: wait for the record to expire.
            Some(r) if kind == OpKind::Reboot => Verdict::Wait(r.expires_at.timestamp_micros()),
            Some(r) if !abandoned => Verdict::Wait(abandoned_at.max(now + 1)),
            Some(r) if !self.claimable(r) => Verdict::Wait(now.saturating_add(micros(self.in_flight_ttl))),
            Some(r) if kind == OpKind::Create => Verdict::RollBack(Some(r.clone())),
            Some(r) => Verdict::FinishDelete(Some(r.clone())),
        };
        match verdict {
            Verdict::Wait(at) => Ok(Some(at)),
            Verdict::Forget => {
                self.forget(op).await?;
                metrics::counter!(FORGOTTEN_TOTAL).increment(1);
                report.forgotten += 1;
                Ok(None)
            }
            Verdict::RollBack(record) => self.roll_back(op, record, scope, report).await,
            Verdict::FinishDelete(record) => self.finish_delete(op, record, scope, report).await,
        }
    }

    /// Whether the record is failed, or in flight with a stale claim.
    fn claimable(&self, r: &Record) -> bool {
        match r.state {
            RecordState::Failed => true,
            RecordState::InFlight => r.is_stale(idempotency::now(), self.in_flight_ttl),
            RecordState::Completed => false,
        }
    }
}

/// The record scope an operation row names.
pub(crate) fn scope_of(op: &OperationRow) -> anyhow::Result<Scope> {
    let key = IdempotencyKey::try_from(op.idem_key.as_str()).map_err(|e| anyhow::anyhow!("stored key: {e}"))?;
    Ok(Scope::new(Principal::new(op.principal.as_str()), Endpoint::from_stored(op.endpoint.as_str()), key))
}

/// The reaper's background pass ([`crate::background`]): the idempotency records' sweeper, then
/// one reaper pass.
#[derive(Debug)]
pub struct SweepAndReap {
    /// Deletes expired records.
    pub sweeper: Sweeper,
    /// Then this reaper passes.
    pub reaper: Reaper,
}

impl Pass for SweepAndReap {
    async fn pass(&self) {
        match self.sweeper.run_once().await {
            Ok(0) => {}
            Ok(n) => crate::activity::record(crate::activity::ActionKind::RecordsSwept, format!("{n} record(s)")),
            Err(e) => tracing::warn!(
                error = %ErrorChain(&e),
                "idempotency sweeper pass failed; retrying next interval"
            ),
        }
        let report = self.reaper.run_once().await;
        if report != ReapReport::default() {
            tracing::debug!(?report, "reaper pass");
        }
        if report.forgotten > 0 {
            crate::activity::record(
                crate::activity::ActionKind::OperationsForgotten,
                format!("{} operation(s)", report.forgotten),
            );
        }
    }
}
