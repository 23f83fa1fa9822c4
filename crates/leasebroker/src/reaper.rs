//! The reaper (SPEC 1.5): rolls back what operations nobody finished still hold, cleans up after
//! finished ones, and destroys VMs that landed twice for one boot. It runs on the sweeper's tick
//! (`--sweep-interval`), on every replica; each step is safe to race.
//!
//! The operations, their intents and their marks are the effect ledger's (`idempotency-effects`,
//! on the same database): every attempt of a create, a reboot or a delete writes the operation's
//! row there (its record's scope and id, and when the attempt started). On each tick the reaper reads the record of every
//! operation that is due (its `next_check_at` passed; at most 500 a tick, half the
//! longest due and half the latest due; a row the reaper waits on is put off to when it may
//! change), after an inventory sweep that deletes VMs with the service's tag nobody owns:
//! - the record completed: the operation finished; its intents are deleted and its row keeps a
//!   compact finished mark until the retention;
//! - an attempt holds the record (in flight, not stale): nothing to do yet;
//! - a create whose record failed or whose claim went stale, with no attempt for
//!   `--abandon-after` (and never sooner than the longest `Retry-After` the service may have told
//!   its last attempt, plus [`RETRY_GRACE`]: see [`Reaper::patience`]): it is rolled back. The reaper takes the record's claim by compare-and-set
//!   (so it never races a retry, on any replica), marks the operation as rolling back (every
//!   step of a create checks that mark in its own transaction, so an attempt still running after
//!   its claim went stale can take, call or show nothing more), waits out the settle window of
//!   the last call (if it has not passed, it looks again next tick), deletes the VM by tag if one exists,
//!   removes the record (so a later retry with that key runs as a new operation), then frees the
//!   lease and the node and forgets the operation;
//! - the record is gone (expired, or removed by a rollback that stopped half-way): a create that
//!   made no worker is rolled back the same way (nothing can resume it: a new record derives new
//!   sub-keys); anything else is forgotten.
//!
//! A delete cannot be rolled back (its VM may be gone already), so an abandoned delete is
//! finished instead: VM, worker, lease and node, with its tombstone, and the `204` stored under
//! its record. Reboots hold nothing, and a reboot cannot be undone: an abandoned reboot keeps its
//! record and intent until the record expires, so a late retry still finds what it did.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Endpoint, ErrorChain, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, Store, Sweeper,
};
use idempotency_effects::{Effect, IntentState, InventorySweep, Ledger, LedgerError, Mark, OperationRow};
use tokio::task::JoinHandle;

use crate::domain::Domain;
use crate::hypervisor::client::HypervisorClient;
use crate::service::{Boot, CreateKeys, OpKind, micros, now_micros};

mod inventory;

/// Counter: what the reaper rolled back, labelled `resource` (`operation`, `vm`, `lease`, `node`).
pub const ROLLED_BACK_TOTAL: &str = "leasebroker_reaper_rolled_back_total";
/// Counter: abandoned deletes the reaper finished (VM, worker, lease, node; 204 stored).
pub const DELETES_FINISHED_TOTAL: &str = "leasebroker_reaper_deletes_finished_total";
/// Counter: finished operations whose intents and row the reaper deleted.
pub const FORGOTTEN_TOTAL: &str = "leasebroker_reaper_forgotten_total";
/// Counter: VMs carrying one of the service's tags that no live operation or worker owned,
/// deleted by the inventory sweep (a boot that landed after its operation was rolled back).
pub const ORPHANS_REMOVED_TOTAL: &str = "leasebroker_orphans_removed_total";
/// Gauge: operations due for the reaper and not looked at yet, after its last tick (counted up
/// to [`BACKLOG_CAP`]): above zero for long, the reaper falls behind.
pub const REAPER_BACKLOG: &str = "leasebroker_reaper_backlog_operations";
/// Gauge: records in flight whose attempt has not been renewed for [`STUCK_AFTER`] (counted up
/// to one page of the records listing), read at each reaper tick.
pub const RECORDS_STUCK_IN_FLIGHT: &str = "leasebroker_records_stuck_in_flight";
/// How long an in-flight record's attempt may go unrenewed before it counts as stuck (the
/// console's and `lbctl records list --stuck`'s ten minutes).
pub const STUCK_AFTER: Duration = Duration::from_secs(600);
/// The most due operations one backlog count reads.
const BACKLOG_CAP: u32 = 100_000;

/// Registers the help text of leasebroker's side-effect metrics with the installed recorder.
pub fn describe_metrics() {
    use crate::service::{DUPLICATE_VMS_DESTROYED_TOTAL, REFUSALS_RELEASED_TOTAL};
    metrics::describe_counter!(
        DUPLICATE_VMS_DESTROYED_TOTAL,
        "Second VMs of one boot deleted: calls that landed after --hypervisor-settle (set it longer)"
    );
    metrics::describe_counter!(REFUSALS_RELEASED_TOTAL, "Creates whose node and lease were given back on a refusal");
    metrics::describe_counter!(
        ROLLED_BACK_TOTAL,
        "What the reaper rolled back, by resource (operation, vm, lease, node)"
    );
    metrics::describe_counter!(DELETES_FINISHED_TOTAL, "Abandoned deletes the reaper finished");
    metrics::describe_counter!(FORGOTTEN_TOTAL, "Finished operations whose rows and intents the reaper deleted");
    metrics::describe_counter!(
        ORPHANS_REMOVED_TOTAL,
        "VMs with the service's tag that no live operation or worker owned, deleted by the inventory sweep"
    );
    metrics::describe_gauge!(
        REAPER_BACKLOG,
        "Operations due for the reaper and not looked at yet, after its last tick"
    );
    metrics::describe_gauge!(
        RECORDS_STUCK_IN_FLIGHT,
        "Records in flight whose attempt has not been renewed for ten minutes, read at each reaper tick"
    );
}

/// How long past the `Retry-After` it was given a retrying client may take to come back (the
/// answer's way to it, its own scheduling), before the reaper may roll its create back.
pub const RETRY_GRACE: Duration = Duration::from_secs(2);

/// The most operations one tick looks at (half from each end of the due ones).
const PER_TICK: u32 = 500;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Abandoned creates rolled back.
    pub rolled_back: u64,
    /// VMs deleted: those of abandoned creates and second VMs of one boot.
    pub vms_deleted: u64,
    /// Finished operations forgotten.
    pub forgotten: u64,
    /// Operations left for a later tick (an attempt holds them, or a call may still land).
    pub waiting: u64,
    /// VMs with the service's tag that nobody owned, deleted by the inventory sweep.
    pub orphans_removed: u64,
}

/// The reaper's settings and handles.
#[derive(Clone)]
pub struct Reaper {
    /// The idempotency store the service runs on.
    pub store: Arc<dyn Store>,
    /// The domain tables.
    pub domain: Domain,
    /// The hypervisor.
    pub hypervisor: HypervisorClient,
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`.
    pub abandon_after: Duration,
    /// How long past its `Retry-After` a retrying client may take to come back ([`RETRY_GRACE`]
    /// in the service): see [`Reaper::patience`].
    pub retry_grace: Duration,
    /// `--in-flight-ttl`: when a claim is stale.
    pub in_flight_ttl: Duration,
    /// `--retention`: how long tombstones are kept (longer than any record that could need them).
    pub retention: Duration,
    /// The inventory sweep (it remembers deletes whose answer was lost, to count each once).
    pub inventory: InventorySweep,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper")
            .field("settle", &self.settle)
            .field("abandon_after", &self.abandon_after)
            .field("retry_grace", &self.retry_grace)
            .finish_non_exhaustive()
    }
}

/// What to do with one operation.
enum Verdict {
    Forget,
    RollBack(Option<Record>),
    FinishDelete(Option<Record>),
    /// Nothing yet: look again at this moment (µs since the epoch).
    Wait(i64),
}

/// The reaper's settings, as `serve` takes them.
#[derive(Debug, Clone, Copy)]
pub struct ReaperSettings {
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`.
    pub abandon_after: Duration,
    /// How long past its `Retry-After` a retrying client may take to come back.
    pub retry_grace: Duration,
    /// `--in-flight-ttl`.
    pub in_flight_ttl: Duration,
    /// `--retention`.
    pub retention: Duration,
}

impl Reaper {
    /// A reaper of the service on `domain` and `hypervisor`, finding records in `store`.
    pub fn new(store: Arc<dyn Store>, domain: Domain, hypervisor: HypervisorClient, s: ReaperSettings) -> Self {
        let boot: Arc<dyn Effect> = Arc::new(Boot { hypervisor: hypervisor.clone() });
        let inventory = InventorySweep::new(domain.ledger(), vec![boot], s.settle)
            .owned_by(Arc::new(inventory::WorkerVms(domain.clone())));
        Self {
            store,
            domain,
            hypervisor,
            settle: s.settle,
            abandon_after: s.abandon_after,
            retry_grace: s.retry_grace,
            in_flight_ttl: s.in_flight_ttl,
            retention: s.retention,
            inventory,
        }
    }

    fn ledger(&self) -> Arc<dyn Ledger> {
        self.domain.ledger()
    }

    /// How long after an operation's last attempt the reaper waits before it takes the operation
    /// as abandoned: `--abandon-after`, but never less than the longest `Retry-After` that
    /// attempt may have been told while a call of an earlier one could still land (the settle
    /// window from the send stamp, rounded up to whole seconds) plus the retry grace. A shorter
    /// wait rolls back a create whose client is doing what it was told: its retry then runs as a
    /// new operation and boots again.
    pub fn patience(&self) -> Duration {
        let promised = crate::service::longest_settle_retry_after(self.settle);
        self.abandon_after.max(promised + self.retry_grace)
    }

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

    /// Rolls back an abandoned create: VM by tag, record, lease and node, intents.
    async fn roll_back(
        &self,
        op: &OperationRow,
        record: Option<Record>,
        scope: Scope,
        report: &mut ReapReport,
    ) -> anyhow::Result<Option<i64>> {
        let Some(keys) = keys_of(op, &scope) else {
            return Ok(Some(now_micros().saturating_add(micros(self.retention)))); // unreadable: set aside
        };
        // A create that made its worker finished: the worker is its result, never rolled back.
        if self.domain.worker(&op.principal, &keys.worker_id()).await?.is_some()
            || self.domain.is_deleted(&keys.worker_id()).await?
        {
            self.forget(op).await?;
            report.forgotten += 1;
            return Ok(None);
        }
        if let Some(at) = self.settles_at(&op.op_id).await? {
            return Ok(Some(at));
        }
        let t = idempotency::now();
        let claim = match &record {
            Some(r) => match self.store.reclaim(r, t, self.in_flight_ttl, after(t, self.retention)).await? {
                Some(claim) => Some(claim),
                // A retry (or another replica's reaper) took it first: look again later.
                None => return Ok(Some(now_micros().saturating_add(micros(self.settle)))),
            },
            None => None,
        };
        // Holding the claim, no attempt can start. One that started earlier may still run (its
        // claim went stale while it waited on a restarting database): taking the operation
        // fences it off, since every step of a create checks this mark in its own transaction.
        // The mark is taken by compare-and-set on the attempt time the reaper decided from: an
        // attempt that ran a step since (or finished the create) keeps it.
        if op.mark == Mark::Live && !self.ledger().take_for_rollback(&op.op_id, op.last_attempt_at).await? {
            // The record is given back, failed: a retry resumes (or answers from the worker).
            if let Some(claim) = &claim {
                self.store.fail(claim).await?;
            }
            return Ok(Some(now_micros().saturating_add(micros(self.settle))));
        }
        // Check the window once more: a step that committed before the mark may have sent a call.
        if let Some(at) = self.settles_at(&op.op_id).await? {
            if let Some(claim) = &claim {
                self.store.fail(claim).await?;
            }
            return Ok(Some(at));
        }
        // What the boot made: found by its tag, and what its intent recorded.
        let boot = Boot { hypervisor: self.hypervisor.clone() };
        let recorded = self.ledger().intents(&op.op_id).await?.into_iter().filter_map(|i| i.resource_id);
        let mut vms = match boot.probe(keys.boot.as_str()).await {
            Ok(vms) => vms,
            Err(e) => {
                if let Some(claim) = &claim {
                    self.store.fail(claim).await?;
                }
                anyhow::bail!("cannot list the abandoned create's VMs: {e}");
            }
        };
        vms.extend(recorded);
        vms.sort();
        vms.dedup();
        let mut vms_deleted = 0;
        for vm_id in &vms {
            match boot.undo(vm_id).await {
                Ok(existed) => vms_deleted += u64::from(existed),
                Err(e) => {
                    if let Some(claim) = &claim {
                        self.store.fail(claim).await?;
                    }
                    anyhow::bail!("cannot delete the abandoned create's VM {vm_id}: {e}");
                }
            }
        }
        // The record first: from here a retry runs as a new operation, with new sub-keys, so
        // nothing can resume this one while its lease and node are freed.
        if let Some(claim) = &claim {
            self.store.remove(claim).await?;
        }
        let released = self.domain.release(keys.alloc.as_str(), &keys.lease_id()).await?;
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "vm").increment(vms_deleted);
        if !self.ledger().rolled_back(&op.op_id, now_micros()).await? {
            return Ok(None); // another replica's reaper finished this rollback first
        }
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "operation").increment(1);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "lease").increment(released.leases);
        metrics::counter!(ROLLED_BACK_TOTAL, "resource" => "node").increment(released.nodes);
        tracing::info!(
            op = %op.op_id, key = %op.idem_key, principal = %op.principal,
            vms = vms_deleted, leases = released.leases, nodes = released.nodes,
            "abandoned create rolled back"
        );
        crate::activity::record(
            crate::activity::ActionKind::RolledBack,
            format!(
                "{} key {} of {}: {vms_deleted} VM(s), {} lease(s), {} node(s)",
                op.endpoint, op.idem_key, op.principal, released.leases, released.nodes
            ),
        );
        report.rolled_back += 1;
        report.vms_deleted += vms_deleted;
        Ok(None)
    }

    /// Finishes an abandoned delete (a delete cannot be rolled back: its VM may be gone already):
    /// takes the record's claim, deletes the VM and then the worker, lease and node with the
    /// delete's tombstone, and stores the `204` the handler would have, so a late retry with
    /// the same key replays it.
    async fn finish_delete(
        &self,
        op: &OperationRow,
        record: Option<Record>,
        scope: Scope,
        report: &mut ReapReport,
    ) -> anyhow::Result<Option<i64>> {
        let t = idempotency::now();
        let claim = match &record {
            Some(r) => match self.store.reclaim(r, t, self.in_flight_ttl, after(t, self.retention)).await? {
                Some(claim) => Some(claim),
                None => return Ok(Some(now_micros().saturating_add(micros(self.settle)))),
            },
            None => None,
        };
        let Some(record_id) = RecordId::from_hex(&op.record_id) else {
            return Ok(Some(now_micros().saturating_add(micros(self.retention)))); // unreadable: set aside
        };
        let tombstone = idempotency::derive(&scope, &record_id, "delete");
        // The delete's endpoint is `DELETE /v1/workers/{id}`.
        let worker_id = op.endpoint.rsplit('/').next().unwrap_or_default();
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
                self.store.complete(claim, &no_content, after(idempotency::now(), self.retention)).await?;
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

    /// When the settle window of the operation's last call ends, if it has not passed
    /// (`None`: no call may still land: none was made, it was refused, or it is done).
    async fn settles_at(&self, op_id: &str) -> anyhow::Result<Option<i64>> {
        let intents = self.ledger().intents(op_id).await?;
        let Some(sent_at) = intents.iter().filter(|i| i.state == IntentState::Pending).map(|i| i.sent_at).max() else {
            return Ok(None);
        };
        let at = sent_at.saturating_add(micros(self.settle));
        let left = at.saturating_sub(now_micros());
        if left > 0 {
            tracing::info!(op_id, left_ms = left / 1000, "abandoned create's last call may still land; waiting");
            return Ok(Some(at));
        }
        Ok(None)
    }

    /// Marks a finished operation so (its intents go, its mark stays until the retention; what
    /// its done effects made stays owned). An operation marked already is left as it is.
    async fn forget(&self, op: &OperationRow) -> anyhow::Result<()> {
        match self.ledger().finish(&op.op_id, now_micros()).await {
            Ok(()) | Err(LedgerError::Finished | LedgerError::RolledBack) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// `t + d`, saturating.
fn after(t: idempotency::Timestamp, d: Duration) -> idempotency::Timestamp {
    chrono::Duration::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC)
}

/// The record scope an operation row names.
fn scope_of(op: &OperationRow) -> anyhow::Result<Scope> {
    let key = IdempotencyKey::try_from(op.idem_key.as_str()).map_err(|e| anyhow::anyhow!("stored key: {e}"))?;
    Ok(Scope::new(Principal::new(op.principal.as_str()), Endpoint::from_stored(op.endpoint.as_str()), key))
}

/// The sub-keys of the create `op` (derived from its scope and record id: the record itself may
/// be gone).
fn keys_of(op: &OperationRow, scope: &Scope) -> Option<CreateKeys> {
    RecordId::from_hex(&op.record_id).map(|id| CreateKeys::of_scope(scope, &id))
}

/// Runs `sweeper` and then `reaper` on one tick, every `interval`. Abort the handle to stop.
pub fn spawn_with_sweeper(sweeper: Sweeper, reaper: Reaper, interval: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match sweeper.run_once().await {
                Ok(0) => {}
                Ok(n) => crate::activity::record(crate::activity::ActionKind::RecordsSwept, format!("{n} record(s)")),
                Err(e) => tracing::warn!(
                    error = %ErrorChain(&e),
                    "idempotency sweeper pass failed; retrying next interval"
                ),
            }
            let report = reaper.run_once().await;
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
    })
}
