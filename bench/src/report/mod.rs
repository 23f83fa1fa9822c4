//! From raw measurements (JSON lines) to the table of ratios.
//!
//! Every ratio is taken within one round, between runs that ran next to each other
//! (A, B, A, B ...), and the table shows the median over rounds with the lowest and highest.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Debug, Args)]
pub(crate) struct ReportArgs {
    /// The raw measurements, one JSON object a line.
    #[arg(long)]
    raw: PathBuf,
    /// Where `results.json` and `results.md` go.
    #[arg(long)]
    out: PathBuf,
    /// A line about the machine and date, for the table's heading.
    #[arg(long, default_value = "")]
    context: String,
}

/// One raw measurement as `bench/run` records it.
#[derive(Debug, Clone, Deserialize)]
struct Raw {
    part: String,
    #[serde(default)]
    case: String,
    #[serde(default)]
    conns: u32,
    #[serde(default)]
    variant: String,
    #[serde(default)]
    round: u32,
    m: Value,
}

type Key = (String, String, u32, String);

fn key(part: &str, case: &str, conns: u32, variant: &str) -> Key {
    (part.into(), case.into(), conns, variant.into())
}

/// How a ratio is judged.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
enum Goal {
    AtLeast(f64),
    AtMost(f64),
}

impl Goal {
    fn met(self, ratio: f64) -> bool {
        match self {
            Goal::AtLeast(g) => ratio >= g,
            Goal::AtMost(g) => ratio <= g,
        }
    }
    fn text(self) -> String {
        match self {
            Goal::AtLeast(g) => format!(">= {g}"),
            Goal::AtMost(g) => format!("<= {g}"),
        }
    }
}

#[derive(Debug, Serialize)]
struct Ratio {
    part: &'static str,
    what: String,
    metric: &'static str,
    a: f64,
    b: f64,
    ratio: f64,
    ratio_min: f64,
    ratio_max: f64,
    rounds: usize,
    goal: Option<Goal>,
    met: Option<bool>,
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

struct Runs(BTreeMap<Key, BTreeMap<u32, Value>>);

impl Runs {
    fn metric(&self, k: &Key, round: u32, metric: &str) -> Option<f64> {
        self.0.get(k)?.get(&round)?.get(metric)?.as_f64()
    }

    fn median(&self, k: &Key, metric: &str) -> f64 {
        median(self.0.get(k).map(|r| r.values().filter_map(|m| m[metric].as_f64()).collect()).unwrap_or_default())
    }

    /// A / B per round, for rounds that measured both.
    fn ratio(
        &self,
        part: &'static str,
        what: String,
        metric: &'static str,
        a: &Key,
        b: &Key,
        goal: Option<Goal>,
    ) -> Option<Ratio> {
        let rounds: Vec<u32> = self.0.get(a)?.keys().copied().collect();
        let per: Vec<f64> = rounds
            .iter()
            .filter_map(|&r| Some(self.metric(a, r, metric)? / self.metric(b, r, metric)?))
            .filter(|x| x.is_finite())
            .collect();
        if per.is_empty() {
            return None;
        }
        let ratio = median(per.clone());
        Some(Ratio {
            part,
            what,
            metric,
            a: self.median(a, metric),
            b: self.median(b, metric),
            ratio,
            ratio_min: per.iter().copied().fold(f64::INFINITY, f64::min),
            ratio_max: per.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            rounds: per.len(),
            goal,
            met: goal.map(|g| g.met(ratio)),
        })
    }
}

const CONNS: [u32; 3] = [1, 16, 64];

fn ratios(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    for case in ["first", "replay"] {
        for c in CONNS {
            let k = |v: &str| key("layer", case, c, v);
            let at = format!("{case}, {c} conn");
            push(runs.ratio(
                "layer",
                format!("layer+memory / bare ({at})"),
                "rps",
                &k("memory"),
                &k("bare"),
                Some(Goal::AtLeast(0.85)),
            ));
            push(runs.ratio(
                "layer",
                format!("layer+memory / axum-idempotent ({at})"),
                "rps",
                &k("memory"),
                &k("peer"),
                Some(Goal::AtLeast(1.0)),
            ));
            for (v, name) in [("sqlite", "layer+SQLite"), ("postgres", "layer+PostgreSQL"), ("peer", "axum-idempotent")]
            {
                push(runs.ratio("layer", format!("{name} / bare ({at})"), "rps", &k(v), &k("bare"), None));
            }
            push(runs.ratio(
                "layer",
                format!("p99: layer+memory / bare ({at})"),
                "p99_us",
                &k("memory"),
                &k("bare"),
                None,
            ));
        }
    }
    out.extend(layer_cost(runs));
    let mut push = |r: Option<Ratio>| out.extend(r);
    let f = |case: &str, v: &str| key("floor", case, 16, v);
    push(runs.ratio(
        "floor",
        "replay: store direct / pgbench lookup".into(),
        "rps",
        &f("replay", "store"),
        &f("replay", "pgbench"),
        Some(Goal::AtLeast(0.8)),
    ));
    push(runs.ratio(
        "floor",
        "replay: store direct, default pool 10 / pgbench lookup".into(),
        "rps",
        &f("replay", "store-pool10"),
        &f("replay", "pgbench"),
        None,
    ));
    push(runs.ratio(
        "floor",
        "replay: layer over HTTP (wrk, hot key) / pgbench lookup".into(),
        "rps",
        &f("replay", "layer"),
        &f("replay", "pgbench"),
        Some(Goal::AtLeast(0.7)),
    ));
    push(runs.ratio(
        "floor",
        "first: store direct claim+complete / pgbench script".into(),
        "rps",
        &f("first", "store"),
        &f("first", "pgbench"),
        Some(Goal::AtLeast(0.7)),
    ));
    push(runs.ratio(
        "floor",
        "first: store direct, default pool 10 / pgbench script".into(),
        "rps",
        &f("first", "store-pool10"),
        &f("first", "pgbench"),
        None,
    ));
    push(runs.ratio(
        "floor",
        "first: layer over HTTP (wrk) / pgbench script".into(),
        "rps",
        &f("first", "layer"),
        &f("first", "pgbench"),
        Some(Goal::AtLeast(0.7)),
    ));
    for case in ["replay", "first"] {
        push(runs.ratio(
            "floor",
            format!("{case}: store, sqlx's default ping on every checkout / the stores' pool (no ping)"),
            "rps",
            &f(case, "store-ping"),
            &f(case, "store"),
            None,
        ));
    }
    for case in ["replay", "first"] {
        push(runs.ratio(
            "floor",
            format!("{case}: store through a multi-host URL (follows the primary) / one host"),
            "rps",
            &f(case, "store-multihost"),
            &f(case, "store"),
            None,
        ));
    }
    for (case, at) in [("replay", "10k keys"), ("replay-hot", "one hot key")] {
        push(runs.ratio(
            "floor",
            format!("replay ({at}): SeedUpsert / InsertOrRead"),
            "rps",
            &f(case, "seed"),
            &f(case, "store"),
            None,
        ));
        push(runs.ratio(
            "floor",
            format!("replay ({at}) WAL bytes/op: SeedUpsert / InsertOrRead"),
            "wal_bytes_per_op",
            &f(case, "seed"),
            &f(case, "store"),
            None,
        ));
    }
    let r = |case: &str, v: &str| key("redis", case, 16, v);
    push(runs.ratio(
        "redis",
        "replay: Redis store direct / redis-benchmark (its claim script, one completed key)".into(),
        "rps",
        &r("replay", "store"),
        &r("replay", "redis-benchmark"),
        Some(Goal::AtLeast(0.7)),
    ));
    push(runs.ratio(
        "redis",
        "first: Redis store direct claim+complete / redis-benchmark (its claim, then complete, scripts)".into(),
        "rps",
        &r("first", "store"),
        &r("first", "redis-benchmark"),
        Some(Goal::AtLeast(0.7)),
    ));
    for case in ["replay", "first"] {
        push(runs.ratio(
            "redis",
            format!("{case}: Redis store direct / PostgreSQL store direct"),
            "rps",
            &r(case, "store"),
            &r(case, "postgres-store"),
            None,
        ));
    }
    // Part `replication` (issue 28): the price of waiting for a replica, as a ratio of
    // throughputs (below 1: slower with the wait).
    let rep = |case: &str, v: &str| key("replication", case, 16, v);
    for case in ["first", "replay"] {
        push(runs.ratio(
            "replication",
            format!("{case}: PostgreSQL store, synchronous / asynchronous replication (Patroni)"),
            "rps",
            &rep(case, "pg-sync"),
            &rep(case, "pg-async"),
            None,
        ));
        push(runs.ratio(
            "replication",
            format!("{case}: Redis Cluster store, WAIT 1 replica / no wait"),
            "rps",
            &rep(case, "redis-wait1"),
            &rep(case, "redis-nowait"),
            None,
        ));
    }
    push(runs.ratio(
        "sweeper",
        "claim p99: sweeping / idle".into(),
        "p99_us",
        &key("sweeper", "claim", 0, "sweeping"),
        &key("sweeper", "claim", 0, "idle"),
        Some(Goal::AtMost(2.0)),
    ));
    push(runs.ratio(
        "size",
        "bytes per record (1 KiB JSON): compressed / raw".into(),
        "total_bytes_per_record",
        &key("size", "", 0, "compressed"),
        &key("size", "", 0, "raw"),
        None,
    ));
    partition_ratios(runs).into_iter().for_each(|r| push(Some(r)));
    for db in ["sqlite", "postgres"] {
        let e = |case: &str| key("e2e", case, 16, db);
        push(runs.ratio(
            "e2e",
            format!("leasebroker on {db}: replays/s / creates/s"),
            "rps",
            &e("replay"),
            &e("create"),
            None,
        ));
    }
    // The scale part (issue 16, goal 4): the largest table against the smallest, and the pool
    // at 50% and 99% allocated against empty.
    for (case, what) in [
        ("replay", "replay"),
        ("first", "first execution"),
        ("create", "leasebroker create"),
        ("create-sqlite", "leasebroker on SQLite create"),
    ] {
        let sizes: Vec<(u64, &Key)> = runs
            .0
            .keys()
            .filter(|k| k.0 == "scale" && k.1 == case)
            .filter_map(|k| Some((k.3.parse::<u64>().ok()?, k)))
            .collect();
        let Some(&(low, base)) = sizes.iter().min_by_key(|s| s.0) else { continue };
        let unit = if case.starts_with("create") { "% allocated" } else { " records" };
        for &(n, k) in sizes.iter().filter(|s| s.0 != low) {
            for (metric, goal) in [("p50_us", Some(Goal::AtMost(1.5))), ("p99_us", None)] {
                let name = if metric == "p50_us" { "p50" } else { "p99" };
                push(runs.ratio("scale", format!("{what} {name}: {n}{unit} / {low}{unit}"), metric, k, base, goal));
            }
        }
    }
    push_create_rows(runs, &mut out);
    out
}

mod parts;

use parts::{expand_partition, layer_cost, partition_ratios, push_create_rows, scale_plans};

/// Splits the sweeper's and the size run's one line into the keyed runs the ratios read.
fn expand(raw: Raw) -> Vec<Raw> {
    let sub = |variant: &str, case: &str, m: &Value| Raw {
        part: raw.part.clone(),
        case: case.into(),
        conns: 0,
        variant: variant.into(),
        // Repeated passes (the sweeper's) are rounds of their own.
        round: raw.round.max(1),
        m: m.clone(),
    };
    match raw.part.as_str() {
        "sweeper" => {
            // Idle is the mean of the phases before and after the sweep.
            let avg = |f: &str| {
                (raw.m["idle_before"][f].as_f64().unwrap_or(f64::NAN)
                    + raw.m["idle_after"][f].as_f64().unwrap_or(f64::NAN))
                    / 2.0
            };
            let idle = json!({ "rps": avg("rps"), "p50_us": avg("p50_us"), "p99_us": avg("p99_us") });
            vec![sub("idle", "claim", &idle), sub("sweeping", "claim", &raw.m["sweeping"])]
        }
        "size" => vec![sub("raw", "", &raw.m["raw"]), sub("compressed", "", &raw.m["compressed"])],
        "partition" => expand_partition(&raw),
        _ => vec![raw],
    }
}

fn fmt(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x != 0.0 && x.abs() < 0.1 {
        format!("{x:.4}")
    } else {
        format!("{x:.2}")
    }
}

pub(crate) fn report(a: ReportArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.raw)?;
    let mut lines = Vec::new();
    let mut runs = Runs(BTreeMap::new());
    for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
        let raw: Raw = serde_json::from_str(line)?;
        lines.push(serde_json::from_str::<Value>(line)?);
        for r in expand(raw) {
            runs.0.entry(key(&r.part, &r.case, r.conns, &r.variant)).or_default().insert(r.round, r.m);
        }
    }
    let ratios = ratios(&runs);

    let mut figures = Vec::new();
    for ((part, case, conns, variant), rounds) in &runs.0 {
        let k = key(part, case, *conns, variant);
        let mut f = json!({ "part": part, "case": case, "conns": conns, "variant": variant, "rounds": rounds.len() });
        for m in [
            "rps",
            "p50_us",
            "p99_us",
            "wal_bytes_per_op",
            "errors",
            "total_bytes_per_record",
            "row_bytes",
            "stored_body_bytes",
            "completed_share",
            "instructions_per_request",
            "instructions_per_request_without_sha256",
        ] {
            let v = runs.median(&k, m);
            if v.is_finite() {
                f[m] = json!(v);
            }
        }
        figures.push(f);
    }
    std::fs::create_dir_all(&a.out)?;
    let json = json!({ "context": a.context, "ratios": ratios, "figures": figures, "raw": lines });
    std::fs::write(a.out.join("results.json"), serde_json::to_string_pretty(&json)?)?;

    let mut md = String::new();
    writeln!(
        md,
        "Benchmarks ({}). Ratios are medians of per-round ratios (A and B interleaved); [min..max] over rounds.\n",
        a.context
    )?;
    writeln!(md, "| part | comparison | metric | A | B | ratio A/B [min..max] | goal | met |")?;
    writeln!(md, "|---|---|---|---|---|---|---|---|")?;
    for r in &ratios {
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | **{}** [{}..{}] | {} | {} |",
            r.part,
            r.what,
            r.metric,
            fmt(r.a),
            fmt(r.b),
            fmt(r.ratio),
            fmt(r.ratio_min),
            fmt(r.ratio_max),
            r.goal.map(Goal::text).unwrap_or_default(),
            r.met.map(|m| if m { "yes" } else { "**no**" }).unwrap_or(""),
        )?;
    }
    writeln!(md, "\nFigures (medians over rounds; absolute numbers are for this noisy shared machine only):\n")?;
    writeln!(md, "| part | case | conns | variant | req/s | p50 ms | p99 ms | errors |")?;
    writeln!(md, "|---|---|---|---|---|---|---|---|")?;
    for f in &figures {
        let ms = |k: &str| f[k].as_f64().map(|us| fmt(us / 1000.0)).unwrap_or_else(|| "-".into());
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            f["part"].as_str().unwrap_or(""),
            f["case"].as_str().unwrap_or(""),
            f["conns"],
            f["variant"].as_str().unwrap_or(""),
            f["rps"].as_f64().map(fmt).unwrap_or_else(|| "-".into()),
            ms("p50_us"),
            ms("p99_us"),
            f["errors"].as_f64().map(fmt).unwrap_or_else(|| "-".into()),
        )?;
    }
    md.push_str(&scale_plans(&runs));
    std::fs::write(a.out.join("results.md"), &md)?;
    print!("{md}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_pair_runs_within_a_round() {
        let mut runs = Runs(BTreeMap::new());
        for (round, bare, mem) in [(1, 100.0, 90.0), (2, 50.0, 40.0), (3, 200.0, 190.0)] {
            runs.0.entry(key("layer", "first", 16, "bare")).or_default().insert(round, json!({ "rps": bare }));
            runs.0.entry(key("layer", "first", 16, "memory")).or_default().insert(round, json!({ "rps": mem }));
        }
        let r = runs
            .ratio(
                "layer",
                "x".into(),
                "rps",
                &key("layer", "first", 16, "memory"),
                &key("layer", "first", 16, "bare"),
                Some(Goal::AtLeast(0.85)),
            )
            .expect("ratio");
        assert_eq!((r.ratio, r.ratio_min, r.ratio_max, r.rounds), (0.9, 0.8, 0.95, 3));
        assert_eq!(r.met, Some(true));
        assert!(!Goal::AtMost(2.0).met(2.5));
    }

    #[test]
    fn the_partition_line_becomes_its_rows() {
        let claims = |p50: u64, p99: u64| json!({ "rps": 500.0, "p50_us": p50, "p99_us": p99 });
        let layout = |wal: f64, idle99: u64, sweep99: u64| {
            json!({
                "wal_bytes": wal, "database_wal_bytes": wal / 2.0, "sweep_seconds": 1.0,
                "idle_before": claims(1000, idle99), "idle_after": claims(3000, idle99 * 3), "sweeping": claims(0, sweep99),
            })
        };
        let line = json!({ "part": "partition", "case": "sweep", "variant": "all", "round": 1,
            "m": { "delete": layout(1e8, 10, 30), "partitioned": layout(1e4, 20, 40) } });
        let mut runs = Runs(BTreeMap::new());
        for r in expand(serde_json::from_value(line).expect("raw")) {
            runs.0.entry(key(&r.part, &r.case, r.conns, &r.variant)).or_default().insert(r.round, r.m);
        }
        let rows = partition_ratios(&runs);
        let wal = rows.iter().find(|r| r.metric == "wal_bytes").expect("WAL row");
        assert_eq!((wal.ratio, wal.met), (1e-4, Some(true)));
        let db = rows.iter().find(|r| r.metric == "database_wal_bytes").expect("database WAL row");
        assert_eq!(db.ratio, 1e-4);
        // Idle is the mean of the phases before and after: partitioned 40 / 40, delete 30 / 20.
        let p99 = |what: &str| rows.iter().find(|r| r.what == what).expect(what).ratio;
        assert_eq!(p99("partitioned: claim p99 sweeping / idle"), 1.0);
        assert_eq!(p99("delete: claim p99 sweeping / idle"), 1.5);
    }

    #[test]
    fn scale_rows_compare_each_size_with_the_smallest() {
        let mut runs = Runs(BTreeMap::new());
        for (n, p50) in [("10000000", 900.0), ("10000", 600.0), ("1000000", 700.0)] {
            runs.0.entry(key("scale", "replay", 8, n)).or_default().insert(1, json!({ "p50_us": p50, "p99_us": 1.0 }));
        }
        runs.0
            .entry(key("scale", "create", 4, "0"))
            .or_default()
            .insert(1, json!({ "p50_us": 10.0, "plan": "Seq Scan" }));
        runs.0
            .entry(key("scale", "create", 4, "99"))
            .or_default()
            .insert(1, json!({ "p50_us": 20.0, "plan": "Index" }));
        let rows = ratios(&runs);
        let find = |what: &str| rows.iter().find(|r| r.what == what).unwrap_or_else(|| panic!("no row {what:?}"));
        let r = find("replay p50: 10000000 records / 10000 records");
        assert_eq!((r.ratio, r.met), (1.5, Some(true)));
        assert_eq!(find("leasebroker create p50: 99% allocated / 0% allocated").met, Some(false));
        assert!(!rows.iter().any(|r| r.what.contains("/ 1000000")), "only the smallest size is the base");
        let plans = scale_plans(&runs);
        assert!(
            plans.contains("- PostgreSQL, 0% allocated: `Seq Scan`")
                && plans.contains("- PostgreSQL, 99% allocated: `Index`"),
            "{plans}"
        );
    }

    #[test]
    fn the_layer_is_compared_with_the_json_handler_and_by_instructions() {
        let mut runs = Runs(BTreeMap::new());
        for (variant, rps) in [("memory", 80.0), ("json", 100.0)] {
            runs.0.entry(key("layer", "replay", 64, variant)).or_default().insert(1, json!({ "rps": rps }));
        }
        for (variant, n, without) in
            [("memory", 40_000.0, 30_000.0), ("json", 25_000.0, 25_000.0), ("bare", 20_000.0, 20_000.0)]
        {
            let m = json!({ "instructions_per_request": n, "instructions_per_request_without_sha256": without });
            runs.0.entry(key("instr", "first", 4, variant)).or_default().insert(1, m);
        }
        let rows = layer_cost(&runs);
        let find = |what: &str| rows.iter().find(|r| r.what == what).unwrap_or_else(|| panic!("no row {what:?}"));
        let json = find("layer+memory / Json handler (replay, 64 conn)");
        assert_eq!((json.ratio, json.met), (0.8, Some(false)));
        assert_eq!(find("instructions/request: layer+memory / Json handler (first)").ratio, 1.6);
        assert_eq!(find("instructions/request: layer+memory / bare (first)").ratio, 2.0);
        assert_eq!(find("instructions/request without SHA-256 blocks: layer+memory / Json handler (first)").ratio, 1.2);
        // Rounds that measured nothing make no row.
        assert!(rows.iter().all(|r| !r.what.contains("(first, 16 conn)")));
    }
}
