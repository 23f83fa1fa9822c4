//! The clients and the workload: create (most), reboot and delete of workers a client created,
//! and firmware flashes of the pool's nodes (admin), each logical operation with one key
//! (protected) or a fresh key per attempt (naive).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use leasebroker_client::retry::RetryPolicy;
use leasebroker_client::{OPERATION_CONFLICT, Operation, OperationId, RebootResult, Worker, WorkerId};
use rand::Rng;
use serde::Serialize;

use crate::cluster::Principal;
use crate::timeline::{AttemptNote, Timeline};

mod lbctl;
mod rerun;
mod sdk;
mod trace;

pub use rerun::{Rerun, StoredAnswer};
use sdk::decode;
use trace::OpLog;

/// Share of operations that reboot a worker (when one is free), and that delete one.
const REBOOT_SHARE: f64 = 0.2;
const DELETE_SHARE: f64 = 0.1;
/// An lbctl operation is rerun at most this often, and killed at most this often.
const LBCTL_MAX_RUNS: u32 = 16;
const LBCTL_MAX_KILLS: u32 = 6;
/// A planned kill lands this long after the lbctl process starts, for this share of kills: before
/// or while it opens its journal, or (an unfaulted run takes about 30 ms) after its request.
const LBCTL_KILL_WINDOW_MS: std::ops::Range<u64> = 1..60;
const LBCTL_EARLY_KILL_SHARE: f64 = 0.25;
/// The other planned kills land this long after lbctl names the operation's key (`-v`), which it
/// does once the key is durable in its journal and before its first attempt: before, while or
/// just after the request is sent. They land whatever the machine's speed (a kill timed from
/// the process's start alone once missed every run of a CI machine's protected clients).
const LBCTL_KEYED_KILL_WINDOW_MS: std::ops::Range<u64> = 0..25;
/// Failure reasons kept for the report.
const KEPT_FAILURES: usize = 20;
/// An abandoning client hangs up this long after sending, at the latest (sooner when its attempt
/// times out or fails): before, during or after the server's work.
const ABANDON_WINDOW_MS: std::ops::Range<u64> = 5..400;
/// The label every create carries: the index of its logical operation.
pub const OP_LABEL: &str = "faultline-op";

/// Which clients run the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientKind {
    /// One key per logical operation, kept across retries and process restarts.
    Protected,
    /// A fresh key on every attempt: the antipattern.
    Naive,
}

impl ClientKind {
    /// `protected` or `naive`.
    pub fn name(self) -> &'static str {
        match self {
            ClientKind::Protected => "protected",
            ClientKind::Naive => "naive",
        }
    }
}

/// The kinds of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// `POST /v1/workers`.
    Create,
    /// `POST /v1/workers/{id}/reboot`.
    Reboot,
    /// `DELETE /v1/workers/{id}`.
    Delete,
    /// `POST /admin/v1/nodes/{node_id}/firmware` (admin token).
    Flash,
}

/// One logical operation.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Create {
        principal: usize,
        index: u64,
    },
    Reboot {
        principal: usize,
        id: WorkerId,
    },
    Delete {
        principal: usize,
        id: WorkerId,
    },
    /// A flash of `node` to `version`, as the admin.
    Flash {
        node: String,
        version: String,
    },
}

impl Op {
    fn kind(&self) -> OpKind {
        match self {
            Op::Create { .. } => OpKind::Create,
            Op::Reboot { .. } => OpKind::Reboot,
            Op::Delete { .. } => OpKind::Delete,
            Op::Flash { .. } => OpKind::Flash,
        }
    }

    /// `create op 12`, `reboot W`, `delete W`, `flash node-0003`.
    fn what(&self) -> String {
        match self {
            Op::Create { index, .. } => format!("create op {index}"),
            Op::Reboot { id, .. } => format!("reboot {id}"),
            Op::Delete { id, .. } => format!("delete {id}"),
            Op::Flash { node, .. } => format!("flash {node}"),
        }
    }
}

/// How a logical operation ended.
#[derive(Debug)]
enum Outcome {
    Created(Worker),
    Rebooted(RebootResult),
    Deleted,
    /// A flash accepted: the operation as the `202` showed it.
    Flashed(Operation),
    /// A clean refusal (4xx).
    Refused(String),
    /// Gave up, or an answer that is neither success nor a clean refusal.
    Failed(String),
    /// The client walked away for good (after an error or mid-flight) and never retried.
    Abandoned,
}

/// What the clients know about one worker.
#[derive(Debug, Clone)]
pub struct Known {
    /// The principal that created it.
    pub principal: usize,
    /// The create operation's index.
    pub op: u64,
    /// Reboot operations that succeeded on it.
    pub reboots_ok: u64,
    /// A delete operation succeeded on it.
    pub deleted: bool,
    /// A delete operation ended without success: whether it exists is not known.
    pub delete_unknown: bool,
    /// Reboot operations abandoned on it (each may or may not have happened; never twice).
    pub reboots_abandoned: u64,
    /// Its delete was abandoned by the client (so `delete_unknown` too).
    pub delete_abandoned: bool,
}

/// The clients' view of the world.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Workers no operation is working on and that may still be rebooted or deleted.
    idle: Vec<(usize, WorkerId)>,
    /// Every worker a client was told it created.
    pub workers: HashMap<WorkerId, Known>,
    /// Create operations that were told the id of a worker another operation was told about.
    pub same_id_twice: u64,
    /// Reboot answers whose `reboot_count` was not the count of successful reboots of that worker.
    pub reboot_count_mismatches: u64,
    /// The first failure reasons.
    pub failures: Vec<String>,
    /// The first refusal reasons.
    pub refusals: Vec<String>,
    /// Create operations whose client walked away: the server may have finished them (a worker
    /// labelled with the op no client was told about) or rolled them back, never both or twice.
    pub abandoned_creates: HashSet<u64>,
    /// Reboot operations whose client walked away.
    pub abandoned_reboots: u64,
    /// Flash operations a client was told were accepted (`202`), by id.
    pub flash_ops: Vec<OperationId>,
    /// Flash operations whose client walked away (each flashed at most once).
    pub abandoned_flashes: u64,
    /// Flash operations refused because another flash ran on the node (`409 operation-conflict`).
    pub flash_conflicts: u64,
    /// Every key a success (`2xx`) was answered to, with what it was: the service must still hold
    /// its record, completed, at the end (the keys are fresh UUIDs: one record each).
    pub acknowledged: Vec<Acknowledged>,
    /// Every operation that gave up or failed otherwise, with its key and its attempts.
    pub gave_up: Vec<GaveUp>,
}

/// An operation that gave up (or failed otherwise): why, attempt by attempt, and what it takes to
/// send it again with its key.
#[derive(Debug, Clone)]
pub struct GaveUp {
    pub(crate) op: Op,
    /// The logical operation's index.
    pub index: u64,
    /// Run through lbctl processes (else through the SDK).
    pub via_lbctl: bool,
    /// Its `Idempotency-Key`, when the client named it.
    pub key: Option<String>,
    /// Its lbctl `--op-id` (protected lbctl operations).
    pub op_id: Option<String>,
    /// The client's last word.
    pub reason: String,
    /// Each attempt: when it ended, to which replica, what came of it.
    pub attempts: Vec<AttemptNote>,
}

impl GaveUp {
    /// `create op 12 via lbctl (op id protected-0.3-op-12, key K)`.
    pub fn what(&self) -> String {
        let via = if self.via_lbctl { "lbctl" } else { "the SDK" };
        let mut names = Vec::new();
        if let Some(op_id) = &self.op_id {
            names.push(format!("op id {op_id}"));
        }
        names.push(format!("key {}", self.key.as_deref().unwrap_or("not named")));
        format!("{} (op {}) via {via} ({})", self.op.what(), self.index, names.join(", "))
    }
}

/// A key a client was answered a success (`2xx`) for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acknowledged {
    /// The `Idempotency-Key`.
    pub key: String,
    /// What it was, for the report: the operation's kind and its index.
    pub what: String,
}

/// The workload's counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Logical operations finished.
    pub ops_done: AtomicU64,
    /// Of which ran through lbctl processes.
    pub lbctl_ops: AtomicU64,
    /// HTTP attempts sent (SDK hook plus lbctl's `-v` lines).
    pub attempts: AtomicU64,
    /// Operations that ended in success.
    pub succeeded: AtomicU64,
    /// Operations that ended in a clean refusal (4xx).
    pub refused: AtomicU64,
    /// Operations that gave up or ended otherwise.
    pub failed: AtomicU64,
    /// Successful creates, reboots, deletes.
    pub creates_ok: AtomicU64,
    /// Successful reboots.
    pub reboots_ok: AtomicU64,
    /// Successful deletes.
    pub deletes_ok: AtomicU64,
    /// Flashes accepted.
    pub flashes_ok: AtomicU64,
    /// Successes answered from a stored response.
    pub replayed: AtomicU64,
    /// lbctl processes started.
    pub lbctl_runs: AtomicU64,
    /// lbctl processes killed with SIGKILL before they finished.
    pub lbctl_kills: AtomicU64,
    /// Operations whose client walked away for good.
    pub abandoned: AtomicU64,
    /// Operations whose client took the abandoning path (one attempt, hung up at a random
    /// moment): `abandoned` counts those whose answer had not come by then.
    pub abandoning: AtomicU64,
    /// Operations that gave up (or failed otherwise) and, sent again with their key at the end,
    /// completed (a success or a clean refusal).
    pub rerun_completed: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// Everything the clients need.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    /// Which clients.
    pub kind: ClientKind,
    /// The principals.
    pub principals: Vec<Principal>,
    /// The proxies' base URLs; each attempt picks one at random.
    pub endpoints: Vec<String>,
    /// Probability that an lbctl process run is killed.
    pub kill_rate: f64,
    /// Share of operations through lbctl.
    pub lbctl_share: f64,
    /// The lbctl binary.
    pub lbctl: PathBuf,
    /// The lbctl journal.
    pub journal: PathBuf,
    /// Per attempt.
    pub attempt_timeout: Duration,
    /// Per logical operation.
    pub op_max_elapsed: Duration,
    /// Distinguishes this run's op ids.
    pub run_tag: String,
    /// Probability that an operation (through the SDK) is abandoned by its client.
    pub abandon_rate: f64,
    /// The kinds of operation that may be abandoned.
    pub abandon_ops: Vec<OpKind>,
    /// Share of operations that flash a node's firmware.
    pub flash_share: f64,
    /// The pool's size: flashes pick one of its nodes.
    pub pool_nodes: u32,
}

/// The clients and what they learned.
#[derive(Debug)]
pub struct Workload {
    config: WorkloadConfig,
    http: reqwest::Client,
    policy: RetryPolicy,
    /// The clients' view.
    pub ledger: Mutex<Ledger>,
    /// The counters.
    pub counters: Arc<Counters>,
    /// What the run did to the replicas and the database, and when (the attempts' times count
    /// from its start).
    pub timeline: Arc<Timeline>,
}

impl Workload {
    /// Clients for `config`.
    pub fn new(config: WorkloadConfig) -> anyhow::Result<Self> {
        // No idle connections: every attempt opens its own, so a proxy fault hits one request.
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let counters = Arc::new(Counters::default());
        let policy = RetryPolicy::default()
            .with_max_attempts(1000)
            .with_max_elapsed(config.op_max_elapsed)
            .with_delays(Duration::from_millis(50), Duration::from_secs(2))
            .with_attempt_timeout(config.attempt_timeout);
        let (ledger, timeline) = (Mutex::new(Ledger::default()), Arc::new(Timeline::new()));
        Ok(Workload { config, http, policy, ledger, counters, timeline })
    }

    /// The clients' view, locked.
    pub fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes that a success was answered for `key` (operation `op`).
    fn acknowledged(&self, op: &Op, key: &str) {
        self.ledger().acknowledged.push(Acknowledged { key: key.to_owned(), what: op.what() });
    }

    /// Runs logical operation `index`: picks its kind, runs it to the end, records the outcome.
    pub async fn run_op(&self, index: u64) {
        let (op, via_lbctl, abandon) = {
            let mut rng = rand::rng();
            let via_lbctl = rng.random::<f64>() < self.config.lbctl_share;
            let abandon = !via_lbctl && rng.random::<f64>() < self.config.abandon_rate;
            let roll: f64 = rng.random();
            let mut ledger = self.ledger();
            let op = if roll < self.config.flash_share && self.config.pool_nodes > 0 {
                let node = format!("node-{:04}", rng.random_range(1..=self.config.pool_nodes));
                Op::Flash { node, version: format!("fw-{}.{index}", self.config.run_tag) }
            } else if roll - self.config.flash_share < REBOOT_SHARE + DELETE_SHARE && !ledger.idle.is_empty() {
                let pick = rng.random_range(0..ledger.idle.len());
                let (principal, id) = ledger.idle.swap_remove(pick);
                if roll - self.config.flash_share < REBOOT_SHARE {
                    Op::Reboot { principal, id }
                } else {
                    Op::Delete { principal, id }
                }
            } else {
                Op::Create { principal: rng.random_range(0..self.config.principals.len()), index }
            };
            let abandon = abandon && self.config.abandon_ops.contains(&op.kind());
            (op, via_lbctl, abandon)
        };
        let mut log = OpLog::default();
        let outcome = if via_lbctl {
            add(&self.counters.lbctl_ops, 1);
            self.via_lbctl(&op, index, &mut log).await
        } else if abandon {
            add(&self.counters.abandoning, 1);
            self.abandoning(&op).await
        } else {
            self.via_sdk(&op, &mut log).await
        };
        if let Outcome::Failed(reason) = &outcome {
            let (key, op_id, attempts) = (log.key.clone(), log.op_id.clone(), log.attempts());
            let gave_up = GaveUp { op: op.clone(), index, via_lbctl, key, op_id, reason: reason.clone(), attempts };
            self.ledger().gave_up.push(gave_up);
        }
        self.record(op, outcome);
        add(&self.counters.ops_done, 1);
    }

    /// Counts how the operation ended and learns from it.
    fn record(&self, op: Op, outcome: Outcome) {
        let c = &self.counters;
        match &outcome {
            Outcome::Created(_) | Outcome::Rebooted(_) | Outcome::Deleted | Outcome::Flashed(_) => add(&c.succeeded, 1),
            Outcome::Refused(_) => add(&c.refused, 1),
            Outcome::Failed(_) => add(&c.failed, 1),
            Outcome::Abandoned => add(&c.abandoned, 1),
        }
        self.learn(op, outcome);
    }

    /// Updates the clients' view with what an operation (or its rerun) was told.
    fn learn(&self, op: Op, outcome: Outcome) {
        let c = &self.counters;
        let mut ledger = self.ledger();
        match (op, outcome) {
            (Op::Create { principal, index }, Outcome::Created(worker)) => {
                add(&c.creates_ok, 1);
                if ledger.workers.contains_key(&worker.id) {
                    ledger.same_id_twice += 1;
                } else {
                    let known = Known {
                        principal,
                        op: index,
                        reboots_ok: 0,
                        deleted: false,
                        delete_unknown: false,
                        reboots_abandoned: 0,
                        delete_abandoned: false,
                    };
                    ledger.workers.insert(worker.id.clone(), known);
                    ledger.idle.push((principal, worker.id));
                }
            }
            (Op::Reboot { principal, id }, Outcome::Rebooted(result)) => {
                add(&c.reboots_ok, 1);
                let mismatch = ledger.workers.get_mut(&id).is_none_or(|known| {
                    known.reboots_ok += 1;
                    known.reboots_ok != result.reboot_count || result.id != id
                });
                if mismatch {
                    ledger.reboot_count_mismatches += 1;
                }
                ledger.idle.push((principal, id));
            }
            (Op::Delete { id, .. }, Outcome::Deleted) => {
                add(&c.deletes_ok, 1);
                if let Some(known) = ledger.workers.get_mut(&id) {
                    known.deleted = true;
                }
            }
            (Op::Flash { .. }, Outcome::Flashed(operation)) => {
                add(&c.flashes_ok, 1);
                ledger.flash_ops.push(operation.id);
            }
            (Op::Flash { .. }, Outcome::Abandoned) => ledger.abandoned_flashes += 1,
            (Op::Flash { .. }, Outcome::Refused(reason)) if reason.contains(OPERATION_CONFLICT) => {
                ledger.flash_conflicts += 1;
            }
            (Op::Create { index, .. }, Outcome::Abandoned) => {
                ledger.abandoned_creates.insert(index);
            }
            // The worker is retired: its reboot count is now known only within one.
            (Op::Reboot { id, .. }, Outcome::Abandoned) => {
                ledger.abandoned_reboots += 1;
                if let Some(known) = ledger.workers.get_mut(&id) {
                    known.reboots_abandoned += 1;
                }
            }
            (Op::Delete { id, .. }, Outcome::Abandoned) => {
                if let Some(known) = ledger.workers.get_mut(&id) {
                    known.delete_unknown = true;
                    known.delete_abandoned = true;
                }
            }
            (op, outcome) => {
                let reason = match outcome {
                    Outcome::Refused(r) => Some((false, r)),
                    Outcome::Failed(r) => Some((true, r)),
                    _ => None,
                };
                let failed = reason.as_ref().is_some_and(|(failed, _)| *failed);
                match op {
                    // A protected reboot that gave up is sent again with its key at the end: until
                    // then whether it happened is not known, so no other operation takes the worker.
                    Op::Reboot { .. } if failed && self.config.kind == ClientKind::Protected => {}
                    // The worker is still there: it may be rebooted or deleted later.
                    Op::Reboot { principal, id } => ledger.idle.push((principal, id)),
                    Op::Delete { id, .. } => {
                        if let Some(known) = ledger.workers.get_mut(&id) {
                            known.delete_unknown = true;
                        }
                    }
                    Op::Create { .. } | Op::Flash { .. } => {}
                }
                if let Some((failed, reason)) = reason {
                    let list = if failed { &mut ledger.failures } else { &mut ledger.refusals };
                    if list.len() < KEPT_FAILURES {
                        list.push(reason);
                    }
                }
            }
        }
    }
}
