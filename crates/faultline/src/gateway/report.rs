//! The checks of a gateway run against the upstream's own count, and its report.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use super::client::{Counters, End, Ending, Op, UpstreamCounts, UpstreamFault};
use crate::cli::RunArgs;
use crate::proxy::ProxyCounts;
use crate::verify::Invariant;
use crate::workload::ClientKind;

/// An operation the upstream ran more than once.
const RUN_TWICE: &str = "operations the upstream ran more than once";
/// A success the upstream never ran.
const NEVER_RUN: &str = "successes answered for an operation the upstream never ran";
/// A success whose answer is not one of the operation's runs.
const NOT_ITS_ANSWER: &str = "successes whose answer is not the upstream's answer to that operation";
/// An operation without an end.
const WITHOUT_END: &str = "operations without an end after their rerun";
/// A refusal nothing in the workload asks for.
const REFUSED: &str = "operations refused (a 4xx other than 409 outcome-uncertain)";

/// The JSON file of `run --gateway`.
#[derive(Debug, Serialize)]
pub(super) struct ReportFile<'a> {
    pub(super) command: &'static str,
    pub(super) runs: &'a [GatewayRun],
    /// True when the run through the gateway held every invariant.
    pub(super) protected_passed: bool,
}

/// The set-up of a gateway run.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// `gateway` or `upstream` (the clients straight to the upstream).
    pub through: &'static str,
    /// The gateway's record store: `sqlite`, `postgres`, or none.
    pub record_store: &'static str,
    /// Gateway replicas (0 without the gateway).
    pub replicas: u32,
    /// Logical operations.
    pub ops: u64,
    /// Operations in flight.
    pub concurrency: u32,
    /// Probability of a client fault per connection.
    pub client_fault_rate: f64,
    /// Share of first attempts answered after the gateway's upstream timeout.
    pub upstream_slow: f64,
    /// Share of first attempts whose connection the upstream resets after the work.
    pub upstream_resets: f64,
    /// Share of first attempts answered 503 with nothing done.
    pub upstream_5xx: f64,
    /// The gateway's `--upstream-timeout`, in milliseconds.
    pub upstream_timeout_ms: u64,
    /// The gateway's `--in-flight-ttl`, in milliseconds.
    pub in_flight_ttl_ms: u64,
    /// The clients' attempt timeout, in milliseconds.
    pub attempt_timeout_ms: u64,
    /// The gateway's `--on-uncertain`.
    pub on_uncertain: &'static str,
    /// Whether the route has a probe.
    pub probe: bool,
    /// Gateway kills asked for.
    pub gateway_kills: u32,
    /// How long a killed gateway stayed down, in milliseconds.
    pub gateway_down_ms: u64,
}

pub(super) fn setup(args: &RunArgs, postgres: bool, through_gateway: bool) -> Setup {
    let (sc, options) = (&args.scenario, &args.gateway_options);
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    Setup {
        through: if through_gateway { "gateway" } else { "upstream" },
        record_store: match (through_gateway, postgres) {
            (false, _) => "none",
            (true, true) => "postgres",
            (true, false) => "sqlite",
        },
        replicas: match (through_gateway, postgres) {
            (false, _) => 0,
            (true, true) => sc.replicas,
            (true, false) => 1,
        },
        ops: sc.ops,
        concurrency: sc.concurrency,
        client_fault_rate: args.client_faults,
        upstream_slow: options.upstream_slow,
        upstream_resets: options.upstream_resets,
        upstream_5xx: options.upstream_5xx,
        upstream_timeout_ms: ms(options.upstream_timeout),
        in_flight_ttl_ms: ms(sc.in_flight_ttl),
        attempt_timeout_ms: ms(sc.attempt_timeout),
        on_uncertain: options.on_uncertain.name(),
        probe: !options.no_probe,
        gateway_kills: if through_gateway { sc.server_kills } else { 0 },
        gateway_down_ms: ms(sc.server_down),
    }
}

/// What the clients saw.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Outcomes {
    /// Operations that ended with a 2xx (rerun or not).
    pub succeeded: u64,
    /// Of those, answered from the record (`Idempotent-Replayed: true`), every attempt counted.
    pub replayed_answers: u64,
    /// Operations held for an operator (`409 outcome-uncertain`).
    pub held: u64,
    /// Operations whose client spent its budget in the workload (then rerun).
    pub gave_up: u64,
    /// Operations still without an end after their rerun.
    pub without_end: u64,
    /// Operations refused with another 4xx.
    pub refused: u64,
    /// Attempts sent in the workload.
    pub attempts: u64,
    /// `409 request-in-progress` answers.
    pub in_progress: u64,
    /// `504 outcome-uncertain` answers.
    pub uncertain_504: u64,
    /// `502 upstream-unavailable` answers.
    pub unavailable_502: u64,
    /// Other 5xx and 429 answers.
    pub other_5xx: u64,
    /// Attempts without an answer.
    pub transport_errors: u64,
}

/// The upstream faults asked for on first attempts.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct UpstreamFaults {
    /// Answered after the gateway's timeout.
    pub slow: u64,
    /// Reset after the work.
    pub resets: u64,
    /// 503 with nothing done.
    pub unavailable: u64,
}

/// What the upstream did, by its own count.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Executions {
    /// Executions in all.
    pub executions: u64,
    /// Operations run at least once.
    pub operations_run: u64,
    /// Operations run more than once.
    pub run_more_than_once: u64,
    /// Executions beyond the first of an operation.
    pub extra_executions: u64,
}

/// One gateway run.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayRun {
    /// `protected` (through the gateway) or `naive` (straight to the upstream).
    pub clients: ClientKind,
    /// How it was set up.
    pub setup: Setup,
    /// The client faults the proxies made.
    pub client_faults: ProxyCounts,
    /// The upstream faults asked for.
    pub upstream_faults: UpstreamFaults,
    /// Gateway kills made.
    pub gateway_kills: u32,
    /// What the clients saw.
    pub outcomes: Outcomes,
    /// What the upstream did.
    pub upstream: Executions,
    /// Each invariant.
    pub invariants: Vec<Invariant>,
    /// Up to 20 operations that broke an invariant, with what was seen.
    pub examples: Vec<String>,
    /// Whether every invariant held.
    pub passed: bool,
    /// How long the run took, in milliseconds.
    pub duration_ms: u64,
}

fn none_of(name: &str, actual: u64) -> Invariant {
    Invariant { name: name.to_owned(), expected: 0, actual, at_most: false, ok: actual == 0 }
}

/// What a run saw, for [`check`].
pub(super) struct Observed<'a> {
    pub(super) ops: &'a [Op],
    pub(super) endings: &'a [Ending],
    pub(super) counts: &'a UpstreamCounts,
    pub(super) client_faults: ProxyCounts,
    pub(super) counters: &'a Counters,
    pub(super) gateway_kills: u32,
    pub(super) took: Duration,
}

/// Checks the endings against the upstream's count.
pub(super) fn check(kind: ClientKind, setup: Setup, seen: Observed<'_>) -> GatewayRun {
    let Observed { ops, endings, counts, client_faults, counters, gateway_kills, took } = seen;
    let empty = Vec::new();
    let runs_of = |op: &Op| counts.by_op.get(&op.name).unwrap_or(&empty);
    let (mut twice, mut never_run, mut not_its, mut without_end, mut refused) = (0, 0, 0, 0, 0);
    let mut outcomes = Outcomes::default();
    let mut examples = Vec::new();
    let mut example = |line: String| {
        if examples.len() < 20 {
            examples.push(line);
        }
    };
    for ending in endings {
        let op = &ops[ending.op as usize];
        let runs = runs_of(op);
        if runs.len() > 1 {
            twice += 1;
            example(format!("{}: run {} times (orders {runs:?}), ended {:?}", op.name, runs.len(), ending.last()));
        }
        outcomes.gave_up += u64::from(ending.gave_up());
        match ending.last() {
            End::Succeeded { order, .. } => {
                outcomes.succeeded += 1;
                if runs.is_empty() {
                    never_run += 1;
                    example(format!("{}: answered {order:?} but never run", op.name));
                } else if !order.is_some_and(|o| runs.contains(&o)) {
                    not_its += 1;
                    example(format!("{}: answered order {order:?}, runs {runs:?}", op.name));
                }
            }
            End::Held => outcomes.held += 1,
            End::GaveUp { last } => {
                without_end += 1;
                example(format!("{}: no end after its rerun ({} attempts; last: {last})", op.name, ending.attempts));
            }
            End::Refused { status, body } => {
                refused += 1;
                example(format!("{}: refused {status} {body}", op.name));
            }
        }
    }
    outcomes.without_end = without_end;
    outcomes.refused = refused;
    outcomes.attempts = counters.attempts.load(Ordering::Relaxed);
    outcomes.replayed_answers = counters.replayed.load(Ordering::Relaxed);
    outcomes.in_progress = counters.in_progress.load(Ordering::Relaxed);
    outcomes.uncertain_504 = counters.uncertain_504.load(Ordering::Relaxed);
    outcomes.unavailable_502 = counters.unavailable_502.load(Ordering::Relaxed);
    outcomes.other_5xx = counters.other_5xx.load(Ordering::Relaxed);
    outcomes.transport_errors = counters.transport_errors.load(Ordering::Relaxed);
    let mut upstream_faults = UpstreamFaults::default();
    for op in ops {
        match op.fault {
            Some(UpstreamFault::Slow(_)) => upstream_faults.slow += 1,
            Some(UpstreamFault::Reset) => upstream_faults.resets += 1,
            Some(UpstreamFault::Unavailable) => upstream_faults.unavailable += 1,
            None => {}
        }
    }
    let per_op: HashMap<&str, usize> = counts.by_op.iter().map(|(k, v)| (k.as_str(), v.len())).collect();
    let upstream = Executions {
        executions: counts.executions,
        operations_run: per_op.values().filter(|&&n| n > 0).count() as u64,
        run_more_than_once: twice,
        extra_executions: per_op.values().map(|&n| n.saturating_sub(1) as u64).sum(),
    };
    let invariants = vec![
        none_of(RUN_TWICE, twice),
        none_of(NEVER_RUN, never_run),
        none_of(NOT_ITS_ANSWER, not_its),
        none_of(WITHOUT_END, without_end),
        none_of(REFUSED, refused),
    ];
    let passed = invariants.iter().all(|i| i.ok);
    GatewayRun {
        clients: kind,
        setup,
        client_faults,
        upstream_faults,
        gateway_kills,
        outcomes,
        upstream,
        invariants,
        examples,
        passed,
        duration_ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
    }
}

type Row = (&'static str, fn(&GatewayRun) -> String);

fn rows() -> Vec<Row> {
    vec![
        ("record store x replicas", |r| format!("{} x{}", r.setup.record_store, r.setup.replicas)),
        ("operations", |r| r.setup.ops.to_string()),
        ("client faults: never reached / lost / gave up", |r| {
            let f = &r.client_faults;
            format!("{} / {} / {}", f.never_reached, f.response_lost, f.gave_up_mid_flight)
        }),
        ("upstream faults: slow / reset / 503", |r| {
            let f = &r.upstream_faults;
            format!("{} / {} / {}", f.slow, f.resets, f.unavailable)
        }),
        ("gateway kills", |r| r.gateway_kills.to_string()),
        ("attempts", |r| r.outcomes.attempts.to_string()),
        ("succeeded", |r| r.outcomes.succeeded.to_string()),
        ("replayed answers", |r| r.outcomes.replayed_answers.to_string()),
        ("504 outcome-uncertain answers", |r| r.outcomes.uncertain_504.to_string()),
        ("held (409 outcome-uncertain)", |r| r.outcomes.held.to_string()),
        ("gave up, then rerun", |r| r.outcomes.gave_up.to_string()),
        ("upstream executions", |r| r.upstream.executions.to_string()),
        ("operations run more than once", |r| r.upstream.run_more_than_once.to_string()),
        ("extra executions", |r| r.upstream.extra_executions.to_string()),
        ("successes never run / not its answer", |r| {
            let get = |name: &str| r.invariants.iter().find(|i| i.name == name).map_or(0, |i| i.actual);
            format!("{} / {}", get(NEVER_RUN), get(NOT_ITS_ANSWER))
        }),
        ("without an end / refused", |r| format!("{} / {}", r.outcomes.without_end, r.outcomes.refused)),
        ("invariants held", |r| if r.passed { "yes".to_owned() } else { "NO".to_owned() }),
        ("seconds", |r| format!("{:.0}", r.duration_ms as f64 / 1000.0)),
    ]
}

/// The runs side by side, as a Markdown table.
pub(super) fn table(runs: &[GatewayRun]) -> String {
    let header: Vec<String> = runs
        .iter()
        .map(|r| {
            let through = if r.setup.through == "gateway" { "through the gateway" } else { "without it" };
            format!("{through} @{}", r.setup.client_fault_rate)
        })
        .collect();
    let cells: Vec<(&str, Vec<String>)> =
        rows().iter().map(|(label, f)| (*label, runs.iter().map(f).collect())).collect();
    crate::report::markdown(&header, &cells)
}

/// The invariants that broke, with examples, one line each.
pub(super) fn broken(runs: &[GatewayRun]) -> String {
    let mut out = String::new();
    for run in runs {
        for i in run.invariants.iter().filter(|i| !i.ok) {
            let _ = writeln!(out, "{} clients: {}: {}", run.clients.name(), i.name, i.actual);
        }
        for e in run.examples.iter().filter(|_| !run.passed) {
            let _ = writeln!(out, "  {e}");
        }
    }
    out
}
