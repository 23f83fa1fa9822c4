//! One run: start the processes, drive the workload through the proxies while killing replicas,
//! let everything settle, read the ground truth, check, stop everything.

mod binaries;
mod chaos;
mod drive;
mod failover;
mod progress;

use std::sync::Arc;

use anyhow::{Context, anyhow};
use serde::Serialize;
use tokio::sync::Mutex;

use crate::cli::{Cli, Command, Scenario};
use crate::pg::{LocalCluster, TempDatabase};
use crate::report::{self, RunReport};
use crate::workload::ClientKind;
use binaries::Binaries;
use drive::{OwnServers, run_in};

/// The JSON file written by `run` and `sweep`.
#[derive(Debug, Serialize)]
struct ReportFile<'a> {
    command: &'static str,
    runs: &'a [RunReport],
    /// True when every protected run held every invariant.
    protected_passed: bool,
}

/// Runs the command. `Ok(false)` when a protected run broke an invariant.
pub async fn main(cli: Cli) -> anyhow::Result<bool> {
    let (command, scenario, plan): (&'static str, Scenario, Vec<(f64, Vec<ClientKind>)>) = match cli.command {
        Command::Run(args) if args.gateway => return crate::gateway::main(args).await,
        Command::Run(args) => {
            let kinds = args.clients();
            ("run", args.scenario, vec![(args.client_faults, kinds)])
        }
        Command::Sweep(args) => (
            "sweep",
            args.scenario,
            args.rates.iter().map(|&r| (r, vec![ClientKind::Protected, ClientKind::Naive])).collect(),
        ),
    };
    scenario.check_modes().map_err(|e| anyhow!(e))?;
    let binaries = Binaries::locate(&scenario)?;
    if scenario.libvirt.is_some() && !binaries.serve_has("--libvirt-images") {
        anyhow::bail!(
            "--libvirt: {} has no libvirt backend (build it with its libvirt feature: cargo build -p leasebroker --features libvirt)",
            binaries.leasebroker.display()
        );
    }
    std::fs::create_dir_all(&scenario.out).with_context(|| format!("creating {}", scenario.out.display()))?;
    let mut runs = Vec::new();
    for (rate, kinds) in plan {
        for kind in kinds {
            eprintln!("faultline: {} clients, client fault rate {rate}", kind.name());
            let report = run_one(&scenario, &binaries, rate, kind).await?;
            if !report.passed && kind == ClientKind::Protected {
                eprintln!(
                    "faultline: PROTECTED RUN BROKE AN INVARIANT:\n{}",
                    report::broken(std::slice::from_ref(&report))
                );
            }
            runs.push(report);
        }
    }
    let protected_passed = runs.iter().filter(|r| r.clients == ClientKind::Protected).all(|r| r.passed);
    println!("{}", report::table(&runs));
    let gave_up = report::gave_up(&runs);
    if !gave_up.is_empty() {
        println!("operations that gave up, attempt by attempt, and their reruns:\n{gave_up}");
    }
    let broken = report::broken(&runs);
    if !broken.is_empty() {
        println!("broken invariants:\n{broken}");
    }
    let json = scenario.out.join(format!("{command}.json"));
    report::write_json(&json, &ReportFile { command, runs: &runs, protected_passed })?;
    let svg = scenario.out.join(format!("{command}.svg"));
    report::chart(&svg, &runs)?;
    println!("report: {}\nchart:  {}", json.display(), svg.display());
    Ok(protected_passed)
}

/// One run with fresh processes and a fresh database; everything it started is stopped and the
/// database dropped, also on error or Ctrl-C.
async fn run_one(scenario: &Scenario, binaries: &Binaries, rate: f64, kind: ClientKind) -> anyhow::Result<RunReport> {
    let temp = tempfile::Builder::new().prefix("faultline-").tempdir().context("temporary directory")?;
    // The libvirt host's domains of this run, watched from before anything else starts (nothing to undo if it fails).
    let libvirt = match &scenario.libvirt {
        Some(uri) => Some(Arc::new(crate::libvirt::Libvirt::start(uri, &scenario.libvirt_dir).await?)),
        None => None,
    };
    // A run that restarts the database gets a cluster of its own: never restart a shared server.
    let own = if scenario.postgres_restarts > 0 {
        Some(LocalCluster::start().await.context("starting a PostgreSQL cluster of faultline's own")?)
    } else {
        None
    };
    // A run on an HA PostgreSQL gets one of its own too (failed over by the run, removed after).
    let ha = if scenario.postgres_ha {
        let replication = scenario.postgres_replication.of_cluster();
        let ha = tokio::task::spawn_blocking(move || idempotency_sqlx::testing::ha::HaPostgres::start(replication))
            .await
            .context("starting the HA PostgreSQL")?
            .map_err(|e| anyhow!("starting the HA PostgreSQL (Patroni, etcd, HAProxy): {e}"))?;
        Some(ha)
    } else {
        None
    };
    let server = own
        .as_ref()
        .map(|c| c.url.clone())
        .or_else(|| ha.as_ref().map(|h| h.url()))
        .or_else(|| scenario.postgres.clone());
    let ha = ha.map(|h| Arc::new(std::sync::Mutex::new(h)));
    let database = match &server {
        Some(url) => Some(TempDatabase::create(url).await?),
        None => None,
    };
    let own = own.map(|c| Arc::new(Mutex::new(c)));
    let url: idempotency_sqlx::DatabaseUrl = match &database {
        Some(db) => db.url.clone(),
        None => format!("sqlite://{}", temp.path().join("leasebroker.db").display()),
    }
    .parse()?;
    // Dropping the run's future (Ctrl-C, time limit) kills its processes (kill_on_drop) and aborts
    // its tasks; the database is dropped below either way.
    let result = tokio::select! {
        r = tokio::time::timeout(scenario.max_duration, run_in(scenario, binaries, rate, kind, temp.path(), &url, OwnServers { restarted: own.clone(), ha: ha.clone(), libvirt: libvirt.clone() })) => {
            r.unwrap_or_else(|_| Err(anyhow!("the run took longer than --max-duration {:?}", scenario.max_duration)))
        }
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    // Every domain the run made goes, whatever the run's outcome (the servers are stopped: the
    // run's future is done).
    if let Some(libvirt) = &libvirt {
        match libvirt.clean_up().await {
            Ok(n) => eprintln!("faultline: destroyed and undefined the run's {n} libvirt domain(s)"),
            Err(e) => eprintln!("faultline: warning: cleaning up the libvirt domains: {e:#}"),
        }
    }
    if let Some(db) = database
        && let Err(e) = db.drop_now().await
    {
        eprintln!("faultline: warning: {e:#}");
    }
    // The cluster of our own is stopped and removed when its last handle goes (run_in's are gone).
    drop(own);
    if let Some(ha) = ha {
        // Killing it waits for its processes: on a blocking thread.
        let _ = tokio::task::spawn_blocking(move || drop(ha)).await;
    }
    if scenario.keep_temp {
        eprintln!("faultline: kept {}", temp.keep().display());
    }
    result
}
