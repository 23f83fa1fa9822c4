//! The progress bar of a run and its status line.

use std::sync::atomic::Ordering;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::Mutex;

use crate::cli::Scenario;
use crate::cluster::Replica;
use crate::proxy::{Proxy, ProxyCounts};
use crate::workload::{ClientKind, Workload};

pub(super) fn progress_bar(sc: &Scenario, kind: ClientKind, rate: f64) -> ProgressBar {
    let bar = ProgressBar::new(sc.ops);
    if sc.no_progress {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    let template = format!("{} @{rate} [{{elapsed_precise}}] {{wide_bar}} {{pos}}/{{len}} ops  {{msg}}", kind.name());
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}

pub(super) async fn status(workload: &Workload, proxies: &[Proxy], replicas: &Mutex<Vec<Replica>>) -> String {
    let proxy = proxies.iter().map(|p| p.stats.snapshot()).fold(ProxyCounts::default(), |a, b| a + b);
    let killed = workload.counters.lbctl_kills.load(Ordering::Relaxed);
    let faults = proxy.never_reached + proxy.response_lost + proxy.gave_up_mid_flight + killed;
    let kills: u32 = match replicas.try_lock() {
        Ok(r) => r.iter().map(|r| r.restarts).sum(),
        Err(_) => return format!("faults {faults}  (restarting a replica)"),
    };
    format!(
        "faults {faults} (a {} b {} c {} d {killed})  server kills {kills}  failed {}",
        proxy.never_reached,
        proxy.response_lost,
        proxy.gave_up_mid_flight,
        workload.counters.failed.load(Ordering::Relaxed)
    )
}
