//! The binaries a run starts, and the `serve` flags the server at hand has.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};

use crate::cli::Scenario;

/// The binaries a run starts.
#[derive(Debug, Clone)]
pub(super) struct Binaries {
    pub(super) leasebroker: PathBuf,
    pub(super) lbctl: PathBuf,
    /// `leasebroker serve --help`: which flags this server has.
    serve_help: String,
}

impl Binaries {
    pub(super) fn locate(scenario: &Scenario) -> anyhow::Result<Self> {
        let leasebroker = match &scenario.leasebroker {
            Some(path) => path.clone(),
            None => {
                let exe = std::env::current_exe().context("locating this executable")?;
                exe.parent().ok_or_else(|| anyhow!("no directory for {}", exe.display()))?.join("leasebroker")
            }
        };
        let lbctl = match &scenario.lbctl {
            Some(path) => path.clone(),
            None => leasebroker.with_file_name("lbctl"),
        };
        for path in [&leasebroker, &lbctl] {
            if !path.is_file() {
                bail!(
                    "{} not found (build it: cargo build -p leasebroker -p lbctl, or pass --leasebroker/--lbctl)",
                    path.display()
                );
            }
        }
        let help = std::process::Command::new(&leasebroker)
            .args(["serve", "--help"])
            .output()
            .with_context(|| format!("running {} serve --help", leasebroker.display()))?;
        let serve_help = String::from_utf8_lossy(&help.stdout).into_owned();
        Ok(Binaries { leasebroker, lbctl, serve_help })
    }

    pub(super) fn serve_has(&self, flag: &str) -> bool {
        self.serve_help.contains(flag)
    }
}

/// The `serve` flags for the settle window and the reaper, those the server has, and the settle
/// window passed (if any). Asking explicitly for a flag the server lacks is an error; the modes
/// that need one run without it (and their invariants show what that costs).
pub(super) fn serve_extra(
    sc: &Scenario,
    bin: &Binaries,
) -> anyhow::Result<(Vec<String>, Option<Duration>, Option<Duration>)> {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut extra = Vec::new();
    // The workload is the harness's own load, not a tenant's: the per-principal limits a server
    // has (a rate limit on by default since issue 25) are switched off.
    for flag in ["--rate-limit", "--max-records-per-principal"] {
        if bin.serve_has(flag) {
            extra.extend([flag.to_owned(), "0".to_owned()]);
        }
    }
    let settle = if bin.serve_has("--hypervisor-settle") {
        // The longest a sent call may take to land, with a margin for a busy machine.
        let longest = Duration::from_millis(sc.hv_latency_ms + if sc.hv_slow > 0.0 { sc.hv_slow_ms } else { 0 });
        let settle = sc
            .hypervisor_settle
            .unwrap_or_else(|| (longest + Duration::from_secs(2)).max(sc.hypervisor_timeout + Duration::from_secs(2)));
        extra.extend(["--hypervisor-settle".to_owned(), ms(settle)]);
        Some(settle)
    } else if sc.hypervisor_settle.is_some() {
        bail!("--hypervisor-settle: {} serve has no such flag", bin.leasebroker.display());
    } else {
        if sc.hv_slow > 0.0 {
            eprintln!("faultline: warning: the server has no --hypervisor-settle; slow calls may land twice");
        }
        None
    };
    // The reaper's tick runs the rollbacks and the inventory sweep (late landings, orphans).
    if sc.abandon > 0.0 || sc.late_landings > 0.0 || sc.plant_orphans > 0 {
        extra.extend(["--sweep-interval".to_owned(), ms(sc.sweep_interval)]);
    }
    let abandon_after = if sc.abandon > 0.0 {
        if bin.serve_has("--abandon-after") {
            extra.extend(["--abandon-after".to_owned(), ms(sc.abandon_after)]);
            Some(sc.abandon_after)
        } else {
            eprintln!("faultline: warning: the server has no --abandon-after; abandoned operations stay held");
            None
        }
    } else {
        None
    };
    Ok((extra, settle, abandon_after))
}
