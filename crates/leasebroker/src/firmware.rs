//! Firmware flashes: an idempotent long-running operation (SPEC 3.4).
//!
//! A second flash of a BMC while the first still writes bricks the machine, and a flash takes
//! minutes, so a flash runs as an operation: the request creates it and answers `202` as soon as
//! the BMC accepted the flash, and the [`Watcher`] follows it to its end.
//!
//! - **One operation per key.** The operation's row is keyed by the request record's derived
//!   sub-key `flash-op`; a retry of the same key finds it. The idempotency record completes with
//!   the `202` at acceptance, so a retry while the flash runs, or after, replays that `202` at
//!   once (the body shows the operation as it was then; `GET /admin/v1/operations/{id}` shows it
//!   now).
//! - **One running operation per node.** A partial UNIQUE index on the rows: a flash with another
//!   key while one runs on the node answers `409 operation-conflict` naming the running one, and
//!   never reaches the BMC.
//! - **The BMC call is an effect of the effect ledger** (`idempotency-effects`, as boots and
//!   reboots are): its tag is the derived sub-key `flash`; it is sent only by the attempt that
//!   recorded its intent with its send stamp, or moved that stamp by compare-and-set; a retry that
//!   finds it pending asks the BMC for nodes holding the tag before anything else, and sends again
//!   only when none does and the settle window (`--hypervisor-settle`) has passed since the last
//!   send.
//! - **The watcher** runs on every replica. An accepted flash is followed by the ledger's
//!   [`idempotency_effects::Watcher`], which holds a lease on the flash's intent, taken by
//!   compare-and-set, so several replicas never follow one flash at once, and a replica that dies
//!   leaves a lease that expires and is taken over. A pass also settles operations whose request
//!   was abandoned before acceptance: it adopts a flash the BMC holds by tag, and fails one nobody
//!   sent or retried within `--abandon-after`, after taking its ledger operation for a rollback
//!   (so no late attempt can send it).
//! - **On a Redfish BMC** (`--bmc-url redfish+...`, [`crate::hypervisor::redfish`]) the tag rides in
//!   the image URI, and a flash whose send was stamped is never sent again: a retry (or the
//!   watcher) finds its task by the tag in the tasks' payloads; where the BMC keeps none, it
//!   waits out the settle window and for the BMC to run no task, then reads the node's firmware
//!   inventory (the version there: succeeded; absent: failed). The watcher follows the task
//!   (`TaskState`, `TaskStatus`). A node that already runs the version is not flashed: its
//!   operation succeeds at once, and a task that failed on a node that runs the version counts
//!   as done.

use idempotency::ErrorChain;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_effects::{
    CallError, Decided, Effect, EffectError, Effects, Intent, IntentState, Mark, OperationRow, Progress, Sent,
};
use leasebroker_validation::{FlashFirmware, is_path_id};
use tokio::task::JoinHandle;

use crate::domain::{Domain, DomainError, FlashRow, FlashStart};
use crate::hypervisor::client::{BmcNode, BmcState, FlashRequest, HvError, HypervisorClient};
use crate::hypervisor::redfish::{RedfishBmc, Target, TaskLookup, TaskOutcome};
use crate::service::{Operation, ServiceError, call_error, effect_failed, micros, now_micros, public_id};

/// Counter: operations that ended, labelled `kind` (`firmware-flash`) and `outcome`
/// (`succeeded`, `failed`).
pub const OPERATIONS_TOTAL: &str = "leasebroker_operations_total";
/// Counter: operations a watcher started following (a lease taken that another watcher did not
/// hold). With several replicas, their sum is the number of operations followed, once each.
pub const OPERATION_WATCHES_TOTAL: &str = "leasebroker_operation_watches_total";
/// Counter: flashes sent to a BMC.
pub const FLASHES_SENT_TOTAL: &str = "leasebroker_flashes_sent_total";

/// Registers the help texts of the operation metrics.
pub fn describe_metrics() {
    metrics::describe_counter!(OPERATIONS_TOTAL, "Long-running operations that ended, by kind and outcome");
    metrics::describe_counter!(OPERATION_WATCHES_TOTAL, "Operations this replica's watcher started following");
    metrics::describe_counter!(FLASHES_SENT_TOTAL, "Firmware flashes sent to a BMC (every attempt)");
}

/// The firmware service: starts flashes.
#[derive(Debug, Clone)]
pub struct Firmware {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor, whose API serves the BMCs too.
    pub hypervisor: HypervisorClient,
    /// How long a sent call may still take effect (`--hypervisor-settle`).
    pub settle: Duration,
}

/// The sub-keys of one flash request: the operation's id and the BMC call's tag.
fn keys(op: &Operation) -> (String, String) {
    (operation_id(|label| op.derive(label)), op.derive("flash").as_str().to_owned())
}

fn operation_id(derive: impl Fn(&str) -> idempotency::SubKey) -> String {
    public_id("op", &derive("flash-op"))
}

/// Where the operation a flash request's record starts can be followed: what the idempotency
/// layer puts in the `Link` of a retry's `409 request-in-progress` (the first attempt is still
/// accepting). `None` for records of other routes.
pub fn operation_link(record: &idempotency::Record) -> Option<String> {
    let endpoint = record.scope.endpoint.as_str();
    (endpoint.starts_with("POST /admin/v1/nodes/") && endpoint.ends_with("/firmware"))
        .then(|| operation_location(&operation_id(|label| record.derive(label))))
}

/// Where the operation `op_id` is read: its `Location`.
pub fn operation_location(op_id: &str) -> String {
    format!("/admin/v1/operations/{op_id}")
}

impl Firmware {
    /// Whether a flash under `op` must be refused because a worker holds the node: it has not
    /// started yet (a retry of a flash that started is answered with its operation whatever
    /// holds the node now), the body does not say `"force": true`, and the node is allocated.
    pub async fn refuses_in_use(
        &self,
        node_id: &str,
        req: &FlashFirmware,
        op: &Operation,
    ) -> Result<bool, ServiceError> {
        if req.force || !is_path_id(node_id) {
            return Ok(false);
        }
        let (op_id, _) = keys(op);
        if self.domain.flash_operation(&op_id).await?.is_some() {
            return Ok(false);
        }
        Ok(self.domain.node_allocated(node_id).await?)
    }

    /// The side-effect runner on the service's database.
    fn effects(&self) -> Effects {
        Effects::new(self.domain.ledger()).settle(self.settle)
    }

    /// Starts flashing `node_id` to `req.version` under the request `op`, or resumes what an
    /// earlier attempt of it did. Returns the operation once the BMC accepted the flash (or
    /// refused it: then the operation has failed).
    pub async fn flash(&self, node_id: &str, req: &FlashFirmware, op: &Operation) -> Result<FlashRow, ServiceError> {
        req.validate()?;
        if !is_path_id(node_id) {
            return Err(ServiceError::NoSuchNode(node_id.to_owned()));
        }
        let (op_id, tag) = keys(op);
        let attempt = self.effects().attempt(&op.effects_op(crate::service::OpKind::Flash));
        let ledger_op = attempt.operation().id().to_owned();
        let row = match self.domain.start_flash(&op_id, &ledger_op, node_id, &req.version, &tag, now_micros()).await? {
            FlashStart::Operation(row) => row,
            FlashStart::Conflict(running) => {
                tracing::info!(node_id, running = %running.op_id, "a flash with another key runs on the node; refused");
                return Err(ServiceError::OperationConflict(running.op_id));
            }
            FlashStart::NoNode => return Err(ServiceError::NoSuchNode(node_id.to_owned())),
        };
        if row.is_finished() || row.is_accepted() {
            return Ok(row);
        }
        let effect = FlashCall {
            hypervisor: self.hypervisor.clone(),
            domain: self.domain.clone(),
            node_id: Some(row.node_id.clone()),
        };
        let decided = match self.hypervisor.redfish() {
            Some(bmc) => match self.before_redfish_send(bmc, req, &row, &attempt).await? {
                Some(decided) => decided,
                None => return self.operation(&op_id).await,
            },
            None => attempt.decide(&effect).await.map_err(|e| effect_failed(e, "BMC"))?,
        };
        let hypervisor = &self.hypervisor;
        let version = req.version.as_str();
        let target_node = row.node_id.as_str();
        let sent = attempt
            .run_decided(&effect, decided, |tag| async move {
                metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
                match hypervisor.redfish() {
                    Some(bmc) => {
                        let target = bmc.target(target_node).await.map_err(call_error)?;
                        bmc.flash(&target, version, &tag).await.map_err(call_error)?;
                    }
                    None => {
                        let call = FlashRequest { version: version.to_owned(), tag };
                        hypervisor.flash(target_node, &call).await.map_err(call_error)?;
                    }
                }
                Ok(Sent::Accepted(target_node.to_owned()))
            })
            .await;
        match sent {
            Ok(_) => {
                self.domain.accept_flash(&op_id).await?;
                finish(&attempt).await?;
            }
            Err(EffectError::Refused(e)) => match e.status() {
                // The BMC refused: the operation fails, and the `202` says so.
                Some(status) => {
                    tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC refused the flash");
                    let error = format!("the BMC refused the flash (status {status})");
                    if self.domain.fail_unaccepted_flash(&op_id, &error, now_micros()).await? {
                        count_end(false);
                    }
                    finish(&attempt).await?;
                }
                // Never sent: the intent is released, a retry sends it without waiting.
                None => {
                    tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC is unreachable; the flash was not sent");
                    return Err(ServiceError::upstream("the BMC is unreachable"));
                }
            },
            // The flash pass settled the operation meanwhile: it answers as it is now.
            Err(EffectError::Finished | EffectError::RolledBack) => {}
            Err(e) => return Err(effect_failed(e, "BMC")),
        }
        self.operation(&op_id).await
    }

    /// The operation `op_id` as it is now.
    async fn operation(&self, op_id: &str) -> Result<FlashRow, ServiceError> {
        self.domain.flash_operation(op_id).await?.ok_or_else(|| ServiceError::NoSuchOperation(op_id.to_owned()))
    }

    /// On a Redfish BMC, what comes before the send (module docs): a flash sent by an earlier
    /// attempt is never sent again, but found by its task or settled by the firmware inventory;
    /// a node that already runs the version is not flashed. Returns the decided intent when the
    /// flash is to be sent now, `None` when the operation was settled without sending.
    async fn before_redfish_send(
        &self,
        bmc: &RedfishBmc,
        req: &FlashFirmware,
        row: &FlashRow,
        attempt: &idempotency_effects::Attempt,
    ) -> Result<Option<Decided>, ServiceError> {
        let op_id = row.op_id.as_str();
        let ledger = self.domain.ledger();
        if let Some(intent) = ledger.intent(&row.tag).await.map_err(DomainError::from)? {
            match intent.state {
                IntentState::Pending => {
                    self.settle_redfish_pending(bmc, row, &intent).await?;
                    return Ok(None);
                }
                IntentState::Accepted | IntentState::Done => {
                    self.domain.accept_flash(op_id).await?;
                    return Ok(None);
                }
                IntentState::Failed => {} // definitely not sent: sent again below
            }
        }
        let target = bmc.target(&row.node_id).await.map_err(|e| bmc_unavailable(&e, "list the BMC's systems"))?;
        let ended = match &target {
            Target::NotListed { systems } => {
                let error = format!("the BMC lists {systems} systems and none is {}", row.node_id);
                Some((false, Some(error)))
            }
            _ => {
                let runs = bmc
                    .runs_version(&target, &row.node_id, &req.version)
                    .await
                    .map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
                if runs {
                    tracing::info!(op_id, "the node already runs this version; nothing to flash");
                }
                runs.then_some((true, None))
            }
        };
        if let Some((succeeded, error)) = ended {
            if self.domain.end_unaccepted_flash(op_id, succeeded, error.as_deref(), now_micros()).await? {
                count_end(succeeded);
            }
            return Ok(None);
        }
        let effect = FlashCall { hypervisor: self.hypervisor.clone(), domain: self.domain.clone(), node_id: None };
        match attempt.decide(&effect).await {
            // Another attempt sent it between the read above and this step: never twice.
            Ok(Decided::Existing(i)) if i.state == IntentState::Pending => {
                Err(effect_failed(EffectError::Contended, "BMC"))
            }
            Ok(decided) => Ok(Some(decided)),
            Err(EffectError::Finished | EffectError::RolledBack) => Ok(None),
            Err(e) => Err(effect_failed(e, "BMC")),
        }
    }

    /// A Redfish flash an earlier attempt sent without learning what came of it: adopted when a
    /// task carries its tag; otherwise, once the settle window passed and the BMC runs no task,
    /// ended by the firmware inventory.
    async fn settle_redfish_pending(
        &self,
        bmc: &RedfishBmc,
        row: &FlashRow,
        intent: &Intent,
    ) -> Result<(), ServiceError> {
        let lookup =
            bmc.find_task(&row.tag).await.map_err(|e| bmc_unavailable(&e, "find the task of an earlier attempt"))?;
        let TaskLookup::NotFound { busy } = lookup else {
            tracing::info!(op_id = %row.op_id, "adopted the flash an earlier attempt sent: its task carries the tag");
            adopt(&self.domain, row, intent).await?;
            return Ok(());
        };
        self.effects().settling(intent).map_err(|e| effect_failed(e, "BMC"))?;
        if busy {
            return Err(ServiceError::upstream(
                "the BMC still runs a task, which may be this flash; retry with the same key",
            ));
        }
        let runs = inventory_runs(bmc, row).await.map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
        conclude_by_inventory(&self.domain, row, intent, runs).await?;
        Ok(())
    }
}

/// Marks the flash's ledger operation finished (its accepted intent stays, for the watcher).
async fn finish(attempt: &idempotency_effects::Attempt) -> Result<(), DomainError> {
    match attempt.finish().await {
        Ok(()) | Err(EffectError::Finished | EffectError::RolledBack) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Records that the BMC took the flash an earlier attempt sent (found by its tag): its intent
/// accepted in the ledger (the watcher follows it from there), the operation accepted.
async fn adopt(domain: &Domain, row: &FlashRow, intent: &Intent) -> Result<(), DomainError> {
    let ledger = domain.ledger();
    match ledger.record(&intent.op_id, &intent.intent_id, &row.node_id, IntentState::Accepted).await {
        Ok(_) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {}
        Err(e) => return Err(e.into()),
    }
    domain.accept_flash(&row.op_id).await?;
    match ledger.finish(&intent.op_id, now_micros()).await {
        Ok(()) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// A firmware flash as the effect ledger runs it: long-running (accepted with `202`, finished
/// minutes later), found by the tag the BMC keeps (simulator: the BMCs holding it; Redfish: a
/// task whose payload carries it), never undone. Polling it reads the BMC and ends the
/// operation's row when the flash ended.
#[derive(Debug, Clone)]
struct FlashCall {
    hypervisor: HypervisorClient,
    domain: Domain,
    /// The node flashed, for a probe (the watcher's instance has none: it polls by tag).
    node_id: Option<String>,
}

#[async_trait]
impl Effect for FlashCall {
    fn name(&self) -> &str {
        "flash"
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        let found = match self.hypervisor.redfish() {
            Some(bmc) => !matches!(bmc.find_task(tag).await.map_err(call_error)?, TaskLookup::NotFound { .. }),
            None => self.hypervisor.bmcs_by_tag(tag).await.map_err(call_error)? > 0,
        };
        Ok(found.then(|| self.node_id.clone().unwrap_or_default()).into_iter().collect())
    }

    fn keeps(&self) -> bool {
        false
    }

    fn long_running(&self) -> bool {
        true
    }

    async fn poll(&self, tag: &str, _id: &str) -> Result<Progress, CallError> {
        let unavailable = |e: DomainError| CallError::ambiguous(e);
        let Some(row) = self.domain.flash_by_tag(tag).await.map_err(unavailable)? else {
            return Ok(Progress::Failed("no operation carries this flash's tag".into()));
        };
        if row.is_finished() {
            return Ok(if row.state == "succeeded" {
                Progress::Done
            } else {
                Progress::Failed(row.error.unwrap_or_default())
            });
        }
        if !row.is_accepted() {
            self.domain.accept_flash(&row.op_id).await.map_err(unavailable)?;
        }
        let ended = match self.hypervisor.redfish() {
            Some(bmc) => self.poll_redfish(bmc, &row).await?,
            None => self.poll_bmc(&row).await?,
        };
        Ok(match ended {
            None => Progress::Running,
            Some(Ok(())) => Progress::Done,
            Some(Err(reason)) => Progress::Failed(reason),
        })
    }
}

impl FlashCall {
    /// Ends the accepted operation `row`; counts and logs it when this call ended it.
    async fn end(&self, row: &FlashRow, result: Result<(), String>) -> Result<Option<Result<(), String>>, CallError> {
        let error = result.as_ref().err().map(String::as_str);
        let ended = self
            .domain
            .finish_flash(&row.op_id, result.is_ok(), error, now_micros())
            .await
            .map_err(CallError::ambiguous)?;
        if ended {
            count_end(result.is_ok());
            let outcome = if result.is_ok() { "succeeded" } else { "failed" };
            tracing::info!(op_id = %row.op_id, node_id = %row.node_id, outcome, error, "operation ended");
        }
        Ok(Some(result))
    }

    /// The simulator's BMC: its state says how the flash went.
    async fn poll_bmc(&self, row: &FlashRow) -> Result<Option<Result<(), String>>, CallError> {
        let Some(bmc) = self.hypervisor.bmc(&row.node_id).await.map_err(call_error)? else {
            return self.end(row, Err("the BMC no longer knows the node".into())).await;
        };
        match outcome(row, &bmc) {
            None => Ok(None),
            Some(Ok(())) => self.end(row, Ok(())).await,
            Some(Err(error)) => {
                if bmc.state == BmcState::Bricked {
                    self.domain.note_bricked(&row.node_id, now_micros()).await.map_err(CallError::ambiguous)?;
                }
                self.end(row, Err(error)).await
            }
        }
    }

    /// A Redfish BMC: the flash's task, found by its answer or by the tag; without one, the
    /// firmware inventory once nothing can still change it.
    async fn poll_redfish(&self, bmc: &RedfishBmc, row: &FlashRow) -> Result<Option<Result<(), String>>, CallError> {
        let task = match bmc.find_task(&row.tag).await.map_err(call_error)? {
            TaskLookup::Found(task) => task,
            TaskLookup::NotFound { busy: true } => return Ok(None),
            TaskLookup::NotFound { busy: false } => {
                let runs = inventory_runs(bmc, row).await.map_err(call_error)?;
                let absent = "the BMC keeps no task for this flash and the node does not run the version";
                return self.end(row, if runs { Ok(()) } else { Err(absent.into()) }).await;
            }
        };
        match bmc.task_outcome(&task).await.map_err(call_error)? {
            TaskOutcome::Running => Ok(None),
            TaskOutcome::Succeeded => {
                bmc.forget(&row.tag);
                self.end(row, Ok(())).await
            }
            TaskOutcome::Failed(reason) => {
                // Some BMCs fail the task of an image the machine already runs: that is done.
                let target = bmc.target(&row.node_id).await.map_err(call_error)?;
                let runs = bmc.runs_version(&target, &row.node_id, &row.version).await.map_err(call_error)?;
                bmc.forget(&row.tag);
                if runs {
                    tracing::info!(op_id = %row.op_id, reason, "the task failed, but the node runs the version");
                }
                self.end(row, if runs { Ok(()) } else { Err(reason) }).await
            }
            TaskOutcome::Gone => {
                // Its monitor is gone: look for the task by tag again next time, or read the
                // inventory.
                bmc.forget(&row.tag);
                Ok(None)
            }
        }
    }
}

/// The watcher's settings and handles.
#[derive(Debug, Clone)]
pub struct Watcher {
    /// The tables.
    pub domain: Domain,
    /// The hypervisor, whose API serves the BMCs too.
    pub hypervisor: HypervisorClient,
    /// This replica's name on the leases it holds (unique per process).
    pub name: String,
    /// How often each operation's BMC is polled (`--operation-poll`).
    pub poll: Duration,
    /// `--hypervisor-settle`.
    pub settle: Duration,
    /// `--abandon-after`: an operation never accepted by the BMC, and not sent or retried for
    /// this long, fails.
    pub abandon_after: Duration,
    /// Where the pass over unaccepted operations goes on from (the last op id it looked at).
    pub cursor: Arc<Mutex<String>>,
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
        hypervisor: HypervisorClient,
        name: String,
        poll: Duration,
        settle: Duration,
        abandon_after: Duration,
    ) -> Self {
        Self { domain, hypervisor, name, poll, settle, abandon_after, cursor: Arc::default() }
    }

    /// How long a lease holds: several polls, so a live watcher always renews it in time.
    fn lease(&self) -> Duration {
        (self.poll * 5).max(Duration::from_secs(10))
    }

    /// One pass: the accepted flashes this watcher holds or can take (the ledger's watcher),
    /// then a page of the operations whose flash the BMC has not been seen to take.
    pub async fn run_once(&self) -> WatchReport {
        let mut report = WatchReport::default();
        let effect = FlashCall { hypervisor: self.hypervisor.clone(), domain: self.domain.clone(), node_id: None };
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
            rows.last().map(|r| r.op_id.clone()).unwrap_or_default()
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
    /// its attempt still runs. Adopts the flash when the BMC holds its tag; on Redfish, ends a
    /// flash whose task nobody can find by the firmware inventory once no call can still land;
    /// fails one that nobody sent (or retried) for `--abandon-after` and whose call cannot land,
    /// after taking its ledger operation for a rollback, so no late attempt can send it.
    async fn settle_unaccepted(&self, row: &FlashRow) -> anyhow::Result<bool> {
        let ledger = self.domain.ledger();
        let intent = ledger.intent(&row.tag).await?;
        let now = now_micros();
        if let Some(intent) = &intent {
            match intent.state {
                IntentState::Accepted | IntentState::Done => {
                    self.domain.accept_flash(&row.op_id).await?; // its acceptance was cut short
                    return Ok(false);
                }
                IntentState::Pending => {
                    let effect = FlashCall {
                        hypervisor: self.hypervisor.clone(),
                        domain: self.domain.clone(),
                        node_id: Some(row.node_id.clone()),
                    };
                    if !effect.probe(&row.tag).await?.is_empty() {
                        adopt(&self.domain, row, intent).await?;
                        tracing::info!(op_id = %row.op_id, "adopted a flash whose request was abandoned after sending it");
                        return Ok(false);
                    }
                    if now.saturating_sub(intent.sent_at) < micros(self.settle) {
                        return Ok(false); // its call may still land
                    }
                    if let Some(bmc) = self.hypervisor.redfish() {
                        // A Redfish flash is never sent twice: the inventory decides.
                        let TaskLookup::NotFound { busy: false } = bmc.find_task(&row.tag).await? else {
                            return Ok(false);
                        };
                        let runs = inventory_runs(bmc, row).await?;
                        return Ok(conclude_by_inventory(&self.domain, row, intent, runs).await?);
                    }
                }
                IntentState::Failed => {}
            }
        }
        let Some(ledger_op) = row.ledger_op.as_deref() else { return Ok(false) };
        let op = ledger.operation(ledger_op).await?;
        let last = op.as_ref().map_or(row.created_at, |o| o.last_attempt_at.max(row.created_at));
        if now.saturating_sub(last) < micros(self.abandon_after) {
            return Ok(false);
        }
        // Fence the operation before failing it: a late attempt then sends nothing.
        let taken = match &op {
            Some(op) if op.mark == Mark::Live => ledger.take_for_rollback(ledger_op, op.last_attempt_at).await?,
            Some(op) => op.mark == Mark::RollingBack,
            None => ledger.take_unbegun(&unbegun(ledger_op, now)).await?,
        };
        if !taken {
            return Ok(false); // an attempt ran a step since: look again later
        }
        let error = "the flash never reached the BMC, and its request was not retried within --abandon-after";
        let ended = self.domain.fail_unaccepted_flash(&row.op_id, error, now).await?;
        ledger.rolled_back(ledger_op, now_micros()).await?;
        if ended {
            count_end(false);
            tracing::info!(op_id = %row.op_id, "failed an operation whose flash was never sent");
        }
        Ok(ended)
    }
}

/// The ledger row that fences off a flash whose request never reached the ledger's first step.
fn unbegun(op_id: &str, now: i64) -> OperationRow {
    OperationRow {
        op_id: op_id.to_owned(),
        kind: "flash".into(),
        principal: String::new(),
        endpoint: String::new(),
        idem_key: String::new(),
        record_id: String::new(),
        mark: Mark::RollingBack,
        last_attempt_at: now,
        next_check_at: i64::MAX,
    }
}

/// The firmware inventory's word on a flash whose task is unknown: whether the node runs the
/// version. Asked only once the BMC runs no task: until then the flash may still be writing, and
/// failing it would free the node for a second, bricking one.
async fn inventory_runs(bmc: &RedfishBmc, row: &FlashRow) -> Result<bool, HvError> {
    let target = bmc.target(&row.node_id).await?;
    bmc.runs_version(&target, &row.node_id, &row.version).await
}

/// Ends an operation whose flash was sent (its intent `intent` pending) by what the firmware
/// inventory says (`runs`: the node runs the version), and finishes its ledger operation: a
/// Redfish flash is never sent twice, so this is its end. True when this call ended it.
async fn conclude_by_inventory(
    domain: &Domain,
    row: &FlashRow,
    intent: &Intent,
    runs: bool,
) -> Result<bool, DomainError> {
    const ABSENT: &str = "the BMC keeps no task for this flash and the node does not run the version";
    let ended = if runs {
        adopt(domain, row, intent).await?;
        domain.finish_flash(&row.op_id, true, None, now_micros()).await?
    } else {
        let ended = domain.fail_unaccepted_flash(&row.op_id, ABSENT, now_micros()).await?;
        match domain.ledger().finish(&intent.op_id, now_micros()).await {
            Ok(()) | Err(idempotency_effects::LedgerError::Finished | idempotency_effects::LedgerError::RolledBack) => {
            }
            Err(e) => return Err(e.into()),
        }
        ended
    };
    if ended {
        count_end(runs);
        tracing::info!(op_id = %row.op_id, succeeded = runs, "operation ended by the BMC's firmware inventory");
    }
    Ok(ended)
}

fn count_end(succeeded: bool) {
    let outcome = if succeeded { "succeeded" } else { "failed" };
    metrics::counter!(OPERATIONS_TOTAL, "kind" => "firmware-flash", "outcome" => outcome).increment(1);
}

/// The answer when the BMC cannot be asked what the flash needs (a read: nothing was sent).
fn bmc_unavailable(e: &HvError, what: &str) -> ServiceError {
    tracing::warn!(error = %ErrorChain(e), "cannot {what}");
    ServiceError::upstream("the BMC does not answer; retry with the same key")
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

/// Runs the watcher every `--operation-poll`, forever.
pub fn spawn(watcher: Watcher) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(watcher.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let report = watcher.run_once().await;
            if report.ended > 0 {
                tracing::debug!(watched = report.watched, ended = report.ended, "watcher pass");
            }
        }
    })
}
