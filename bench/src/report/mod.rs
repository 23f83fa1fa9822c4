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

mod parts;
mod ratios;

use parts::{expand_partition, scale_plans};
use ratios::ratios;

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
        self.compare(part, what, metric, (a, metric), (b, metric), goal)
    }

    /// Metric `ma` of run `a` / metric `mb` of run `b`, per round of `a` that measured both: a
    /// ratio row labelled `metric`.
    fn compare(
        &self,
        part: &'static str,
        what: String,
        metric: &'static str,
        (a, ma): (&Key, &str),
        (b, mb): (&Key, &str),
        goal: Option<Goal>,
    ) -> Option<Ratio> {
        let per: Vec<f64> = self
            .0
            .get(a)?
            .keys()
            .filter_map(|&r| Some(self.metric(a, r, ma)? / self.metric(b, r, mb)?))
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
            a: self.median(a, ma),
            b: self.median(b, mb),
            ratio,
            ratio_min: per.iter().copied().fold(f64::INFINITY, f64::min),
            ratio_max: per.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            rounds: per.len(),
            goal,
            met: goal.map(|g| g.met(ratio)),
        })
    }
}

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
    use super::parts::partition_ratios;
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
        let off_peak = json!({
            "idle_before": claims(1000, 20), "idle_after": claims(1000, 20), "sweeping": claims(0, 30),
            "dropping": claims(0, 200),
        });
        let line = json!({ "part": "partition", "case": "sweep", "variant": "all", "round": 1,
            "m": { "delete": layout(1e8, 10, 30), "partitioned": layout(1e4, 20, 40), "off-peak": off_peak } });
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
        let deferred =
            "partitioned, drop in an off-peak window: claim p99 while the day ends (detached, drop deferred) / idle";
        assert_eq!(p99(deferred), 1.5);
        assert_eq!(
            p99("partitioned, drop in an off-peak window: claim p99 during the drop, in its window / idle"),
            10.0
        );
    }
}
