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
//! - **The BMC call is an intent,** like a boot: its tag is the derived sub-key `flash`; it is sent
//!   only by the attempt that moved the send stamp by compare-and-set; a retry that finds it pending
//!   asks the BMC for nodes holding the tag before anything else, and sends again only when none
//!   does and the settle window (`--hypervisor-settle`) has passed since the last send.
//! - **The watcher** runs on every replica. It holds a lease on each operation it follows, taken by
//!   compare-and-set on the row, so several replicas never watch one operation at once, and a
//!   replica that dies leaves a lease that expires and is taken over; a restarted replica resumes
//!   from the rows. It also settles operations whose request was abandoned before acceptance: it
//!   adopts a flash the BMC holds by tag, and fails one nobody sent or retried within
//!   `--abandon-after`.
//! - **On a Redfish BMC** (`--bmc-url redfish+...`, [`crate::hypervisor::redfish`]) the tag rides in
//!   the image URI, and a flash whose send was stamped is never sent again: a retry (or the
//!   watcher) finds its task by the tag in the tasks' payloads; where the BMC keeps none, it
//!   waits out the settle window and for the BMC to run no task, then reads the node's firmware
//!   inventory (the version there: succeeded; absent: failed). The watcher follows the task
//!   (`TaskState`, `TaskStatus`). A node that already runs the version is not flashed: its
//!   operation succeeds at once, and a task that failed on a node that runs the version counts
//!   as done.

use idempotency::ErrorChain;
use std::time::Duration;

use leasebroker_validation::{FlashFirmware, is_path_id};
use tokio::task::JoinHandle;

use crate::domain::{Domain, DomainError, FlashRow, FlashStart};
use crate::hypervisor::client::{BmcNode, BmcState, FlashRequest, HvError, HypervisorClient};
use crate::hypervisor::redfish::{RedfishBmc, Target, TaskLookup, TaskOutcome};
use crate::service::{Operation, ServiceError, may_send, micros, now_micros, public_id, settled_since};

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

    /// Starts flashing `node_id` to `req.version` under the request `op`, or resumes what an
    /// earlier attempt of it did. Returns the operation once the BMC accepted the flash (or
    /// refused it: then the operation has failed).
    pub async fn flash(&self, node_id: &str, req: &FlashFirmware, op: &Operation) -> Result<FlashRow, ServiceError> {
        req.validate()?;
        if !is_path_id(node_id) {
            return Err(ServiceError::NoSuchNode(node_id.to_owned()));
        }
        let (op_id, tag) = keys(op);
        let row = match self.domain.start_flash(&op_id, node_id, &req.version, &tag, now_micros()).await? {
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
        if let Some(bmc) = self.hypervisor.redfish() {
            return self.flash_redfish(bmc, req, row).await;
        }
        if row.intent == "pending" {
            // An earlier attempt sent the flash and does not know what came of it: the BMC says.
            let holding = self.hypervisor.bmcs_by_tag(&tag).await.map_err(|e| {
                tracing::warn!(error = %ErrorChain(&e), "cannot list BMCs by tag to reconcile a flash");
                ServiceError::upstream("cannot ask the BMC what an earlier attempt did; retry with the same key")
            })?;
            if holding > 0 {
                tracing::info!(op_id, "adopted the flash an earlier attempt sent");
                return Ok(self.domain.accept_flash(&op_id).await?);
            }
            settled_since(&tag, row.sent_at, self.settle)?;
        }
        let stamp = may_send(&tag, self.domain.stamp_flash(&op_id, row.sent_at).await?)?;
        metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
        let call = FlashRequest { version: req.version.clone(), tag: tag.clone() };
        match self.hypervisor.flash(node_id, &call).await {
            Ok(_) => Ok(self.domain.accept_flash(&op_id).await?),
            Err(e) if e.may_have_happened() => {
                tracing::warn!(error = %ErrorChain(&e), op_id, "the flash may or may not have started");
                Err(ServiceError::upstream("the BMC call may or may not have taken effect; retry with the same key"))
            }
            Err(e) => self.not_sent(&op_id, stamp, e).await,
        }
    }

    /// The operation `op_id` as it is now.
    async fn operation(&self, op_id: &str) -> Result<FlashRow, ServiceError> {
        self.domain.flash_operation(op_id).await?.ok_or_else(|| ServiceError::NoSuchOperation(op_id.to_owned()))
    }

    /// [`Firmware::flash`] on a Redfish BMC, for an operation not accepted yet (module docs).
    async fn flash_redfish(
        &self,
        bmc: &RedfishBmc,
        req: &FlashFirmware,
        row: FlashRow,
    ) -> Result<FlashRow, ServiceError> {
        let op_id = row.op_id.as_str();
        if row.intent == "pending" {
            // An earlier attempt sent the flash and does not know what came of it.
            let lookup = bmc
                .find_task(&row.tag)
                .await
                .map_err(|e| bmc_unavailable(&e, "find the task of an earlier attempt"))?;
            let TaskLookup::NotFound { busy } = lookup else {
                tracing::info!(op_id, "adopted the flash an earlier attempt sent: its task carries the tag");
                return Ok(self.domain.accept_flash(op_id).await?);
            };
            settled_since(&row.tag, row.sent_at, self.settle)?;
            if busy {
                return Err(ServiceError::upstream(
                    "the BMC still runs a task, which may be this flash; retry with the same key",
                ));
            }
            let runs =
                inventory_runs(bmc, &row).await.map_err(|e| bmc_unavailable(&e, "read the firmware inventory"))?;
            conclude_by_inventory(&self.domain, &row, runs).await?;
            return self.operation(op_id).await;
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
            let now = now_micros();
            if self.domain.end_unaccepted_flash(op_id, row.sent_at, succeeded, error.as_deref(), now).await? {
                count_end(succeeded);
            }
            return self.operation(op_id).await;
        }
        let stamp = may_send(&row.tag, self.domain.stamp_flash(op_id, row.sent_at).await?)?;
        metrics::counter!(FLASHES_SENT_TOTAL).increment(1);
        match bmc.flash(&target, &req.version, &row.tag).await {
            Ok(()) => Ok(self.domain.accept_flash(op_id).await?),
            Err(e) if e.may_have_happened() => {
                tracing::warn!(error = %ErrorChain(&e), op_id, "the flash may or may not have started");
                Err(ServiceError::upstream("the BMC call may or may not have taken effect; retry with the same key"))
            }
            Err(e) => self.not_sent(op_id, stamp, e).await,
        }
    }

    /// A flash that definitely did not start: refused by the BMC (the operation fails, and the
    /// `202` says so), or never sent (a retry sends it without waiting).
    async fn not_sent(&self, op_id: &str, stamp: i64, e: HvError) -> Result<FlashRow, ServiceError> {
        match e.status() {
            Some(status) => {
                tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC refused the flash");
                let error = format!("the BMC refused the flash (status {})", status.as_u16());
                if self.domain.fail_unaccepted_flash(op_id, stamp, &error, now_micros()).await? {
                    metrics::counter!(OPERATIONS_TOTAL, "kind" => "firmware-flash", "outcome" => "failed").increment(1);
                }
                self.operation(op_id).await
            }
            None => {
                tracing::warn!(error = %ErrorChain(&e), op_id, "the BMC is unreachable; the flash was not sent");
                self.domain.unsend_flash(op_id, stamp).await?;
                Err(ServiceError::upstream("the BMC is unreachable"))
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
}

/// Operations one pass reads at most.
const PAGE: u32 = 500;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchReport {
    /// Operations this pass followed (leases held).
    pub watched: u64,
    /// Operations that ended.
    pub ended: u64,
}

/// Whether a pass takes or renews the lease on `row` before looking at it: always when another
/// watcher holds it (or nobody), and for this watcher's own lease only once half of `lease` is
/// gone. A lease renewed on every poll is a write (and on SQLite an fsync) per operation per
/// poll, which queues the database's one writer behind the watcher.
fn renews(row: &FlashRow, name: &str, now: i64, lease: Duration) -> bool {
    row.watcher.as_deref() != Some(name) || row.watch_until.saturating_sub(now) <= micros(lease) / 2
}

impl Watcher {
    /// How long a lease holds: several polls, so a live watcher always renews it in time.
    fn lease(&self) -> Duration {
        (self.poll * 5).max(Duration::from_secs(10))
    }

    /// One pass over the running operations this watcher holds or can take.
    pub async fn run_once(&self) -> WatchReport {
        let mut report = WatchReport::default();
        let now = now_micros();
        let rows = match self.domain.flashes_to_watch(&self.name, now, PAGE).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "cannot read the running operations; trying again next tick");
                return report;
            }
        };
        for row in rows {
            let now = now_micros();
            if renews(&row, &self.name, now, self.lease()) {
                let until = now.saturating_add(micros(self.lease()));
                match self.domain.take_watch(&row.op_id, &self.name, row.watch_until, until).await {
                    Ok(true) => {}
                    Ok(false) => continue, // another replica took it, or it ended
                    Err(e) => {
                        tracing::warn!(error = %ErrorChain(&e), op_id = %row.op_id, "cannot take the watch lease");
                        continue;
                    }
                }
            }
            if row.watcher.as_deref() != Some(self.name.as_str()) {
                metrics::counter!(OPERATION_WATCHES_TOTAL).increment(1);
                tracing::info!(op_id = %row.op_id, node_id = %row.node_id, previous = ?row.watcher, "watching the operation");
            }
            report.watched += 1;
            match self.step(&row).await {
                Ok(true) => report.ended += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), op_id = %row.op_id, "watching the operation failed; next tick")
                }
            }
        }
        report
    }

    /// Looks at one running operation; true when it ended.
    async fn step(&self, row: &FlashRow) -> anyhow::Result<bool> {
        if let Some(bmc) = self.hypervisor.redfish() {
            return self.step_redfish(bmc, row).await;
        }
        if !row.is_accepted() {
            return self.settle_unaccepted(row).await;
        }
        let Some(bmc) = self.hypervisor.bmc(&row.node_id).await? else {
            return self.end(row, false, Some("the BMC no longer knows the node")).await;
        };
        match outcome(row, &bmc) {
            None => Ok(false),
            Some(Ok(())) => self.end(row, true, None).await,
            Some(Err(error)) => {
                if bmc.state == BmcState::Bricked {
                    self.domain.note_bricked(&row.node_id, now_micros()).await?;
                }
                self.end(row, false, Some(&error)).await
            }
        }
    }

    /// An operation whose flash the BMC has not been seen to take: its request was abandoned, or
    /// its attempt still runs. Adopts the flash when the BMC holds its tag; fails it when nobody
    /// sent it for `--abandon-after` and no call can still land.
    async fn settle_unaccepted(&self, row: &FlashRow) -> anyhow::Result<bool> {
        if row.intent == "pending" && self.hypervisor.bmcs_by_tag(&row.tag).await? > 0 {
            self.domain.accept_flash(&row.op_id).await?;
            tracing::info!(op_id = %row.op_id, "adopted a flash whose request was abandoned after sending it");
            return Ok(false);
        }
        let now = now_micros();
        let last = row.sent_at.max(row.created_at);
        let quiet = now.saturating_sub(last);
        let can_land = row.intent == "pending" && now.saturating_sub(row.sent_at) < micros(self.settle);
        if can_land || quiet < micros(self.abandon_after) {
            return Ok(false);
        }
        let error = "the flash never reached the BMC, and its request was not retried within --abandon-after";
        if self.domain.fail_unaccepted_flash(&row.op_id, row.sent_at, error, now).await? {
            metrics::counter!(OPERATIONS_TOTAL, "kind" => "firmware-flash", "outcome" => "failed").increment(1);
            tracing::info!(op_id = %row.op_id, "failed an operation whose flash was never sent");
            return Ok(true);
        }
        Ok(false)
    }

    async fn end(&self, row: &FlashRow, succeeded: bool, error: Option<&str>) -> anyhow::Result<bool> {
        if !self.domain.finish_flash(&row.op_id, succeeded, error, now_micros()).await? {
            return Ok(false);
        }
        count_end(succeeded);
        let outcome = if succeeded { "succeeded" } else { "failed" };
        tracing::info!(op_id = %row.op_id, node_id = %row.node_id, outcome, error, "operation ended");
        Ok(true)
    }

    /// [`Watcher::step`] on a Redfish BMC: follows the flash's task, found by its answer or by
    /// the tag; without one, reads the firmware inventory once nothing can still change it.
    async fn step_redfish(&self, bmc: &RedfishBmc, row: &FlashRow) -> anyhow::Result<bool> {
        if !row.is_accepted() {
            if row.intent != "pending" {
                return self.settle_unaccepted(row).await; // never sent: nothing to ask the BMC
            }
            let TaskLookup::NotFound { busy } = bmc.find_task(&row.tag).await? else {
                self.domain.accept_flash(&row.op_id).await?;
                tracing::info!(op_id = %row.op_id, "adopted a flash whose request was abandoned after sending it");
                return Ok(false);
            };
            if now_micros().saturating_sub(row.sent_at) < micros(self.settle) {
                return Ok(false);
            }
            return self.end_by_inventory(bmc, row, busy).await;
        }
        let task = match bmc.find_task(&row.tag).await? {
            TaskLookup::Found(task) => task,
            TaskLookup::NotFound { busy } => return self.end_by_inventory(bmc, row, busy).await,
        };
        match bmc.task_outcome(&task).await? {
            TaskOutcome::Running => Ok(false),
            TaskOutcome::Succeeded => {
                bmc.forget(&row.tag);
                self.end(row, true, None).await
            }
            TaskOutcome::Failed(reason) => {
                // Some BMCs fail the task of an image the machine already runs: that is done.
                let target = bmc.target(&row.node_id).await?;
                let runs = bmc.runs_version(&target, &row.node_id, &row.version).await?;
                bmc.forget(&row.tag);
                if runs {
                    tracing::info!(op_id = %row.op_id, reason, "the task failed, but the node runs the version");
                }
                self.end(row, runs, (!runs).then_some(reason.as_str())).await
            }
            TaskOutcome::Gone => {
                // Its monitor is gone: look for the task by tag again next time, or read the
                // inventory.
                bmc.forget(&row.tag);
                Ok(false)
            }
        }
    }

    /// An operation whose task nobody can find: ends it by the firmware inventory once no task
    /// runs on the BMC (`busy`: one does). True when it ended.
    async fn end_by_inventory(&self, bmc: &RedfishBmc, row: &FlashRow, busy: bool) -> anyhow::Result<bool> {
        if busy {
            return Ok(false);
        }
        let runs = inventory_runs(bmc, row).await?;
        Ok(conclude_by_inventory(&self.domain, row, runs).await?)
    }
}

/// The firmware inventory's word on a flash whose task is unknown: whether the node runs the
/// version. Asked only once the BMC runs no task: until then the flash may still be writing, and
/// failing it would free the node for a second, bricking one.
async fn inventory_runs(bmc: &RedfishBmc, row: &FlashRow) -> Result<bool, HvError> {
    let target = bmc.target(&row.node_id).await?;
    bmc.runs_version(&target, &row.node_id, &row.version).await
}

/// Ends an operation by what the firmware inventory says (`runs`: the node runs the version).
/// True when this call ended it.
async fn conclude_by_inventory(domain: &Domain, row: &FlashRow, runs: bool) -> Result<bool, DomainError> {
    const ABSENT: &str = "the BMC keeps no task for this flash and the node does not run the version";
    let ended = if runs {
        if !row.is_accepted() {
            domain.accept_flash(&row.op_id).await?;
        }
        domain.finish_flash(&row.op_id, true, None, now_micros()).await?
    } else if row.is_accepted() {
        domain.finish_flash(&row.op_id, false, Some(ABSENT), now_micros()).await?
    } else {
        domain.fail_unaccepted_flash(&row.op_id, row.sent_at, ABSENT, now_micros()).await?
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(watcher: Option<&str>, watch_until: i64) -> FlashRow {
        FlashRow {
            op_id: "op-1".into(),
            node_id: "node-0001".into(),
            version: "1.0".into(),
            state: "running".into(),
            error: None,
            intent: "accepted".into(),
            tag: "sk-1".into(),
            sent_at: 0,
            created_at: 0,
            finished_at: None,
            watcher: watcher.map(str::to_owned),
            watch_until,
        }
    }

    #[test]
    fn a_watcher_renews_its_own_lease_only_once_half_of_it_is_gone() {
        let lease = Duration::from_secs(10);
        let now = 1_000_000_000;
        let s = 1_000_000;
        assert!(renews(&row(None, 0), "w1", now, lease), "nobody holds it: take it");
        assert!(renews(&row(Some("w2"), now - s), "w1", now, lease), "another's expired lease: take it");
        assert!(renews(&row(Some("w2"), now + 9 * s), "w1", now, lease), "another's: try (the take is fenced)");
        assert!(!renews(&row(Some("w1"), now + 9 * s), "w1", now, lease), "its own, 9 s of 10 left");
        assert!(!renews(&row(Some("w1"), now + 5 * s + 1), "w1", now, lease), "just over half left");
        assert!(renews(&row(Some("w1"), now + 5 * s), "w1", now, lease), "half gone");
        assert!(renews(&row(Some("w1"), now - s), "w1", now, lease), "its own, lapsed");
    }
}
