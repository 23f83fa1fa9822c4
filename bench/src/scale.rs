//! Cost as data grows (`bench/run scale`): the PostgreSQL store's table grown to 10^4 .. 10^7
//! completed records with set-based SQL, and the plot of what the part measured.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use bytes::Bytes;
use clap::Args;
use idempotency::{StoredBody, StoredResponse};
use idempotency_sqlx::PostgresStore;
use plotters::prelude::*;
use serde_json::{Value, json};

/// A create's answer as leasebroker sends it: a small worker, stored raw (below the layer's
/// compression threshold), with its `Location`.
const BODY: &str = r#"{"id":"wkr-3f9c2a7d1e5b8c04","owner":"team-a","image":"worker-base","cpu":1,"memory_gb":1,"state":"running","node":"node-0417","labels":{},"reboot_count":0,"created_at":"2026-11-30T22:14:07.123456Z"}"#;

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/v1/workers/wkr-3f9c2a7d1e5b8c04".into()),
        ],
        body: StoredBody::encode(Bytes::from_static(BODY.as_bytes()), usize::MAX),
    }
}

#[derive(Debug, Args)]
pub(crate) struct FillArgs {
    #[arg(long)]
    database: String,
    /// Keys `r-{from}` .. already exist (a smaller size of the same table).
    #[arg(long, default_value_t = 0)]
    from: u32,
    /// Grows the table to keys `r-0` .. `r-{records-1}`, the keys `pg-store --op replay` picks.
    #[arg(long)]
    records: u32,
    /// Records per statement (one transaction each), with a progress line after each.
    #[arg(long, default_value_t = 1_000_000)]
    chunk: u32,
}

/// Adds the completed records `r-{from}` .. `r-{records-1}` in the store's row format, then
/// `VACUUM (ANALYZE)` and `CHECKPOINT`, as an operator would after a bulk load. Expiries are
/// spread over the next 1 to 24 hours (records made over the last 23 hours; none expires while
/// it is measured, which would turn a replay into a first execution), ids and fingerprints are
/// hashes, as the store writes them.
pub(crate) async fn fill(a: FillArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.from <= a.records, "--from {} is above --records {}", a.from, a.records);
    anyhow::ensure!(a.chunk > 0, "--chunk must be at least 1");
    let pool = idempotency_sqlx::postgres_pool_options(1).connect(&a.database).await?;
    let store = PostgresStore::from_pool(pool.clone());
    store.migrate().await?;
    let r = response();
    let t = Instant::now();
    let mut added = 0u64;
    let mut at = a.from;
    while at < a.records {
        let to = a.records.min(at.saturating_add(a.chunk));
        let done = sqlx::query(
            "INSERT INTO idempotency_records (principal, endpoint, key, record_id, fingerprint, state, generation, \
               response_status, response_headers, response_body, response_encoding, created_at, started_at, expires_at) \
             SELECT 'bench', 'POST /v1/workers', k, decode(md5(k), 'hex'), \
               'sha256:' || encode(sha256(convert_to(k, 'UTF8')), 'hex'), 'completed', 1, $1, $2, $3, $4, \
               now() - (86400 - o) * interval '1 second', now() - (86400 - o) * interval '1 second', \
               now() + o * interval '1 second' \
             FROM generate_series($5::bigint, $6::bigint - 1) AS g, \
               LATERAL (SELECT 'r-' || g AS k, 3600 + (g * 7919) % 82800 AS o) AS x \
             ON CONFLICT DO NOTHING",
        )
        .bind(i32::from(r.status))
        .bind(r.headers_json())
        .bind(r.body.stored_bytes().as_ref())
        .bind(r.body.encoding().as_str())
        .bind(i64::from(at))
        .bind(i64::from(to))
        .execute(&pool)
        .await?;
        added += done.rows_affected();
        at = to;
        eprintln!(
            "[{}] scale-fill: {at} of {} records ({:.0}s)",
            chrono::Utc::now().format("%H:%M:%S"),
            a.records,
            t.elapsed().as_secs_f64()
        );
    }
    let fill_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    sqlx::raw_sql("VACUUM (ANALYZE) idempotency_records").execute(&pool).await?;
    sqlx::raw_sql("CHECKPOINT").execute(&pool).await?;
    let (rows, heap, index): (i64, i64, i64) = sqlx::query_as(
        "SELECT reltuples::bigint, pg_table_size('idempotency_records'), pg_indexes_size('idempotency_records') \
         FROM pg_class WHERE relname = 'idempotency_records'",
    )
    .fetch_one(&pool)
    .await?;
    println!(
        "{}",
        json!({
            "records": a.records, "added": added, "fill_seconds": fill_seconds,
            "vacuum_seconds": t.elapsed().as_secs_f64(), "rows_estimate": rows,
            "table_bytes": heap, "index_bytes": index,
        })
    );
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct PlotArgs {
    /// The raw measurements `bench/run` wrote.
    #[arg(long, default_value = "bench/out/raw.jsonl")]
    raw: PathBuf,
    #[arg(long, default_value = "docs/bench/scale.svg")]
    out: PathBuf,
    /// A line about the machine and date, for the title.
    #[arg(long, default_value = "")]
    context: String,
}

/// Median p50 and p99 (milliseconds) per case and x (the variant, a number), over rounds.
type Series = BTreeMap<String, Vec<(f64, f64, f64)>>;

fn series(text: &str) -> anyhow::Result<Series> {
    let mut runs: BTreeMap<(String, u64), Vec<(f64, f64)>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: Value = serde_json::from_str(line)?;
        if v["part"] != "scale" {
            continue;
        }
        let (Some(case), Some(x)) = (v["case"].as_str(), v["variant"].as_str().and_then(|s| s.parse::<u64>().ok()))
        else {
            continue;
        };
        if let (Some(p50), Some(p99)) = (v["m"]["p50_us"].as_f64(), v["m"]["p99_us"].as_f64()) {
            runs.entry((case.to_owned(), x)).or_default().push((p50 / 1000.0, p99 / 1000.0));
        }
    }
    let mut out = Series::new();
    for ((case, x), v) in runs {
        let p50 = crate::report::median(v.iter().map(|p| p.0).collect());
        let p99 = crate::report::median(v.iter().map(|p| p.1).collect());
        out.entry(case).or_default().push((x as f64, p50, p99));
    }
    Ok(out)
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// Two panels: store latency against records held (log x), for replays and first executions;
/// leasebroker create latency against the share of the pool allocated.
pub(crate) fn plot(a: PlotArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.raw).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", a.raw.display()))?;
    let s = series(&text)?;
    anyhow::ensure!(
        ["replay", "first", "create", "create-sqlite"].iter().any(|c| s.contains_key(*c)),
        "{} holds no scale rows: run `bench/run scale` first",
        a.raw.display()
    );
    let ymax = |cases: &[&str]| {
        cases.iter().flat_map(|c| s.get(*c).into_iter().flatten()).map(|p| p.2).fold(0.0_f64, f64::max).max(1.0) * 1.15
    };
    let ymin = |cases: &[&str]| {
        cases.iter().flat_map(|c| s.get(*c).into_iter().flatten()).map(|p| p.1).fold(f64::INFINITY, f64::min).min(1.0)
            / 1.5
    };
    if let Some(dir) = a.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(&a.out, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let title = if a.context.is_empty() {
        "Cost as data grows".to_owned()
    } else {
        format!("Cost as data grows ({})", a.context)
    };
    let root = root.titled(&title, ("sans-serif", 16)).map_err(err)?;
    let (left, right) = root.split_horizontally(600);

    let mut chart = ChartBuilder::on(&left)
        .caption("PostgreSQL store: latency vs records held", ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        // Log on both axes: replays take a fraction of a millisecond, first executions' p99 tens.
        .build_cartesian_2d(
            (5e3_f64..2e7_f64).log_scale(),
            (ymin(&["replay", "first"])..ymax(&["replay", "first"])).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("records in the table")
        .y_desc("latency (ms, log scale)")
        .x_label_formatter(&|x| format!("{x:.0e}"))
        .draw()
        .map_err(err)?;
    lines(&mut chart, &s, &[("replay", "replay", BLUE), ("first", "first execution", RED)])?;

    let mut chart = ChartBuilder::on(&right)
        .caption("leasebroker create: latency vs pool allocated", ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        // Log latency here too: p50 in tens of milliseconds, SQLite's p99 in seconds.
        .build_cartesian_2d(
            -5.0_f64..105.0,
            (ymin(&["create", "create-sqlite"])..ymax(&["create", "create-sqlite"])).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("% of 100,000 nodes allocated")
        .y_desc("latency (ms, log scale)")
        .draw()
        .map_err(err)?;
    lines(&mut chart, &s, &[("create", "create (PostgreSQL)", GREEN), ("create-sqlite", "create (SQLite)", MAGENTA)])?;
    root.present().map_err(err)?;
    println!("{}", json!({ "wrote": a.out }));
    Ok(())
}

type Chart<'a, X, Y> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>;

/// p50 solid, p99 lighter, with markers, per case.
fn lines<X, Y>(chart: &mut Chart<'_, X, Y>, s: &Series, cases: &[(&str, &str, RGBColor)]) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for &(case, name, color) in cases {
        let Some(points) = s.get(case) else { continue };
        for (which, pick, style) in [
            ("p50", (|p: &(f64, f64, f64)| p.1) as fn(&(f64, f64, f64)) -> f64, color.stroke_width(3)),
            ("p99", |p: &(f64, f64, f64)| p.2, color.mix(0.45).stroke_width(2)),
        ] {
            let pts: Vec<(f64, f64)> = points.iter().map(|p| (p.0, pick(p))).collect();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), style))
                .map_err(err)?
                .label(format!("{name} {which}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, style.filled()))).map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_takes_medians_per_case_and_size() {
        let raw = [
            r#"{"part":"scale","case":"replay","conns":8,"variant":"10000","round":1,"m":{"p50_us":1000,"p99_us":3000}}"#,
            r#"{"part":"scale","case":"replay","conns":8,"variant":"10000","round":2,"m":{"p50_us":3000,"p99_us":5000}}"#,
            r#"{"part":"scale","case":"fill","conns":0,"variant":"10000","round":1,"m":{"records":10000}}"#,
            r#"{"part":"layer","case":"replay","conns":8,"variant":"bare","round":1,"m":{"p50_us":1,"p99_us":2}}"#,
        ]
        .join("\n");
        let s = series(&raw).expect("parse");
        assert_eq!(s.len(), 1);
        assert_eq!(s["replay"], vec![(10000.0, 2.0, 4.0)]);
    }

    #[test]
    fn plot_writes_an_svg_with_both_panels() {
        let dir = tempfile::tempdir().expect("tempdir");
        let raw = dir.path().join("raw.jsonl");
        let mut lines = Vec::new();
        for (case, x) in [("replay", 10_000), ("replay", 10_000_000), ("first", 10_000), ("create", 99)] {
            lines.push(format!(
                r#"{{"part":"scale","case":"{case}","conns":8,"variant":"{x}","round":1,"m":{{"p50_us":1500,"p99_us":4000}}}}"#
            ));
        }
        std::fs::write(&raw, lines.join("\n")).expect("write");
        let out = dir.path().join("scale.svg");
        plot(PlotArgs { raw, out: out.clone(), context: "test".into() }).expect("plot");
        let svg = std::fs::read_to_string(out).expect("svg");
        assert!(svg.contains("<svg") && svg.contains("replay p50") && svg.contains("create (PostgreSQL) p99"));
    }

    #[test]
    fn plot_without_scale_rows_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let raw = dir.path().join("raw.jsonl");
        std::fs::write(&raw, "").expect("write");
        let e = plot(PlotArgs { raw, out: dir.path().join("s.svg"), context: String::new() }).expect_err("no rows");
        assert!(e.to_string().contains("no scale rows"), "{e}");
    }
}
