//! The reaper's tick: the loop that runs the sweeper and then one reaper pass, and the pass
//! itself (inventory, the library's reaper over the operations due, gauges, pruning).

use idempotency::{ErrorChain, Sweeper};

use super::{BACKLOG_CAP, ReapReport, Reaper, STUCK_AFTER};
use crate::background::Pass;
use crate::metric::{FORGOTTEN_TOTAL, REAPER_BACKLOG, RECORDS_STUCK_IN_FLIGHT};
use crate::service::{micros, now_micros};

impl Reaper {
    /// One pass: the inventory (late landings, orphans), then the library's reaper over the
    /// operations due (and the old marks), then old tombstones.
    pub async fn run_once(&self) -> ReapReport {
        let mut report = ReapReport::default();
        self.sweep_inventory(&mut report).await;
        match self.reaper.tick().await {
            Ok(pass) => {
                report.rolled_back = pass.rolled_back;
                report.vms_deleted += pass.undone;
                report.forgotten = pass.finished;
                report.waiting = pass.waiting + pass.errors;
                metrics::counter!(FORGOTTEN_TOTAL).increment(pass.finished);
            }
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "reaper cannot read operations; trying again next tick"),
        }
        self.read_gauges().await;
        let before = now_micros().saturating_sub(micros(self.retention));
        match self.domain.prune(before).await {
            Ok(n) if n > 0 => tracing::debug!(pruned = n, "old tombstones deleted"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "pruning tombstones failed; trying again next tick"),
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
