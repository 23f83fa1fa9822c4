//! A closed-loop load driver: N tasks run one operation back to back for a fixed time.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Stats {
    /// Operations that returned what was expected.
    pub ops: u64,
    /// Operations that failed or returned something unexpected.
    pub errors: u64,
    /// Measured wall time, seconds.
    pub seconds: f64,
    /// `ops / seconds`.
    pub rps: f64,
    pub p50_us: u64,
    pub p99_us: u64,
}

/// Latency percentile of sorted microsecond samples (nearest rank).
pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs `op(task, i)` from `concurrency` tasks, back to back, for `duration`; `op` returns
/// `Ok(true)` for an expected outcome. Only operations that start before the deadline count.
pub(crate) async fn run<F, Fut>(concurrency: usize, duration: Duration, op: F) -> Stats
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<bool>> + Send + 'static,
{
    run_until(concurrency, duration, Duration::ZERO, Arc::new(AtomicBool::new(false)), op).await
}

/// Like [`run`], with a `pace` pause after each operation (not timed), and stopping early
/// once `stop` is set.
pub(crate) async fn run_until<F, Fut>(
    concurrency: usize,
    max: Duration,
    pace: Duration,
    stop: Arc<AtomicBool>,
    op: F,
) -> Stats
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<bool>> + Send + 'static,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + max;
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let (op, stop) = (op.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut lat, mut errors, mut i) = (Vec::with_capacity(16 * 1024), 0u64, 0u64);
                while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    match op(task, i).await {
                        Ok(true) => lat.push(t.elapsed().as_micros() as u64),
                        Ok(false) | Err(_) => errors += 1,
                    }
                    i += 1;
                    if !pace.is_zero() {
                        tokio::time::sleep(pace).await;
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let (mut lat, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await.expect("load task panicked");
        lat.extend(l);
        errors += e;
    }
    let seconds = start.elapsed().as_secs_f64();
    lat.sort_unstable();
    Stats {
        ops: lat.len() as u64,
        errors,
        seconds,
        rps: lat.len() as f64 / seconds,
        p50_us: percentile(&lat, 50.0),
        p99_us: percentile(&lat, 99.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!((percentile(&v, 50.0), percentile(&v, 99.0), percentile(&v, 100.0)), (50, 99, 100));
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }
}
