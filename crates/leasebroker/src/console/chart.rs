//! The console's chart of request outcomes over the last hour, drawn from the service's own
//! counters: every [`SAMPLE_EVERY`] a task reads `idempotency_requests_total{outcome}` from the
//! Prometheus recorder into a bounded ring (an hour of samples), and the page draws the increase
//! per minute as stacked bars in an inline SVG.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;

/// How often the counters are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// How far back the chart goes.
pub const WINDOW: Duration = Duration::from_secs(60 * 60);

/// Samples kept: the window's worth, and one more for the increase at its start.
const KEEP: usize = (WINDOW.as_secs() / SAMPLE_EVERY.as_secs()) as usize + 1;

/// The counter sampled.
const COUNTER: &str = idempotency_tower::REQUESTS_TOTAL;

/// The totals by outcome at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// When, in seconds since the epoch.
    pub at: i64,
    /// `outcome` label -> the counter's value.
    pub totals: BTreeMap<String, u64>,
}

/// The ring of samples.
#[derive(Debug, Clone, Default)]
pub struct OutcomeHistory {
    ring: Arc<Mutex<VecDeque<Sample>>>,
}

/// Reads `idempotency_requests_total{outcome="..."}` out of Prometheus text.
pub fn totals(prometheus_text: &str) -> BTreeMap<String, u64> {
    let mut totals = BTreeMap::new();
    for line in prometheus_text.lines() {
        let Some(rest) = line.strip_prefix(COUNTER).and_then(|r| r.strip_prefix('{')) else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let Some(outcome) = labels.split(',').find_map(|l| l.strip_prefix("outcome=\"")?.strip_suffix('"')) else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        // Counters are whole numbers; the exporter prints them as floats.
        *totals.entry(outcome.to_owned()).or_insert(0) += value.max(0.0) as u64;
    }
    totals
}

impl OutcomeHistory {
    /// Adds a sample, dropping the oldest past an hour's worth.
    pub fn push(&self, sample: Sample) {
        let mut ring = self.ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if ring.len() == KEEP {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    /// The samples held, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.ring.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned().collect()
    }
}

/// Samples the outcome counters into the history, every [`SAMPLE_EVERY`] ([`crate::background`]).
#[derive(Debug)]
pub struct Sampler {
    /// Where the samples go.
    pub history: OutcomeHistory,
    /// What is sampled.
    pub metrics: PrometheusHandle,
}

impl crate::background::Pass for Sampler {
    async fn pass(&self) {
        self.history.push(Sample { at: chrono::Utc::now().timestamp(), totals: totals(&self.metrics.render()) });
    }
}

/// Increases per minute over the hour before `now`: 60 buckets, the oldest first, each the
/// increase by outcome between consecutive samples whose later end falls in that minute.
pub fn per_minute(samples: &[Sample], now: i64) -> Vec<BTreeMap<String, u64>> {
    let minutes = (WINDOW.as_secs() / 60) as usize;
    let mut buckets = vec![BTreeMap::new(); minutes];
    for pair in samples.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        let age = now.saturating_sub(after.at);
        if age < 0 || age >= WINDOW.as_secs() as i64 {
            continue;
        }
        let bucket = minutes - 1 - (age / 60) as usize;
        for (outcome, &total) in &after.totals {
            let increase = total.saturating_sub(before.totals.get(outcome).copied().unwrap_or(0));
            if increase > 0 {
                *buckets[bucket].entry(outcome.clone()).or_insert(0) += increase;
            }
        }
    }
    buckets
}

/// A colour per outcome (the known ones; others grey).
fn colour(outcome: &str) -> &'static str {
    match outcome {
        "executed" => "#2e7d32",
        "replayed" => "#1565c0",
        "mismatch" => "#c62828",
        "in_progress" => "#ef6c00",
        "missing_key" | "invalid_key" => "#6a1b9a",
        "stale_reclaimed" => "#00838f",
        "store_unavailable" => "#4e342e",
        _ => "#757575",
    }
}

/// The chart as an inline SVG: a stacked bar per minute, a legend with each outcome's total.
pub fn svg(buckets: &[BTreeMap<String, u64>]) -> String {
    const W: usize = 720;
    const H: usize = 200;
    const LEFT: usize = 48;
    const TOP: usize = 10;
    const PLOT_H: usize = 150;
    let outcomes: std::collections::BTreeSet<&str> =
        buckets.iter().flat_map(|b| b.keys().map(String::as_str)).collect();
    let max = buckets.iter().map(|b| b.values().sum::<u64>()).max().unwrap_or(0).max(1);
    let bar_w = (W - LEFT - 10) / buckets.len().max(1);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="Request outcomes per minute, last hour" viewBox="0 0 {W} {H}" width="{W}" height="{H}" class="chart">"#
    );
    let base = TOP + PLOT_H;
    let _ = write!(
        s,
        r##"<line x1="{LEFT}" y1="{base}" x2="{}" y2="{base}" stroke="#999"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" stroke="#999"/>"##,
        W - 10
    );
    let _ = write!(s, r#"<text x="{}" y="{}" font-size="11" text-anchor="end">{max}</text>"#, LEFT - 4, TOP + 10);
    let _ = write!(s, r#"<text x="{}" y="{base}" font-size="11" text-anchor="end">0</text>"#, LEFT - 4);
    for (i, bucket) in buckets.iter().enumerate() {
        let x = LEFT + 1 + i * bar_w;
        // Each segment spans from the running total below it to the one above, so the rounding
        // never stacks a bar past the top.
        let top_of = |total: u64| base - ((total as f64 / max as f64) * PLOT_H as f64).round() as usize;
        let minutes_ago = buckets.len() - 1 - i;
        let mut below = 0;
        for (outcome, &n) in bucket {
            let y = top_of(below + n);
            let h = (top_of(below) - y).max(1);
            below += n;
            let _ = write!(
                s,
                r#"<rect x="{x}" y="{y}" width="{}" height="{h}" fill="{}"><title>{} min ago: {n} {}</title></rect>"#,
                bar_w.saturating_sub(1).max(1),
                colour(outcome),
                minutes_ago,
                super::pages::E(outcome)
            );
        }
    }
    for (label, i) in [("-60 min", 0), ("-30 min", buckets.len() / 2), ("now", buckets.len().saturating_sub(1))] {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">{label}</text>"#,
            LEFT + i * bar_w + bar_w / 2,
            base + 14
        );
    }
    let mut x = LEFT;
    for outcome in &outcomes {
        let total: u64 = buckets.iter().filter_map(|b| b.get(*outcome)).sum();
        let _ = write!(
            s,
            r#"<rect x="{x}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}" font-size="11">{} ({total})</text>"#,
            H - 12,
            colour(outcome),
            x + 14,
            H - 3,
            super::pages::E(outcome)
        );
        x += 32 + 7 * (outcome.len() + total.to_string().len());
    }
    if outcomes.is_empty() {
        let _ = write!(s, r#"<text x="{}" y="{}" font-size="12">no requests in the last hour</text>"#, LEFT + 8, H - 3);
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_totals_are_read_from_prometheus_text() {
        let text = "# TYPE idempotency_requests_total counter\n\
                    idempotency_requests_total{outcome=\"executed\"} 12\n\
                    idempotency_requests_total{outcome=\"replayed\"} 3\n\
                    idempotency_requests_total_other{outcome=\"executed\"} 99\n\
                    leasebroker_http_responses_total{code=\"201\"} 12\n";
        let t = totals(text);
        assert_eq!(t.get("executed"), Some(&12));
        assert_eq!(t.get("replayed"), Some(&3));
        assert_eq!(t.len(), 2);
    }

    fn sample(at: i64, executed: u64, replayed: u64) -> Sample {
        Sample { at, totals: [("executed".to_owned(), executed), ("replayed".to_owned(), replayed)].into() }
    }

    #[test]
    fn increases_land_in_the_minute_they_happened() {
        let now = 1_000_000;
        let samples = [
            sample(now - 7200, 0, 0),   // outside the window
            sample(now - 3590, 100, 0), // the first in the window: the increase from 0
            sample(now - 125, 100, 0),  // no change
            sample(now - 115, 130, 2),  // 30 executed, 2 replayed, 1m55s ago
            sample(now - 5, 131, 2),    // 1 executed in the last minute
        ];
        let b = per_minute(&samples, now);
        assert_eq!(b.len(), 60);
        assert_eq!(b[0].get("executed"), Some(&100));
        assert_eq!(b[58].get("executed"), Some(&30));
        assert_eq!(b[58].get("replayed"), Some(&2));
        assert_eq!(b[59].get("executed"), Some(&1));
        assert_eq!(b.iter().map(|m| m.values().sum::<u64>()).sum::<u64>(), 133);
    }

    #[test]
    fn the_ring_holds_an_hour() {
        let h = OutcomeHistory::default();
        for i in 0..KEEP as i64 + 20 {
            h.push(sample(i, 0, 0));
        }
        assert_eq!(h.samples().len(), KEEP);
        assert_eq!(h.samples()[0].at, 20);
    }

    #[test]
    fn the_svg_has_a_bar_per_outcome_minute_and_escapes_labels() {
        let mut b = vec![BTreeMap::new(); 60];
        b[59].insert("executed".to_owned(), 5);
        b[59].insert("<script>".to_owned(), 1);
        let drawn = svg(&b);
        assert!(drawn.starts_with("<svg") && drawn.ends_with("</svg>"));
        assert_eq!(drawn.matches("<rect x=").count(), 2 + 2, "two bars and two legend keys");
        assert!(!drawn.contains("<script>") && drawn.contains("&lt;script&gt;"));
        assert!(svg(&vec![BTreeMap::new(); 60]).contains("no requests in the last hour"));
        // Segments that round up never stack past the top of the plot (y = 10).
        let mut b = vec![BTreeMap::new(); 60];
        for (outcome, n) in [("executed", 7), ("mismatch", 1), ("replayed", 1)] {
            b[59].insert(outcome.to_owned(), n);
        }
        let ys: Vec<usize> =
            regex::Regex::new(r#"<rect x="\d+" y="(\d+)" width="\d+" height="\d+" fill="[^"]+"><title>"#)
                .expect("regex")
                .captures_iter(&svg(&b))
                .map(|c| c[1].parse().expect("y"))
                .collect();
        assert_eq!(ys.len(), 3);
        assert_eq!(ys.iter().min(), Some(&10), "the tallest bar reaches the top exactly: {ys:?}");
    }
}
