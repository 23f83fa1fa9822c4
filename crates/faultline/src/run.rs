//! One run: start the processes, drive the workload through the proxies while killing replicas,
//! let everything settle, read the ground truth, check, stop everything.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::Rng;
use serde::Serialize;
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cli::{Cli, Command, Scenario};
use crate::cluster::{self, Hypervisor, Replica, ServeConfig};
use crate::pg::TempDatabase;
use crate::proxy::{FaultPlan, Proxy, ProxyCounts};
use crate::report::{self, Faults, Outcomes, RunReport, Setup};
use crate::verify::{self, Reader};
use crate::workload::{ClientKind, Workload, WorkloadConfig};

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
        Command::Run(args) => {
            let kinds = if args.naive {
                vec![ClientKind::Naive]
            } else if args.no_naive {
                vec![ClientKind::Protected]
            } else {
                vec![ClientKind::Protected, ClientKind::Naive]
            };
            ("run", args.scenario, vec![(args.client_faults, kinds)])
        }
        Command::Sweep(args) => (
            "sweep",
            args.scenario,
            args.rates.iter().map(|&r| (r, vec![ClientKind::Protected, ClientKind::Naive])).collect(),
        ),
    };
    let binaries = Binaries::locate(&scenario)?;
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

/// The binaries a run starts.
#[derive(Debug, Clone)]
struct Binaries {
    leasebroker: PathBuf,
    lbctl: PathBuf,
}

impl Binaries {
    fn locate(scenario: &Scenario) -> anyhow::Result<Self> {
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
        Ok(Binaries { leasebroker, lbctl })
    }
}

/// One run with fresh processes and a fresh database; everything it started is stopped and the
/// database dropped, also on error or Ctrl-C.
async fn run_one(scenario: &Scenario, binaries: &Binaries, rate: f64, kind: ClientKind) -> anyhow::Result<RunReport> {
    let temp = tempfile::Builder::new().prefix("faultline-").tempdir().context("temporary directory")?;
    let database = match &scenario.postgres {
        Some(url) => Some(TempDatabase::create(url).await?),
        None => None,
    };
    let url = match &database {
        Some(db) => db.url.clone(),
        None => format!("sqlite://{}", temp.path().join("leasebroker.db").display()),
    };
    // Dropping the run's future (Ctrl-C, time limit) kills its processes (kill_on_drop) and aborts
    // its tasks; the database is dropped below either way.
    let result = tokio::select! {
        r = tokio::time::timeout(scenario.max_duration, run_in(scenario, binaries, rate, kind, temp.path(), &url)) => {
            r.unwrap_or_else(|_| Err(anyhow!("the run took longer than --max-duration {:?}", scenario.max_duration)))
        }
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    if let Some(db) = database
        && let Err(e) = db.drop_now().await
    {
        eprintln!("faultline: warning: {e:#}");
    }
    if scenario.keep_temp {
        eprintln!("faultline: kept {}", temp.keep().display());
    }
    result
}

async fn run_in(
    sc: &Scenario,
    bin: &Binaries,
    rate: f64,
    kind: ClientKind,
    dir: &Path,
    database: &str,
) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    let replicas_n = if sc.postgres.is_some() { sc.replicas } else { 1 };
    let pool_nodes =
        sc.pool_nodes.unwrap_or_else(|| u32::try_from(sc.ops.saturating_mul(2) + 64).unwrap_or(100_000).min(100_000));
    let principals = cluster::principals(sc.principals);

    let hypervisor =
        Hypervisor::start(&bin.leasebroker, dir, sc.hv_fail_before, sc.hv_fail_after, sc.hv_latency_ms).await?;
    let config = ServeConfig {
        binary: bin.leasebroker.clone(),
        database: database.to_owned(),
        principals: principals.clone(),
        pool_nodes,
        hypervisor_url: hypervisor.url.clone(),
        hypervisor_timeout: sc.hypervisor_timeout,
        in_flight_ttl: sc.in_flight_ttl,
        dir: dir.to_path_buf(),
    };
    let ports = (0..replicas_n).map(|_| cluster::free_port()).collect::<anyhow::Result<Vec<_>>>()?;
    let mut replicas = Vec::new();
    // One after the other: the first migrates and seeds the database.
    for (i, port) in ports.iter().enumerate() {
        replicas.push(Replica::start(i, *port, config.clone()).await?);
    }
    let plan = FaultPlan { rate, attempt_timeout: sc.attempt_timeout };
    let mut proxies = Vec::new();
    for r in &replicas {
        proxies.push(Proxy::start(r.addr, plan).await?);
    }
    let direct: Vec<String> = replicas.iter().map(Replica::url).collect();
    let reader = Reader::new(direct, hypervisor.url.clone(), principals.clone())?;

    let workload = Arc::new(Workload::new(WorkloadConfig {
        kind,
        principals: principals.clone(),
        endpoints: proxies.iter().map(Proxy::url).collect(),
        kill_rate: rate,
        lbctl_share: sc.lbctl_share,
        lbctl: bin.lbctl.clone(),
        journal: dir.join("lbctl-journal.db"),
        attempt_timeout: sc.attempt_timeout,
        op_max_elapsed: sc.op_max_elapsed,
        run_tag: format!("{}-{rate}", kind.name()),
    })?);
    let proxies = Arc::new(proxies);
    let replicas = Arc::new(Mutex::new(replicas));

    let progress = progress_bar(sc, kind, rate);
    let workload_start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut clients = JoinSet::new();
    for _ in 0..sc.concurrency {
        let (workload, next, progress, ops) = (workload.clone(), next.clone(), progress.clone(), sc.ops);
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ops {
                    break;
                }
                workload.run_op(i).await;
                progress.inc(1);
            }
        });
    }
    let mut killer = JoinSet::new();
    killer.spawn(kill_replicas(sc.server_kills, sc.ops, workload.clone(), replicas.clone(), proxies.clone()));
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let mut kills_done = 0;
    let kill_error = loop {
        tokio::select! {
            joined = clients.join_next() => match joined {
                Some(r) => r.context("a client task panicked")?,
                None => break None,
            },
            Some(joined) = killer.join_next() => match joined.context("the killer task panicked")? {
                Ok(n) => kills_done = n,
                Err(e) => break Some(e),
            },
            _ = ticker.tick() => progress.set_message(status(&workload, &proxies, &replicas).await),
        }
    };
    if let Some(e) = kill_error {
        return Err(e.context("killing and restarting a replica"));
    }
    // Every client is done; a kill still pending (ops finished before its milestone) is not made.
    killer.abort_all();
    while let Some(joined) = killer.join_next().await {
        if let Ok(Ok(n)) = joined {
            kills_done = n;
        }
    }
    let kills_done = kills_done.max(replicas.lock().await.iter().map(|r| r.restarts).sum());
    let workload_secs = workload_start.elapsed().as_secs_f64();
    progress.finish_and_clear();

    for p in proxies.iter() {
        p.set_faults(false);
    }
    // Let cut-off handlers finish and stale in-flight records age out before reading the truth.
    let quiet = sc.in_flight_ttl + sc.hypervisor_timeout + Duration::from_secs(1);
    reader.settle(quiet, Duration::from_secs(30)).await?;
    let truth = reader.ground_truth().await?;
    let lock_ledger = || workload.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let held: Vec<_> = lock_ledger()
        .workers
        .iter()
        .filter(|(_, k)| !k.deleted && !k.delete_unknown)
        .map(|(id, k)| (id.clone(), k.principal))
        .collect();
    let gets = reader.get_each(held).await;
    let report = {
        let ledger = lock_ledger();
        let c = &workload.counters;
        let reboots_ok = c.reboots_ok.load(Ordering::Relaxed);
        let failed = c.failed.load(Ordering::Relaxed);
        let (damage, invariants) = verify::check(&ledger, &truth, &gets, reboots_ok, failed);

        let proxy = proxies.iter().map(|p| p.stats.snapshot()).fold(ProxyCounts::default(), |a, b| a + b);
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        RunReport {
            clients: kind,
            setup: Setup {
                database: if sc.postgres.is_some() { "postgres" } else { "sqlite" },
                replicas: replicas_n,
                ops: sc.ops,
                concurrency: sc.concurrency,
                client_fault_rate: rate,
                lbctl_share: sc.lbctl_share,
                server_kills: sc.server_kills,
                hv_fail_before: sc.hv_fail_before,
                hv_fail_after: sc.hv_fail_after,
                hv_latency_ms: sc.hv_latency_ms,
                pool_nodes,
            },
            attempts: load(&c.attempts),
            faults: Faults {
                never_reached: proxy.never_reached,
                response_lost: proxy.response_lost,
                gave_up_mid_flight: proxy.gave_up_mid_flight,
                client_killed: load(&c.lbctl_kills),
            },
            proxy,
            server_kills: kills_done,
            outcomes: Outcomes {
                succeeded: load(&c.succeeded),
                refused: load(&c.refused),
                failed,
                creates_ok: load(&c.creates_ok),
                reboots_ok,
                deletes_ok: load(&c.deletes_ok),
                replayed: load(&c.replayed),
                via_lbctl: load(&c.lbctl_ops),
                lbctl_runs: load(&c.lbctl_runs),
            },
            damage,
            fleet: truth.fleet.clone(),
            hypervisor: truth.sim,
            passed: invariants.iter().all(|i| i.ok),
            invariants,
            failures: ledger.failures.clone(),
            refusals: ledger.refusals.clone(),
            workload_secs,
            elapsed_secs: started.elapsed().as_secs_f64(),
        }
    };
    for r in replicas.lock().await.iter_mut() {
        r.stop().await;
    }
    drop(hypervisor);
    Ok(report)
}

/// Kills a random replica `kills` times, at evenly spread points of the workload, each time while
/// it has a request open, and restarts it on the same port. Returns the kills made.
async fn kill_replicas(
    kills: u32,
    ops: u64,
    workload: Arc<Workload>,
    replicas: Arc<Mutex<Vec<Replica>>>,
    proxies: Arc<Vec<Proxy>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(kills) {
        let milestone = ops * k / (u64::from(kills) + 1);
        while workload.counters.ops_done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = rand::rng().random_range(0..proxies.len());
        // Mid-request: wait (briefly) until the victim has a connection open.
        let wait_until = Instant::now() + Duration::from_secs(2);
        while proxies[victim].stats.active_upstream.load(Ordering::Relaxed) == 0 && Instant::now() < wait_until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        replicas.lock().await[victim].kill_and_restart().await?;
        done += 1;
    }
    Ok(done)
}

fn progress_bar(sc: &Scenario, kind: ClientKind, rate: f64) -> ProgressBar {
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

async fn status(workload: &Workload, proxies: &[Proxy], replicas: &Mutex<Vec<Replica>>) -> String {
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
