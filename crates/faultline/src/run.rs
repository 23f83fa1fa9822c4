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
use crate::cluster::{self, Hypervisor, Replica, ServeConfig, SimFaults};
use crate::pg::{LocalCluster, TempDatabase};
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
    /// `leasebroker serve --help`: which flags this server has.
    serve_help: String,
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
        let help = std::process::Command::new(&leasebroker)
            .args(["serve", "--help"])
            .output()
            .with_context(|| format!("running {} serve --help", leasebroker.display()))?;
        let serve_help = String::from_utf8_lossy(&help.stdout).into_owned();
        Ok(Binaries { leasebroker, lbctl, serve_help })
    }

    fn serve_has(&self, flag: &str) -> bool {
        self.serve_help.contains(flag)
    }
}

/// The `serve` flags for the settle window and the reaper, those the server has, and the settle
/// window passed (if any). Asking explicitly for a flag the server lacks is an error; the modes
/// that need one run without it (and their invariants show what that costs).
fn serve_extra(sc: &Scenario, bin: &Binaries) -> anyhow::Result<(Vec<String>, Option<Duration>, Option<Duration>)> {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut extra = Vec::new();
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
    let abandon_after = if sc.abandon > 0.0 {
        extra.extend(["--sweep-interval".to_owned(), ms(sc.sweep_interval)]);
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

/// One run with fresh processes and a fresh database; everything it started is stopped and the
/// database dropped, also on error or Ctrl-C.
async fn run_one(scenario: &Scenario, binaries: &Binaries, rate: f64, kind: ClientKind) -> anyhow::Result<RunReport> {
    let temp = tempfile::Builder::new().prefix("faultline-").tempdir().context("temporary directory")?;
    // A run that restarts the database gets a cluster of its own: never restart a shared server.
    let own = if scenario.postgres_restarts > 0 {
        Some(LocalCluster::start().await.context("starting a PostgreSQL cluster of faultline's own")?)
    } else {
        None
    };
    let server = own.as_ref().map(|c| c.url.clone()).or_else(|| scenario.postgres.clone());
    let database = match &server {
        Some(url) => Some(TempDatabase::create(url).await?),
        None => None,
    };
    let own = own.map(|c| Arc::new(Mutex::new(c)));
    let url = match &database {
        Some(db) => db.url.clone(),
        None => format!("sqlite://{}", temp.path().join("leasebroker.db").display()),
    };
    // Dropping the run's future (Ctrl-C, time limit) kills its processes (kill_on_drop) and aborts
    // its tasks; the database is dropped below either way.
    let result = tokio::select! {
        r = tokio::time::timeout(scenario.max_duration, run_in(scenario, binaries, rate, kind, temp.path(), &url, own.clone())) => {
            r.unwrap_or_else(|_| Err(anyhow!("the run took longer than --max-duration {:?}", scenario.max_duration)))
        }
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    if let Some(db) = database
        && let Err(e) = db.drop_now().await
    {
        eprintln!("faultline: warning: {e:#}");
    }
    // The cluster of our own is stopped and removed when its last handle goes (run_in's are gone).
    drop(own);
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
    own_cluster: Option<Arc<Mutex<LocalCluster>>>,
) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    let on_postgres = database.starts_with("postgres");
    let replicas_n = if on_postgres { sc.replicas } else { 1 };
    let pool_nodes =
        sc.pool_nodes.unwrap_or_else(|| u32::try_from(sc.ops.saturating_mul(2) + 64).unwrap_or(100_000).min(100_000));
    let principals = cluster::principals(sc.principals);

    let faults = SimFaults {
        fail_before: sc.hv_fail_before,
        fail_after: sc.hv_fail_after,
        latency_ms: sc.hv_latency_ms,
        slow: sc.hv_slow,
        slow_ms: sc.hv_slow_ms,
        refuse: sc.hv_refuse,
    };
    let hypervisor = Hypervisor::start(&bin.leasebroker, dir, faults).await?;
    let (mut extra, settle, abandon_after) = serve_extra(sc, bin)?;
    // Stopped and removed when the run ends (its processes are killed on drop).
    let redis = if sc.redis_cluster {
        if !idempotency_redis::testing::have_redis_binaries() {
            bail!("--redis-cluster needs redis-server and redis-cli on the PATH (Debian: redis-server, redis-tools)");
        }
        let cluster = tokio::task::spawn_blocking(idempotency_redis::testing::Cluster::start)
            .await
            .context("starting a Redis Cluster")?;
        extra.extend(["--record-store".to_owned(), cluster.url()]);
        Some(cluster)
    } else {
        None
    };
    let config = ServeConfig {
        binary: bin.leasebroker.clone(),
        database: database.to_owned(),
        principals: principals.clone(),
        pool_nodes,
        hypervisor_url: hypervisor.url.clone(),
        hypervisor_timeout: sc.hypervisor_timeout,
        in_flight_ttl: sc.in_flight_ttl,
        extra,
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
        abandon_rate: sc.abandon,
        abandon_ops: sc.abandon_ops.clone(),
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
    let mut restarter = JoinSet::new();
    if let Some(cluster) = &own_cluster {
        restarter.spawn(restart_database(
            sc.postgres_restarts,
            sc.postgres_down,
            sc.ops,
            workload.clone(),
            cluster.clone(),
        ));
    }
    let mut restarts_done = 0;
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
                Err(e) => break Some(e.context("killing and restarting a replica")),
            },
            Some(joined) = restarter.join_next() => match joined.context("the database restart task panicked")? {
                Ok(n) => restarts_done = n,
                Err(e) => break Some(e.context("restarting the database")),
            },
            _ = ticker.tick() => progress.set_message(status(&workload, &proxies, &replicas).await),
        }
    };
    if let Some(e) = kill_error {
        return Err(e);
    }
    // A restart still pending (ops finished before its milestone) is not made; one under way ends.
    restarter.abort_all();
    while let Some(joined) = restarter.join_next().await {
        if let Ok(Ok(n)) = joined {
            restarts_done = n;
        }
    }
    if let Some(cluster) = &own_cluster {
        let mut cluster = cluster.lock().await;
        if !cluster.is_running() {
            cluster.start_again().await.context("starting the database after the workload")?;
        }
        restarts_done = restarts_done.max(cluster.restarts);
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
    // Let cut-off handlers finish, late calls land, stale in-flight records age out and the
    // reaper roll back what was abandoned before reading the truth.
    let mut quiet = sc.in_flight_ttl + sc.hypervisor_timeout + Duration::from_secs(1);
    quiet += settle.unwrap_or_default().max(Duration::from_millis(sc.hv_latency_ms + sc.hv_slow_ms));
    if let Some(after) = abandon_after {
        quiet += after + settle.unwrap_or_default() + 2 * sc.sweep_interval;
    }
    reader.settle(quiet, Duration::from_secs(60)).await?;
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
                database: if on_postgres { "postgres" } else { "sqlite" },
                record_store: if redis.is_some() { "redis-cluster x3" } else { "database" },
                replicas: replicas_n,
                ops: sc.ops,
                concurrency: sc.concurrency,
                client_fault_rate: rate,
                lbctl_share: sc.lbctl_share,
                server_kills: sc.server_kills,
                hv_fail_before: sc.hv_fail_before,
                hv_fail_after: sc.hv_fail_after,
                hv_latency_ms: sc.hv_latency_ms,
                hv_slow: sc.hv_slow,
                hv_slow_ms: sc.hv_slow_ms,
                hv_refuse: sc.hv_refuse,
                hypervisor_timeout_ms: millis(sc.hypervisor_timeout),
                hypervisor_settle_ms: settle.map(millis),
                abandon: sc.abandon,
                abandon_ops: sc.abandon_ops.clone(),
                abandon_after_ms: abandon_after.map(millis),
                postgres_restarts: sc.postgres_restarts,
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
            postgres_restarts: restarts_done,
            outcomes: Outcomes {
                succeeded: load(&c.succeeded),
                refused: load(&c.refused),
                failed,
                abandoned: load(&c.abandoned),
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
            server: truth.server,
            passed: invariants.iter().all(|i| i.ok),
            invariants,
            failures: ledger.failures.clone(),
            refusals: ledger.refusals.clone(),
            workers_without_vm: verify::workers_without_vm(&ledger, &truth),
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

/// Stops the database `restarts` times, at evenly spread points of the workload (offset from the
/// replica kills), keeps it down for `down`, and starts it again. Returns the restarts made.
async fn restart_database(
    restarts: u32,
    down: Duration,
    ops: u64,
    workload: Arc<Workload>,
    cluster: Arc<Mutex<LocalCluster>>,
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(restarts) {
        let milestone = (ops * (2 * k - 1) / (2 * u64::from(restarts) + 1)).max(1);
        while workload.counters.ops_done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut cluster = cluster.lock().await;
        cluster.stop().await?;
        tokio::time::sleep(down).await;
        cluster.start_again().await?;
        cluster.restarts += 1;
        done += 1;
    }
    Ok(done)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
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
