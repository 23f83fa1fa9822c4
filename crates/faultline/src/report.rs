//! The report: a table on stdout, a JSON file and an SVG chart.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use leasebroker_client::Fleet;
use plotters::prelude::*;
use serde::Serialize;

use crate::proxy::ProxyCounts;
use crate::verify::{Damage, Invariant, ServerCounters, SimStats};
use crate::workload::{ClientKind, Rerun};

/// The set-up of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// `sqlite` or `postgres`.
    pub database: &'static str,
    /// Where the idempotency records were: `database`, or `redis-cluster x3`.
    pub record_store: &'static str,
    /// `serve` processes.
    pub replicas: u32,
    /// Logical operations.
    pub ops: u64,
    /// Operations in flight.
    pub concurrency: u32,
    /// Probability of a client fault per connection / lbctl process run.
    pub client_fault_rate: f64,
    /// Share of operations through lbctl.
    pub lbctl_share: f64,
    /// Share of operations that flash firmware.
    pub flash_share: f64,
    /// Where the VMs ran: `simulator`, or `libvirt URI`.
    pub hypervisor: String,
    /// How the flashes reached the BMCs.
    pub bmc: crate::cli::BmcMode,
    /// Server kills asked for.
    pub server_kills: u32,
    /// How long a killed replica stayed down before it was started again, in milliseconds.
    pub server_down_ms: u64,
    /// Simulator fail-before probability.
    pub hv_fail_before: f64,
    /// Simulator fail-after probability.
    pub hv_fail_after: f64,
    /// Simulator latency.
    pub hv_latency_ms: u64,
    /// Simulator: share of slow calls (landing after the server's timeout).
    pub hv_slow: f64,
    /// Simulator: extra latency of a slow call.
    pub hv_slow_ms: u64,
    /// Simulator: share of calls refused for good (4xx, nothing done).
    pub hv_refuse: f64,
    /// Share of first boots held past the settle window (`--late-landings`).
    pub late_landings: f64,
    /// How long after the settle window they land, in milliseconds.
    pub late_by_ms: u64,
    /// Replica pauses asked for (SIGSTOP, then SIGCONT).
    pub pauses: u32,
    /// How long each pause lasts, in milliseconds.
    pub pause_ms: u64,
    /// VMs (and one flash) planted with no owner (`--plant-orphans`).
    pub plant_orphans: u32,
    /// `--drop-acknowledged`: acknowledged records deleted behind the service's back.
    pub drop_acknowledged: u32,
    /// The servers' `--hypervisor-timeout`, in milliseconds.
    pub hypervisor_timeout_ms: u64,
    /// The servers' `--hypervisor-settle`, in milliseconds (absent when they lack the flag).
    pub hypervisor_settle_ms: Option<u64>,
    /// Share of operations whose client walks away.
    pub abandon: f64,
    /// The kinds of operation that may be abandoned.
    pub abandon_ops: Vec<crate::workload::OpKind>,
    /// The servers' `--abandon-after`, in milliseconds (absent when not passed).
    pub abandon_after_ms: Option<u64>,
    /// Each operation's retry budget, in milliseconds.
    pub op_max_elapsed_ms: u64,
    /// Database restarts asked for.
    pub postgres_restarts: u32,
    /// On an HA PostgreSQL (`--postgres-ha`): its replication, `sync` or `async`.
    pub postgres_ha: Option<&'static str>,
    /// PostgreSQL failovers asked for.
    pub postgres_failovers: u32,
    /// Redis primary failovers asked for.
    pub redis_failovers: u32,
    /// The servers' `--record-store-replicas`.
    pub record_store_replicas: u32,
    /// `--pool-nodes`.
    pub pool_nodes: u32,
}

/// Client faults injected, by kind.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Faults {
    /// (a) the request never reached the server.
    pub never_reached: u64,
    /// (b) the response was lost after the work.
    pub response_lost: u64,
    /// (c) the client gave up mid-flight.
    pub gave_up_mid_flight: u64,
    /// (d) an lbctl process was killed with SIGKILL and run again.
    pub client_killed: u64,
}

impl Faults {
    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.never_reached + self.response_lost + self.gave_up_mid_flight + self.client_killed
    }
}

/// How the logical operations ended (`succeeded`, `refused`, `failed` and `abandoned` add up to
/// the operations; the successes by kind include those of the reruns).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Outcomes {
    /// Success.
    pub succeeded: u64,
    /// A clean refusal (4xx).
    pub refused: u64,
    /// Gave up or anything else.
    pub failed: u64,
    /// Of those, sent again with their key once the faults were over: completed (a success or a
    /// clean refusal).
    pub rerun_completed: u64,
    /// The client walked away for good.
    pub abandoned: u64,
    /// The clients that took the abandoning path (one attempt, then a hang-up at a random
    /// moment before, during or after the server's work); those whose answer came first count
    /// as succeeded or refused, not `abandoned`.
    pub abandoning: u64,
    /// Successful creates.
    pub creates_ok: u64,
    /// Successful reboots.
    pub reboots_ok: u64,
    /// Successful deletes.
    pub deletes_ok: u64,
    /// Flashes accepted (`202`).
    pub flashes_ok: u64,
    /// Flashes refused because another flash ran on the node.
    pub flash_conflicts: u64,
    /// Successes answered from a stored response.
    pub replayed: u64,
    /// Operations run through lbctl.
    pub via_lbctl: u64,
    /// lbctl processes started.
    pub lbctl_runs: u64,
}

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Which clients.
    pub clients: ClientKind,
    /// The set-up.
    pub setup: Setup,
    /// HTTP attempts the clients sent.
    pub attempts: u64,
    /// Client faults injected.
    pub faults: Faults,
    /// What the proxies saw.
    pub proxy: ProxyCounts,
    /// Replicas killed with SIGKILL and restarted.
    pub server_kills: u32,
    /// Times the database was stopped and started again.
    pub postgres_restarts: u32,
    /// Failovers made (PostgreSQL primary killed or switched over; Redis primary killed and its
    /// replica promoted).
    pub failovers: u32,
    /// Replica pauses made (SIGSTOP, then SIGCONT).
    pub pauses: u32,
    /// Boots held past the settle window, and how many landed.
    pub late: crate::late::LateCounts,
    /// How the operations ended.
    pub outcomes: Outcomes,
    /// What was duplicated or lost.
    pub damage: Damage,
    /// The fleet at the end.
    pub fleet: Fleet,
    /// The simulator's counters at the end.
    pub hypervisor: SimStats,
    /// The replicas' counters at the end.
    pub server: ServerCounters,
    /// Every invariant checked.
    pub invariants: Vec<Invariant>,
    /// All invariants held.
    pub passed: bool,
    /// The first failure reasons.
    pub failures: Vec<String>,
    /// The first refusal reasons.
    pub refusals: Vec<String>,
    /// The operations that gave up (the first 50; their count is `outcomes.failed`): why,
    /// attempt by attempt, and what their rerun with the same key was answered.
    pub gave_up: Vec<Rerun>,
    /// What the run did to the replicas and the database, and when (from the start of the
    /// workload, as the attempts' times).
    pub timeline: Vec<String>,
    /// Listed workers whose VM does not run, and what the clients know of each.
    pub workers_without_vm: Vec<String>,
    /// VMs running that no worker runs on (`vm_id (tag)`), after the inventory sweep's time.
    pub vms_without_worker: Vec<String>,
    /// Flashes the BMCs hold that no operation owns (`node: tag`).
    pub flashes_without_operation: Vec<String>,
    /// Keys a success (`2xx`) was answered for.
    pub acknowledged: u64,
    /// Acknowledged keys whose record is gone or no longer completed at the end (`key (what):
    /// gone|state`, the first 50; the count is `damage.acknowledged_records_lost`).
    pub records_lost: Vec<String>,
    /// Seconds the run waited after settling for what nobody owns to be removed.
    pub owners_wait_secs: f64,
    /// Seconds spent running operations.
    pub workload_secs: f64,
    /// Seconds for the whole run (start-up, settling and checks included).
    pub elapsed_secs: f64,
}

/// A table row: its label and how to render one run's cell.
type Row = (&'static str, Box<dyn Fn(&RunReport) -> String>);
/// A charted metric: its name, its value for a run, its colour.
type Metric = (&'static str, fn(&RunReport) -> i64, RGBColor);

/// Table rows: the set-up, the operations and the attempts.
fn setup_rows() -> Vec<Row> {
    vec![
        (
            "database / replicas",
            Box::new(|r| match r.setup.postgres_ha {
                Some(repl) => format!("postgres HA x3 ({repl} replication) / {}", r.setup.replicas),
                None => format!("{} x{}", r.setup.database, r.setup.replicas),
            }),
        ),
        ("idempotency records", Box::new(|r| r.setup.record_store.to_owned())),
        (
            "VMs on / BMCs via",
            Box::new(|r| {
                let bmc = match (r.setup.bmc, r.setup.flash_share > 0.0) {
                    (_, false) => "no flashes",
                    (crate::cli::BmcMode::Native, true) => "native",
                    (crate::cli::BmcMode::Redfish, true) => "redfish",
                };
                format!("{} / {bmc}", r.setup.hypervisor)
            }),
        ),
        ("  --record-store-replicas (WAIT)", Box::new(|r| r.setup.record_store_replicas.to_string())),
        (
            "failovers made (postgres / redis asked)",
            Box::new(|r| format!("{} ({}/{})", r.failovers, r.setup.postgres_failovers, r.setup.redis_failovers)),
        ),
        ("operations", Box::new(|r| r.setup.ops.to_string())),
        ("  via lbctl processes", Box::new(|r| r.outcomes.via_lbctl.to_string())),
        ("attempts (HTTP requests)", Box::new(|r| r.attempts.to_string())),
    ]
}

/// Table rows: the faults made.
fn fault_rows() -> Vec<Row> {
    vec![
        ("faults injected", Box::new(|r| r.faults.total().to_string())),
        ("  (a) never reached server", Box::new(|r| r.faults.never_reached.to_string())),
        ("  (b) response lost after work", Box::new(|r| r.faults.response_lost.to_string())),
        ("  (c) client gave up mid-flight", Box::new(|r| r.faults.gave_up_mid_flight.to_string())),
        ("  (d) client killed + rerun", Box::new(|r| r.faults.client_killed.to_string())),
        ("server kills (SIGKILL)", Box::new(|r| r.server_kills.to_string())),
        ("database restarts", Box::new(|r| r.postgres_restarts.to_string())),
        ("hypervisor fail before/after", Box::new(|r| format!("{}/{}", r.setup.hv_fail_before, r.setup.hv_fail_after))),
        (
            "hypervisor slow (late landings) / refuse",
            Box::new(|r| {
                let late = if r.setup.hv_slow > 0.0 { format!(" (+{}ms)", r.setup.hv_slow_ms) } else { String::new() };
                format!("{}{late}/{}", r.setup.hv_slow, r.setup.hv_refuse)
            }),
        ),
        (
            "late landings past settle (held / booted)",
            Box::new(|r| {
                let by =
                    if r.setup.late_landings > 0.0 { format!(" (+{}ms)", r.setup.late_by_ms) } else { String::new() };
                format!("{}{by}: {}/{}", r.setup.late_landings, r.late.held, r.late.booted)
            }),
        ),
        ("replica pauses (SIGSTOP)", Box::new(|r| format!("{} ({}ms)", r.pauses, r.setup.pause_ms))),
        (
            "hypervisor timeout / settle",
            Box::new(|r| {
                let settle = r.setup.hypervisor_settle_ms.map_or_else(|| "-".to_owned(), |ms| format!("{ms}ms"));
                format!("{}ms/{settle}", r.setup.hypervisor_timeout_ms)
            }),
        ),
    ]
}

/// Table rows: how the operations ended and what the service did.
fn outcome_rows() -> Vec<Row> {
    vec![
        (
            "succeeded / refused / failed",
            Box::new(|r| format!("{}/{}/{}", r.outcomes.succeeded, r.outcomes.refused, r.outcomes.failed)),
        ),
        (
            "abandoned by client (server finished)",
            Box::new(|r| format!("{} ({})", r.outcomes.abandoned, r.damage.abandoned_creates_finished)),
        ),
        (
            "creates / reboots / deletes ok",
            Box::new(|r| format!("{}/{}/{}", r.outcomes.creates_ok, r.outcomes.reboots_ok, r.outcomes.deletes_ok)),
        ),
        ("replayed answers", Box::new(|r| r.outcomes.replayed.to_string())),
        (
            "server: refusals released / late VMs destroyed / orphans removed / ops reaped",
            Box::new(|r| {
                let s = r.server;
                format!(
                    "{}/{}/{}/{}",
                    s.refusals_released, s.duplicate_vms_destroyed, s.orphans_removed, s.operations_reaped
                )
            }),
        ),
        ("workers active (server)", Box::new(|r| r.fleet.workers_active.to_string())),
    ]
}

/// Table rows: what was duplicated, lost or left running, and the invariants.
fn damage_rows() -> Vec<Row> {
    vec![
        ("PHANTOM WORKERS", Box::new(|r| r.damage.phantom_workers.to_string())),
        ("lost workers", Box::new(|r| r.damage.lost_workers.to_string())),
        (
            "leaked leases / nodes / VMs",
            Box::new(|r| format!("{}/{}/{}", r.damage.leaked_leases, r.damage.leaked_nodes, r.damage.leaked_vms)),
        ),
        ("DUPLICATE BOOTS (extra boots)", Box::new(|r| r.damage.extra_boots.to_string())),
        ("  duplicate boot tags", Box::new(|r| r.damage.duplicate_boot_tags.to_string())),
        ("DOUBLE REBOOTS (extra reboots)", Box::new(|r| r.damage.extra_reboots.to_string())),
        ("  duplicate reboot tags", Box::new(|r| r.damage.duplicate_reboot_tags.to_string())),
        ("  reboot_count mismatches", Box::new(|r| r.damage.reboot_count_mismatches.to_string())),
        (
            "flashes accepted / refused (node busy)",
            Box::new(|r| format!("{}/{}", r.outcomes.flashes_ok, r.outcomes.flash_conflicts)),
        ),
        ("BRICKED NODES", Box::new(|r| r.damage.bricked_nodes.to_string())),
        (
            "  extra flashes / duplicate flash tags",
            Box::new(|r| format!("{}/{}", r.damage.extra_flashes, r.damage.duplicate_flash_tags)),
        ),
        ("  flash operations stuck running", Box::new(|r| r.damage.stuck_operations.to_string())),
        (
            "RUNNING UNOWNED: VMs w/o worker / flashes w/o op",
            Box::new(|r| format!("{}/{}", r.damage.vms_without_worker, r.damage.flashes_without_operation)),
        ),
        (
            "ACKNOWLEDGED RECORDS LOST (of acked) / workers / flash ops",
            Box::new(|r| {
                let d = r.damage;
                format!(
                    "{} (of {})/{}/{}",
                    d.acknowledged_records_lost, r.acknowledged, d.lost_workers, d.acknowledged_flash_ops_lost
                )
            }),
        ),
        (
            "FAILED OPS (gave up) / then completed on rerun with their key",
            Box::new(|r| format!("{}/{}", r.outcomes.failed, r.outcomes.rerun_completed)),
        ),
        ("  reruns not answered the stored response", Box::new(|r| r.damage.reruns_not_stored_answer.to_string())),
        (
            "invariants",
            Box::new(|r| {
                let broken = r.invariants.iter().filter(|i| !i.ok).count();
                if broken == 0 { "all held".to_owned() } else { format!("{broken} broken") }
            }),
        ),
        ("elapsed (workload / total)", Box::new(|r| format!("{:.1}s/{:.1}s", r.workload_secs, r.elapsed_secs))),
    ]
}

/// The table of a set of runs, one column each.
pub fn table(runs: &[RunReport]) -> String {
    let header: Vec<String> =
        runs.iter().map(|r| format!("{} @{}", r.clients.name(), r.setup.client_fault_rate)).collect();
    let rows: Vec<Row> = [setup_rows(), fault_rows(), outcome_rows(), damage_rows()].into_iter().flatten().collect();
    let cells: Vec<(&str, Vec<String>)> =
        rows.iter().map(|(label, f)| (*label, runs.iter().map(f).collect())).collect();
    markdown(&header, &cells)
}

/// A Markdown table: a column of labels, then one right-aligned column per `header`; each row
/// has a cell per column.
pub fn markdown(header: &[String], rows: &[(&str, Vec<String>)]) -> String {
    let label_width = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let width = |i: usize| rows.iter().map(|(_, c)| c[i].len()).chain([header[i].len()]).max().unwrap_or(0);
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let mut out = String::new();
    let _ = write!(out, "| {:label_width$} |", "");
    for (h, w) in header.iter().zip(&widths) {
        let _ = write!(out, " {h:>w$} |");
    }
    out.push('\n');
    let _ = write!(out, "|{}|", "-".repeat(label_width + 2));
    for w in &widths {
        let _ = write!(out, "{}:|", "-".repeat(w + 1));
    }
    out.push('\n');
    for (label, row) in rows {
        let _ = write!(out, "| {label:label_width$} |");
        for (c, w) in row.iter().zip(&widths) {
            let _ = write!(out, " {c:>w$} |");
        }
        out.push('\n');
    }
    out
}

/// The invariants that broke, one line each.
pub fn broken(runs: &[RunReport]) -> String {
    let mut out = String::new();
    for r in runs {
        for i in r.invariants.iter().filter(|i| !i.ok) {
            let _ = writeln!(
                out,
                "  {} @{}: {}: expected {}{}, got {}",
                r.clients.name(),
                r.setup.client_fault_rate,
                i.name,
                if i.at_most { "at most " } else { "" },
                i.expected,
                i.actual
            );
        }
    }
    out
}

/// The operations that gave up, each with its attempts and its rerun: empty when none did.
pub fn gave_up(runs: &[RunReport]) -> String {
    let mut out = String::new();
    for r in runs.iter().filter(|r| !r.gave_up.is_empty()) {
        let _ = writeln!(out, "  {} @{}:", r.clients.name(), r.setup.client_fault_rate);
        for g in &r.gave_up {
            let _ = writeln!(out, "    {}: {}", g.what, g.reason);
            for a in &g.attempts {
                let _ = writeln!(out, "      {a}");
            }
            let matched = match g.matched {
                Some(true) => ", the stored response",
                Some(false) => ", NOT THE STORED RESPONSE",
                None => "",
            };
            let _ = writeln!(out, "      rerun (stored before: {}): {}{matched}", g.stored_before, g.answer);
        }
        if !r.timeline.is_empty() {
            let _ = writeln!(out, "    the run's timeline: {}", r.timeline.join("; "));
        }
    }
    out
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    let json = serde_json::to_vec_pretty(value)?;
    std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
}

/// Charts phantom workers, extra boots and extra reboots against the client fault rate, for both
/// client kinds.
pub fn chart(path: &Path, runs: &[RunReport]) -> anyhow::Result<()> {
    let series = |kind: ClientKind, f: fn(&RunReport) -> i64| -> Vec<(f64, i64)> {
        let mut points: Vec<(f64, i64)> =
            runs.iter().filter(|r| r.clients == kind).map(|r| (r.setup.client_fault_rate, f(r))).collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    };
    let metrics: [Metric; 3] = [
        ("phantom workers", |r| r.damage.phantom_workers as i64, RED),
        ("duplicate boots", |r| r.damage.extra_boots, BLUE),
        ("double reboots", |r| r.damage.extra_reboots, GREEN),
    ];
    let max_x = runs.iter().map(|r| r.setup.client_fault_rate).fold(0.0_f64, f64::max).max(0.05) * 1.1;
    let max_y = runs.iter().flat_map(|r| metrics.iter().map(move |(_, f, _)| f(r))).max().unwrap_or(0).max(1);
    let ops = runs.first().map_or(0, |r| r.setup.ops);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("What idempotency keys prevent ({ops} ops per run)"), ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.01..max_x, -1i64..(max_y + max_y / 10 + 1))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("client fault rate")
        .y_desc("count at the end of the run")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (name, f, color) in metrics {
        for (kind, dashed) in [(ClientKind::Naive, false), (ClientKind::Protected, true)] {
            let points = series(kind, f);
            if points.is_empty() {
                continue;
            }
            let style = if dashed { color.mix(0.5).stroke_width(2) } else { color.stroke_width(3) };
            let label = format!("{name}, {} clients", kind.name());
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style))
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            let marker = if dashed { color.mix(0.5).filled() } else { color.filled() };
            chart
                .draw_series(points.iter().map(|&(x, y)| Circle::new((x, y), 4, marker)))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}
