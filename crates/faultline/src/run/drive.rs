//! The body of one run: start the hypervisor, the replicas and their proxies, drive the workload
//! while killing replicas (and restarting the database), send what gave up again with its key,
//! let everything settle, read the ground truth and check it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use leasebroker_client::{Operation, OperationId, Worker, WorkerId};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::binaries::{Binaries, serve_extra};
use super::chaos::{kill_replicas, pause_replicas, restart_database};
use super::failover::{fail_over_postgres, fail_over_redis};
use super::progress::{progress_bar, status};
use crate::cli::BmcMode;
use crate::cli::Scenario;
use crate::cluster::{self, Hypervisor, Principal, Replica, ServeConfig, SimFaults};
use crate::late::LateProxy;
use crate::libvirt::Libvirt;
use crate::pg::LocalCluster;
use crate::proxy::{FaultPlan, Proxy, ProxyCounts};
use crate::report::{Faults, Outcomes, RunReport, Setup};
use crate::verify::{self, Bmcs, GroundTruth, Reader, Vms};
use crate::workload::{ClientKind, Rerun, Workload, WorkloadConfig};
use idempotency_redis::testing::Cluster as RedisCluster;
use idempotency_sqlx::DatabaseUrl;
use idempotency_sqlx::testing::ha::HaPostgres;

/// Flashes go to the first this many nodes of the pool, so that some meet a running flash.
const FLASH_NODES: u32 = 16;
/// What runs without an owner, listed in the report (the counts are complete); and the reruns.
const KEPT_UNOWNED: usize = 50;

/// The database servers of faultline's own that a run makes faults on.
pub(super) struct OwnServers {
    /// The one it stops and starts (`--postgres-restarts`).
    pub(super) restarted: Option<Arc<Mutex<LocalCluster>>>,
    /// The HA cluster it fails over (`--postgres-ha`).
    pub(super) ha: Option<Arc<std::sync::Mutex<HaPostgres>>>,
    /// The libvirt host the VMs run on (`--libvirt`).
    pub(super) libvirt: Option<Arc<Libvirt>>,
}

/// One run in `dir` against `database`: everything it starts is stopped when it returns.
pub(super) async fn run_in(
    sc: &Scenario,
    bin: &Binaries,
    rate: f64,
    kind: ClientKind,
    dir: &Path,
    database: &DatabaseUrl,
    own: OwnServers,
) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    let services = Services::start(sc, bin, dir, database, &own, rate).await?;
    let workload = services.workload(sc, bin, rate, kind, dir)?;
    let driven = drive(sc, &services, &workload, &own, rate, kind).await?;
    for p in services.proxies.iter() {
        p.set_faults(false);
    }
    let reruns = rerun_gave_up(&services.reader, &workload).await?;
    let checked = check(sc, &services, &workload, database).await?;
    let report = report(sc, &services, &workload, &own, Finished { rate, kind, started, driven, reruns, checked });
    for r in services.replicas.lock().await.iter_mut() {
        r.stop().await;
    }
    Ok(report)
}

/// What a run starts besides the workload; stopped when dropped (the processes are killed on
/// drop), the replicas explicitly at the end.
struct Services {
    /// Runs until the run ends.
    _hypervisor: Option<Hypervisor>,
    late: Option<LateProxy>,
    redis: Option<Arc<std::sync::Mutex<RedisCluster>>>,
    replicas: Arc<Mutex<Vec<Replica>>>,
    replicas_n: u32,
    on_postgres: bool,
    proxies: Arc<Vec<Proxy>>,
    reader: Reader,
    principals: Vec<Principal>,
    pool_nodes: u32,
    flash_share: f64,
    /// The servers' `--hypervisor-settle`, when they have it.
    settle: Option<Duration>,
    /// The servers' `--abandon-after`, when passed.
    abandon_after: Option<Duration>,
}

impl Services {
    /// Starts the hypervisor (unless the VMs are on libvirt and the BMCs native), the late-landing
    /// proxy, the Redis Cluster, the replicas (one after the other: the first migrates and seeds
    /// the database) and a proxy in front of each that injects client faults at `rate`.
    async fn start(
        sc: &Scenario,
        bin: &Binaries,
        dir: &Path,
        database: &DatabaseUrl,
        own: &OwnServers,
        rate: f64,
    ) -> anyhow::Result<Self> {
        let on_postgres = database.is_postgres();
        let replicas_n = if on_postgres { sc.replicas } else { 1 };
        let pool_nodes = sc
            .pool_nodes
            .unwrap_or_else(|| u32::try_from(sc.ops.saturating_mul(2) + 64).unwrap_or(100_000).min(100_000));
        let principals = cluster::principals(sc.principals);
        let hypervisor = start_hypervisor(sc, bin, dir, own).await?;
        let flash_share = if hypervisor.is_some() { sc.flashes } else { 0.0 };
        let (mut extra, settle, abandon_after) = serve_extra(sc, bin)?;
        if let Some(libvirt) = &own.libvirt {
            extra.extend(["--libvirt-images".to_owned(), libvirt.dir.to_string_lossy().into_owned()]);
        }
        if let (BmcMode::Redfish, Some(sim)) = (sc.bmc, &hypervisor) {
            extra.extend(["--bmc-url".to_owned(), format!("redfish+{}", sim.url)]);
        }
        let late = start_late(sc, settle, hypervisor.as_ref(), own).await?;
        let redis = start_redis(sc, &mut extra).await?;
        let config = ServeConfig {
            binary: bin.leasebroker.clone(),
            database: database.as_str().to_owned(),
            principals: principals.clone(),
            pool_nodes,
            hypervisor_url: match (&own.libvirt, &late, &hypervisor) {
                (Some(libvirt), _, _) => format!("libvirt+{}", libvirt.uri()),
                (None, Some(late), _) => late.url.clone(),
                (None, None, Some(sim)) => sim.url.clone(),
                (None, None, None) => bail!("no hypervisor"),
            },
            hypervisor_timeout: sc.hypervisor_timeout,
            in_flight_ttl: sc.in_flight_ttl,
            extra,
            dir: dir.to_path_buf(),
        };
        let mut replicas = Vec::new();
        for _ in 0..replicas_n {
            replicas.push(Replica::start(replicas.len(), config.clone()).await?);
        }
        let plan = FaultPlan { rate, attempt_timeout: sc.attempt_timeout };
        let mut proxies = Vec::new();
        for r in &replicas {
            proxies.push(Proxy::start(r.addr, plan).await?);
        }
        let vms = match (&own.libvirt, &hypervisor) {
            (Some(libvirt), _) => Vms::Libvirt(libvirt.clone()),
            (None, Some(sim)) => Vms::Simulator(sim.url.clone()),
            (None, None) => bail!("no hypervisor"),
        };
        let bmcs = hypervisor.as_ref().map(|sim| Bmcs { url: sim.url.clone(), redfish: sc.bmc == BmcMode::Redfish });
        let reader = Reader::new(replicas.iter().map(Replica::url).collect(), vms, bmcs, principals.clone())?;
        Ok(Services {
            _hypervisor: hypervisor,
            late,
            redis,
            replicas: Arc::new(Mutex::new(replicas)),
            replicas_n,
            on_postgres,
            proxies: Arc::new(proxies),
            reader,
            principals,
            pool_nodes,
            flash_share,
            settle,
            abandon_after,
        })
    }

    /// The clients of a run at client fault rate `rate`, through the proxies.
    fn workload(
        &self,
        sc: &Scenario,
        bin: &Binaries,
        rate: f64,
        kind: ClientKind,
        dir: &Path,
    ) -> anyhow::Result<Arc<Workload>> {
        Ok(Arc::new(Workload::new(WorkloadConfig {
            kind,
            principals: self.principals.clone(),
            endpoints: self.proxies.iter().map(Proxy::url).collect(),
            kill_rate: rate,
            lbctl_share: sc.lbctl_share,
            lbctl: bin.lbctl.clone(),
            journal: dir.join("lbctl-journal.db"),
            attempt_timeout: sc.attempt_timeout,
            op_max_elapsed: sc.op_max_elapsed,
            run_tag: format!("{}-{rate}", kind.name()),
            abandon_rate: sc.abandon,
            abandon_ops: sc.abandon_ops.clone(),
            flash_share: self.flash_share,
            pool_nodes: self.pool_nodes.min(FLASH_NODES),
        })?))
    }
}

/// The hypervisor simulator. On libvirt it serves the BMCs only, and only as Redfish (the
/// servers' `--bmc-url`); with the native BMC API the servers' BMCs are their in-process ones,
/// which no one else can read: no simulator, and no flashes then.
async fn start_hypervisor(
    sc: &Scenario,
    bin: &Binaries,
    dir: &Path,
    own: &OwnServers,
) -> anyhow::Result<Option<Hypervisor>> {
    if own.libvirt.is_some() && sc.bmc != BmcMode::Redfish {
        return Ok(None);
    }
    let faults = SimFaults {
        fail_before: sc.hv_fail_before,
        fail_after: sc.hv_fail_after,
        latency_ms: sc.hv_latency_ms,
        slow: sc.hv_slow,
        slow_ms: sc.hv_slow_ms,
        refuse: sc.hv_refuse,
        redfish: sc.bmc == BmcMode::Redfish,
    };
    Ok(Some(Hypervisor::start(&bin.leasebroker, dir, faults).await?))
}

/// Late landings: the servers call the simulator through a proxy that holds a share of first
/// boots until the settle window has passed, and `--late-by` more.
async fn start_late(
    sc: &Scenario,
    settle: Option<Duration>,
    hypervisor: Option<&Hypervisor>,
    own: &OwnServers,
) -> anyhow::Result<Option<LateProxy>> {
    match hypervisor {
        Some(sim) if sc.late_landings > 0.0 && own.libvirt.is_none() => {
            let window = settle.unwrap_or(sc.hypervisor_timeout + Duration::from_secs(2));
            Ok(Some(LateProxy::start(&sim.url, sc.late_landings, window + sc.late_by).await?))
        }
        _ => Ok(None),
    }
}

/// The Redis Cluster of `--redis-cluster` (stopped and removed when the run ends: its processes
/// are killed on drop), passed to the servers in `extra`.
async fn start_redis(
    sc: &Scenario,
    extra: &mut Vec<String>,
) -> anyhow::Result<Option<Arc<std::sync::Mutex<RedisCluster>>>> {
    if !sc.redis_cluster {
        return Ok(None);
    }
    if !idempotency_redis::testing::have_redis_binaries() {
        bail!("--redis-cluster needs redis-server and redis-cli on the PATH (Debian: redis-server, redis-tools)");
    }
    let with_replicas = usize::from(sc.redis_failovers > 0 || sc.record_store_replicas > 0);
    let cluster = tokio::task::spawn_blocking(move || RedisCluster::start_with_replicas(with_replicas))
        .await
        .context("starting a Redis Cluster")?;
    extra.extend(["--record-store".to_owned(), cluster.url()]);
    if sc.record_store_replicas > 0 {
        extra.extend(["--record-store-replicas".to_owned(), sc.record_store_replicas.to_string()]);
    }
    Ok(Some(Arc::new(std::sync::Mutex::new(cluster))))
}

/// What the server-side faults came to, and how long the workload ran.
struct Driven {
    kills: u32,
    pauses: u32,
    pause: Duration,
    restarts: u32,
    failovers: u32,
    workload_secs: f64,
}

/// The server-side faults under way: each kind is a task that returns how many it made.
#[derive(Default)]
struct Chaos {
    killer: JoinSet<anyhow::Result<u32>>,
    pauser: JoinSet<anyhow::Result<u32>>,
    restarter: JoinSet<anyhow::Result<u32>>,
    failover: JoinSet<anyhow::Result<u32>>,
    kills: u32,
    pauses: u32,
    restarts: u32,
    failovers: u32,
}

impl Chaos {
    /// Starts the replica kills and pauses, the database restarts and the failovers, each at
    /// its points of the workload.
    fn start(sc: &Scenario, services: &Services, workload: &Arc<Workload>, own: &OwnServers, pause: Duration) -> Self {
        let mut chaos = Chaos::default();
        let (replicas, proxies) = (&services.replicas, &services.proxies);
        chaos.killer.spawn(kill_replicas(
            sc.server_kills,
            sc.server_down,
            sc.ops,
            workload.clone(),
            replicas.clone(),
            proxies.clone(),
        ));
        chaos.pauser.spawn(pause_replicas(
            sc.pauses,
            pause,
            sc.ops,
            workload.clone(),
            replicas.clone(),
            proxies.clone(),
        ));
        if let Some(cluster) = &own.restarted {
            chaos.restarter.spawn(restart_database(
                sc.postgres_restarts,
                sc.postgres_down,
                sc.ops,
                workload.clone(),
                cluster.clone(),
            ));
        }
        if let Some(ha) = &own.ha {
            chaos.failover.spawn(fail_over_postgres(sc.postgres_failovers, sc.ops, workload.clone(), ha.clone()));
        }
        if let Some(cluster) = &services.redis {
            chaos.failover.spawn(fail_over_redis(sc.redis_failovers, sc.ops, workload.clone(), cluster.clone()));
        }
        chaos
    }

    /// Waits for the clients, counting the faults as their tasks end, with the progress bar's
    /// status every quarter of a second. `Some` error when a fault task failed (the clients
    /// are then left as they are).
    async fn until_clients_end(
        &mut self,
        clients: &mut JoinSet<()>,
        workload: &Workload,
        services: &Services,
        progress: &indicatif::ProgressBar,
    ) -> anyhow::Result<Option<anyhow::Error>> {
        let mut ticker = tokio::time::interval(Duration::from_millis(250));
        Ok(loop {
            tokio::select! {
                joined = clients.join_next() => match joined {
                    Some(r) => r.context("a client task panicked")?,
                    None => break None,
                },
                Some(joined) = self.killer.join_next() => match joined.context("the killer task panicked")? {
                    Ok(n) => self.kills = n,
                    Err(e) => break Some(e.context("killing and restarting a replica")),
                },
                Some(joined) = self.pauser.join_next() => match joined.context("the pause task panicked")? {
                    Ok(n) => self.pauses = n,
                    Err(e) => break Some(e.context("pausing a replica")),
                },
                Some(joined) = self.restarter.join_next() => match joined.context("the database restart task panicked")? {
                    Ok(n) => self.restarts = n,
                    Err(e) => break Some(e.context("restarting the database")),
                },
                Some(joined) = self.failover.join_next() => match joined.context("the failover task panicked")? {
                    Ok(n) => self.failovers += n,
                    Err(e) => break Some(e.context("failing over")),
                },
                _ = ticker.tick() => progress.set_message(status(workload, &services.proxies, &services.replicas).await),
            }
        })
    }

    /// Ends the faults once the clients are done (or a fault failed): a pause or a restart still
    /// pending is not made and one under way ends, no replica stays stopped and the database
    /// runs again; every failover asked for is made (each point is before the last operation, so
    /// none waits for more); a kill still pending is not made.
    async fn wind_down(
        mut self,
        services: &Services,
        own: &OwnServers,
        fault_error: Option<anyhow::Error>,
    ) -> anyhow::Result<Self> {
        self.pauser.abort_all();
        while let Some(joined) = self.pauser.join_next().await {
            if let Ok(Ok(n)) = joined {
                self.pauses = n;
            }
        }
        for r in services.replicas.lock().await.iter() {
            r.resume().await;
        }
        self.pauses = self.pauses.max(services.replicas.lock().await.iter().map(|r| r.pauses).sum());
        if let Some(e) = fault_error {
            return Err(e);
        }
        self.restarter.abort_all();
        while let Some(joined) = self.restarter.join_next().await {
            if let Ok(Ok(n)) = joined {
                self.restarts = n;
            }
        }
        if let Some(cluster) = &own.restarted {
            let mut cluster = cluster.lock().await;
            if !cluster.is_running() {
                cluster.start_again().await.context("starting the database after the workload")?;
            }
            self.restarts = self.restarts.max(cluster.restarts);
        }
        while let Some(joined) = self.failover.join_next().await {
            self.failovers += joined.context("the failover task panicked")?.context("failing over")?;
        }
        self.killer.abort_all();
        while let Some(joined) = self.killer.join_next().await {
            if let Ok(Ok(n)) = joined {
                self.kills = n;
            }
        }
        self.kills = self.kills.max(services.replicas.lock().await.iter().map(|r| r.restarts).sum());
        Ok(self)
    }
}

/// Runs the workload on `--concurrency` clients while the faults are made, then ends the faults.
async fn drive(
    sc: &Scenario,
    services: &Services,
    workload: &Arc<Workload>,
    own: &OwnServers,
    rate: f64,
    kind: ClientKind,
) -> anyhow::Result<Driven> {
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
    let pause = sc.pause_for.unwrap_or(sc.in_flight_ttl + Duration::from_secs(2));
    let mut chaos = Chaos::start(sc, services, workload, own, pause);
    let fault_error = chaos.until_clients_end(&mut clients, workload, services, &progress).await?;
    let chaos = chaos.wind_down(services, own, fault_error).await?;
    let workload_secs = workload_start.elapsed().as_secs_f64();
    progress.finish_and_clear();
    let Chaos { kills, pauses, restarts, failovers, .. } = chaos;
    Ok(Driven { kills, pauses, pause, restarts, failovers, workload_secs })
}

/// Sends every operation that gave up again with its key, once the faults are over, after
/// reading what the service stored for each key.
async fn rerun_gave_up(reader: &Reader, workload: &Workload) -> anyhow::Result<Vec<Rerun>> {
    let keys: Vec<String> = workload.ledger().gave_up.iter().filter_map(|g| g.key.clone()).collect();
    let stored = reader.stored_answers(&keys).await.context("reading the records of the operations that gave up")?;
    Ok(workload.rerun_gave_up(&stored).await)
}

/// What the run read once everything settled.
struct Checked {
    truth: GroundTruth,
    gets: Vec<(WorkerId, anyhow::Result<Option<Worker>>)>,
    operations: Vec<(OperationId, Option<Operation>)>,
    flashes_unowned: Vec<String>,
    vms_unowned: Vec<String>,
    records_lost: Vec<String>,
    owners_wait_secs: f64,
}

/// Plants what `--plant-orphans` and `--drop-acknowledged` ask for, waits until the servers
/// settle and the inventory sweep had its time, and reads the ground truth.
async fn check(
    sc: &Scenario,
    services: &Services,
    workload: &Workload,
    database: &DatabaseUrl,
) -> anyhow::Result<Checked> {
    let reader = &services.reader;
    // Flashes go to nodes 1..=FLASH_NODES; a planted flash to the next one, which no operation
    // flashes.
    let flash_nodes = services.pool_nodes.min(FLASH_NODES);
    let mut bmc_nodes: Vec<String> = (1..=flash_nodes).map(|n| format!("node-{n:04}")).collect();
    if sc.plant_orphans > 0 {
        let node = format!("node-{:04}", flash_nodes + 1);
        reader.plant_orphans(sc.plant_orphans, &node).await.context("planting orphans")?;
        bmc_nodes.push(node);
    }
    // A check of the checker: records a success was answered for, deleted behind the service's back.
    if sc.drop_acknowledged > 0 {
        let keys: Vec<String> =
            workload.ledger().acknowledged.iter().take(sc.drop_acknowledged as usize).map(|a| a.key.clone()).collect();
        let dropped = verify::drop_records(database, &keys).await.context("deleting acknowledged records")?;
        eprintln!("faultline: deleted {dropped} acknowledged record(s) behind the service's back");
    }
    let settle = services.settle.unwrap_or_default();
    // Let cut-off handlers finish, late calls land, stale in-flight records age out and the
    // reaper roll back what was abandoned before reading the truth.
    let mut quiet = sc.in_flight_ttl + sc.hypervisor_timeout + Duration::from_secs(1);
    quiet += settle.max(Duration::from_millis(sc.hv_latency_ms + sc.hv_slow_ms));
    if let Some(after) = services.abandon_after {
        quiet += after + settle + 2 * sc.sweep_interval;
    }
    if services.late.is_some() {
        quiet += sc.late_by;
    }
    reader.settle(quiet, Duration::from_secs(60)).await?;
    // What landed after its operation ended is the inventory sweep's: it removes a VM nobody owns
    // once the settle window has passed since its last send, on its next tick. Wait for it, with
    // a deadline (a few ticks, at most 20 s of them, and a margin for a busy machine): what is
    // left then runs without an owner.
    let owners_wait = Instant::now();
    let ticks = (4 * sc.sweep_interval).min(Duration::from_secs(20));
    let truth = reader.ground_truth_once_owned(owners_wait + settle + ticks + Duration::from_secs(10)).await?;
    let owners_wait_secs = owners_wait.elapsed().as_secs_f64();
    let held: Vec<_> = workload
        .ledger()
        .workers
        .iter()
        .filter(|(_, k)| !k.deleted && !k.delete_unknown)
        .map(|(id, k)| (id.clone(), k.principal))
        .collect();
    let gets = reader.get_each(held).await;
    let flash_ops = workload.ledger().flash_ops.clone();
    let operations = reader.operations_ended(&flash_ops, Duration::from_secs(120)).await;
    let flashes_unowned = reader.flashes_without_operation(&bmc_nodes).await.context("reading the BMCs' flashes")?;
    let vms_unowned = truth.vms_without_worker();
    // What was acknowledged and is no longer there: read after everything settled (and after any
    // failover), by key from the records listing.
    let record_states = reader.record_states().await.context("reading the records")?;
    let records_lost = verify::records_lost(&workload.ledger().acknowledged, &record_states);
    Ok(Checked { truth, gets, operations, flashes_unowned, vms_unowned, records_lost, owners_wait_secs })
}

/// Everything a finished run knows besides its services and its workload.
struct Finished {
    rate: f64,
    kind: ClientKind,
    started: Instant,
    driven: Driven,
    reruns: Vec<Rerun>,
    checked: Checked,
}

/// Checks the invariants and writes the run's report.
fn report(sc: &Scenario, services: &Services, workload: &Workload, own: &OwnServers, run: Finished) -> RunReport {
    let Finished { rate, kind, started, driven, reruns, checked } = run;
    let ledger = workload.ledger();
    let c = &workload.counters;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let late = services.late.as_ref().map(|l| l.stats.snapshot()).unwrap_or_default();
    let truth = &checked.truth;
    let (reboots_ok, failed) = (load(&c.reboots_ok), load(&c.failed));
    let (mut damage, mut invariants) =
        verify::check(&ledger, truth, &checked.gets, reboots_ok, late.delivered, own.libvirt.is_some());
    verify::check_flashes(&ledger, truth, &checked.operations, &mut damage, &mut invariants);
    verify::check_owners(&checked.vms_unowned, &checked.flashes_unowned, &mut damage, &mut invariants);
    let flash_ops_lost = checked.operations.iter().filter(|(_, op)| op.is_none()).count() as u64;
    verify::check_acknowledged(checked.records_lost.len() as u64, flash_ops_lost, &mut damage, &mut invariants);
    verify::check_reruns(failed, &reruns, &mut damage, &mut invariants);
    let proxy = services.proxies.iter().map(|p| p.stats.snapshot()).fold(ProxyCounts::default(), |a, b| a + b);
    RunReport {
        clients: kind,
        setup: setup(sc, services, own, rate, driven.pause),
        attempts: load(&c.attempts),
        faults: Faults {
            never_reached: proxy.never_reached,
            response_lost: proxy.response_lost,
            gave_up_mid_flight: proxy.gave_up_mid_flight,
            client_killed: load(&c.lbctl_kills),
        },
        proxy,
        server_kills: driven.kills,
        postgres_restarts: driven.restarts,
        failovers: driven.failovers,
        pauses: driven.pauses,
        late,
        outcomes: Outcomes {
            succeeded: load(&c.succeeded),
            refused: load(&c.refused),
            failed,
            rerun_completed: load(&c.rerun_completed),
            abandoned: load(&c.abandoned),
            abandoning: load(&c.abandoning),
            creates_ok: load(&c.creates_ok),
            reboots_ok,
            deletes_ok: load(&c.deletes_ok),
            flashes_ok: load(&c.flashes_ok),
            flash_conflicts: ledger.flash_conflicts,
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
        gave_up: reruns.into_iter().take(KEPT_UNOWNED).collect(),
        timeline: workload.timeline.lines(),
        workers_without_vm: verify::workers_without_vm(&ledger, truth),
        vms_without_worker: checked.vms_unowned.iter().take(KEPT_UNOWNED).cloned().collect(),
        flashes_without_operation: checked.flashes_unowned.iter().take(KEPT_UNOWNED).cloned().collect(),
        acknowledged: ledger.acknowledged.len() as u64,
        records_lost: checked.records_lost.iter().take(KEPT_UNOWNED).cloned().collect(),
        owners_wait_secs: checked.owners_wait_secs,
        workload_secs: driven.workload_secs,
        elapsed_secs: started.elapsed().as_secs_f64(),
    }
}

/// The run's set-up, as the report states it.
fn setup(sc: &Scenario, services: &Services, own: &OwnServers, rate: f64, pause: Duration) -> Setup {
    Setup {
        database: if services.on_postgres { "postgres" } else { "sqlite" },
        record_store: match (&services.redis, sc.redis_failovers > 0 || sc.record_store_replicas > 0) {
            (None, _) => "database",
            (Some(_), false) => "redis-cluster x3",
            (Some(_), true) => "redis-cluster x3 (+1 replica each)",
        },
        postgres_ha: sc.postgres_ha.then(|| sc.postgres_replication.name()),
        postgres_failovers: sc.postgres_failovers,
        redis_failovers: sc.redis_failovers,
        record_store_replicas: sc.record_store_replicas,
        replicas: services.replicas_n,
        ops: sc.ops,
        concurrency: sc.concurrency,
        client_fault_rate: rate,
        lbctl_share: sc.lbctl_share,
        flash_share: services.flash_share,
        hypervisor: own.libvirt.as_ref().map_or_else(|| "simulator".to_owned(), |l| format!("libvirt {}", l.uri())),
        bmc: sc.bmc,
        server_kills: sc.server_kills,
        server_down_ms: millis(sc.server_down),
        hv_fail_before: sc.hv_fail_before,
        hv_fail_after: sc.hv_fail_after,
        hv_latency_ms: sc.hv_latency_ms,
        hv_slow: sc.hv_slow,
        hv_slow_ms: sc.hv_slow_ms,
        hv_refuse: sc.hv_refuse,
        late_landings: sc.late_landings,
        late_by_ms: millis(sc.late_by),
        pauses: sc.pauses,
        pause_ms: millis(pause),
        plant_orphans: sc.plant_orphans,
        drop_acknowledged: sc.drop_acknowledged,
        hypervisor_timeout_ms: millis(sc.hypervisor_timeout),
        hypervisor_settle_ms: services.settle.map(millis),
        abandon: sc.abandon,
        abandon_ops: sc.abandon_ops.clone(),
        abandon_after_ms: services.abandon_after.map(millis),
        op_max_elapsed_ms: millis(sc.op_max_elapsed),
        postgres_restarts: sc.postgres_restarts,
        pool_nodes: services.pool_nodes,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
