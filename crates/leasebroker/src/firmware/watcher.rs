//! The [`Watcher`], on every replica: follows the accepted flashes to their end (under the
//! ledger's leases), and settles the operations whose request was abandoned before acceptance.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{ErrorChain, RecordState, Store};
use idempotency_effects::{IntentState, Mark, OperationRow};

use super::bmc::{Abandoned, Bmc, Flashes};
use super::call::FlashCall;
use super::count_end;
use crate::background::Pass;
use crate::domain::{Domain, FlashEnd, FlashRow};
use crate::metric::OPERATION_WATCHES_TOTAL;
use crate::service::{Hook, micros, now_micros};

/// The watcher's settings and handles.
#[derive(Clone)]
pub struct Watcher {
    /// The tables.
    pub domain: Domain,
    /// Where the flashes go.
    pub bmc: Arc<dyn Bmc>,
    /// The idempotency store, to ask whether an attempt still holds a flash request's claim.
    pub store: Arc<dyn Store>,
    /// This replica's name on the leases it holds (unique per process).
    pub name: String,
    /// The durations it works by.
    pub settings: WatchSettings,
    /// Where the pass over unaccepted operations goes on from (the last op id it looked at).
    pub cursor: Arc<Mutex<String>>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").field("name", &self.name).field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// The durations a [`Watcher`] works by.
#[derive(Debug, Clone, Copy)]
pub struct WatchSettings {
    /// How often each operation's BMC is polled (`--operation-poll`).
    pub poll: Duration,
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`: an operation never accepted by the BMC, and not sent or retried for
    /// this long, fails.
    pub abandon_after: Duration,
    /// `--in-flight-ttl`: how long an attempt's claim holds unrenewed.
    pub in_flight_ttl: Duration,
}

/// Operations one pass reads at most (accepted ones, and unaccepted ones).
const PAGE: u32 = 500;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchReport {
    /// Accepted flashes this pass polled (leases held).
    pub watched: u64,
    /// Operations that ended.
    pub ended: u64,
}

impl Watcher {
    /// A watcher named `name` (unique per process).
    pub fn new(
        domain: Domain,
        bmc: Arc<dyn Bmc>,
        store: Arc<dyn Store>,
        name: String,
        settings: WatchSettings,
    ) -> Self {
        Self { domain, bmc, store, name, settings, cursor: Arc::default() }
    }

    /// What the BMC's steps work with (the watcher runs no hook).
    fn flashes(&self) -> Flashes {
        Flashes { domain: self.domain.clone(), settle: self.settings.settle, hook: Hook::default() }
    }

    /// How long a lease holds: several polls, so a live watcher always renews it in time.
    fn lease(&self) -> Duration {
        (self.settings.poll * 5).max(Duration::from_secs(10))
    }

    /// One pass: the accepted flashes this watcher holds or can take (the ledger's watcher),
    /// then a page of the operations whose flash the BMC has not been seen to take.
    pub async fn run_once(&self) -> WatchReport {
        let mut report = WatchReport::default();
        let effect = FlashCall { bmc: self.bmc.clone(), flashes: self.flashes(), node_id: None };
        let watcher =
            idempotency_effects::Watcher::new(self.domain.ledger(), vec![Arc::new(effect)], &self.name, self.lease())
                .batch(PAGE);
        match watcher.step().await {
            Ok(w) => {
                metrics::counter!(OPERATION_WATCHES_TOTAL).increment(w.taken);
                report.watched += w.polled;
                report.ended += w.done + w.failed;
            }
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "cannot follow the accepted flashes; trying again next tick")
            }
        }
        let after = self.cursor.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let rows = match self.domain.unaccepted_flashes(&after, PAGE).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "cannot read the running operations; trying again next tick");
                return report;
            }
        };
        // Round the page: from the start again once the last one was read.
        let next = if rows.len() < PAGE as usize {
            String::new()
        } else {
            rows.last().map(|r| r.op_id.to_string()).unwrap_or_default()
        };
        *self.cursor.lock().unwrap_or_else(PoisonError::into_inner) = next;
        for row in rows {
            match self.settle_unaccepted(&row).await {
                Ok(true) => report.ended += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), op_id = %row.op_id, "settling the operation failed; next tick")
                }
            }
        }
        report
    }

    /// An operation whose flash the BMC has not been seen to take: its request was abandoned, or
    /// its attempt still runs. Nothing is concluded while an attempt holds the request's claim
    /// (it may be sending). Otherwise a flash that was sent goes to its BMC's rule
    /// ([`Bmc::settle_abandoned`]: adopted when the BMC holds its tag; on Redfish, ended by what
    /// the BMC serves once no call can still land); one that nobody sent (or retried) for
    /// `--abandon-after` and whose call cannot land fails, after its ledger operation is taken for
    /// a rollback, so no late attempt can send it.
    async fn settle_unaccepted(&self, row: &FlashRow) -> anyhow::Result<bool> {
        let ledger = self.domain.ledger();
        let op = match row.ledger_op.as_deref() {
            Some(ledger_op) => ledger.operation(ledger_op).await?,
            None => None,
        };
        if let Some(op) = &op
            && self.attempt_holds(op).await?
        {
            return Ok(false);
        }
        let intent = ledger.intent(&row.tag).await?;
        let now = now_micros();
        if let Some(intent) = &intent {
            match intent.state {
                IntentState::Accepted | IntentState::Done => {
                    self.domain.accept_flash(&row.op_id, None).await?; // its acceptance was cut short
                    return Ok(false);
                }
                IntentState::Pending => match self.bmc.settle_abandoned(&self.flashes(), row, intent, now).await? {
                    Abandoned::Ended => return Ok(true),
                    Abandoned::Wait => return Ok(false),
                    Abandoned::NeverTaken => {}
                },
                IntentState::Failed => {}
            }
        }
        let Some(ledger_op) = row.ledger_op.as_deref() else { return Ok(false) };
        let last = op.as_ref().map_or(row.created_at, |o| o.last_attempt_at.max(row.created_at));
        if now.saturating_sub(last) < micros(self.settings.abandon_after) {
            return Ok(false);
        }
        // Fence the operation before failing it: a late attempt then sends nothing.
        let taken = match &op {
            Some(op) if op.mark == Mark::Live => ledger.take_for_rollback(ledger_op, op.last_attempt_at).await?,
            Some(op) => op.mark == Mark::RollingBack,
            None => ledger.take_unbegun(&OperationRow::unbegun(ledger_op, "flash", now)).await?,
        };
        if !taken {
            return Ok(false); // an attempt ran a step since: look again later
        }
        let end = FlashEnd::Failed(
            "the flash never reached the BMC, and its request was not retried within --abandon-after".into(),
        );
        let ended = self.domain.end_unaccepted_flash(&row.op_id, &end, now).await?;
        ledger.rolled_back(ledger_op, now_micros()).await?;
        if ended {
            count_end(&end);
            tracing::info!(op_id = %row.op_id, "failed an operation whose flash was never sent");
        }
        Ok(ended)
    }

    /// Whether an attempt holds the request of the ledger operation `op`: its idempotency record
    /// is in flight under a claim that is not stale. Such an attempt may be sending the flash
    /// right now, so nothing is concluded under it.
    async fn attempt_holds(&self, op: &OperationRow) -> anyhow::Result<bool> {
        let Ok(scope) = crate::reaper::scope_of(op) else { return Ok(false) }; // moved from before the ledger
        let now = idempotency::now();
        Ok(self.store.get(&scope).await?.is_some_and(|r| {
            r.record_id.to_hex() == op.record_id
                && r.state == RecordState::InFlight
                && !r.is_stale(now, self.settings.in_flight_ttl)
        }))
    }
}

/// One watcher pass, every `--operation-poll` ([`crate::background`]).
impl Pass for Watcher {
    async fn pass(&self) {
        let report = self.run_once().await;
        if report.ended > 0 {
            tracing::debug!(watched = report.watched, ended = report.ended, "watcher pass");
        }
    }
}
