//! The body of one run: start the hypervisor, the replicas and their proxies, drive the workload
//! while killing replicas (and restarting the database), let everything settle, read the ground
//! truth and check it.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::binaries::{Binaries, serve_extra};
use super::chaos::{kill_replicas, pause_replicas, restart_database};
use super::failover::{fail_over_postgres, fail_over_redis};
use super::progress::{progress_bar, status};
use crate::cli::BmcMode;
use crate::cli::Scenario;
use crate::cluster::{self, Hypervisor, Replica, ServeConfig, SimFaults};
use crate::late::LateProxy;
use crate::libvirt::Libvirt;
use crate::pg::LocalCluster;
use crate::proxy::{FaultPlan, Proxy, ProxyCounts};
use crate::report::{Faults, Outcomes, RunReport, Setup};
use crate::verify::{self, Bmcs, Reader, Vms};
use crate::workload::{ClientKind, Workload, WorkloadConfig};
use idempotency_sqlx::testing::ha::HaPostgres;

/// Flashes go to the first this many nodes of the pool, so that some meet a running flash.
const FLASH_NODES: u32 = 16;
/// What runs without an owner, listed in the report (the counts are complete).
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
    database: &str,
    own: OwnServers,
) -> anyhow::Result<RunReport> {
    let own_cluster = own.restarted;
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
        redfish: sc.bmc == BmcMode::Redfish,
    };
    // On libvirt the simulator serves the BMCs only, and only as Redfish (the servers' --bmc-url);
    // with the native BMC API the servers' BMCs are their in-process ones, which no one else can
    // read: no flashes then.
    let hypervisor = if own.libvirt.is_none() || sc.bmc == BmcMode::Redfish {
        Some(Hypervisor::start(&bin.leasebroker, dir, faults).await?)
    } else {
        None
    };
    let flash_share = if hypervisor.is_some() { sc.flashes } else { 0.0 };
    let (mut extra, settle, abandon_after) = serve_extra(sc, bin)?;
    if let Some(libvirt) = &own.libvirt {
        extra.extend(["--libvirt-images".to_owned(), libvirt.dir.to_string_lossy().into_owned()]);
    }
    if let (BmcMode::Redfish, Some(sim)) = (sc.bmc, &hypervisor) {
        extra.extend(["--bmc-url".to_owned(), format!("redfish+{}", sim.url)]);
    }
    // Late landings: the servers call the simulator through a proxy that holds a share of first
    // boots until the settle window has passed, and `--late-by` more.
    let late = match &hypervisor {
        Some(sim) if sc.late_landings > 0.0 && own.libvirt.is_none() => {
            let window = settle.unwrap_or(sc.hypervisor_timeout + Duration::from_secs(2));
            Some(LateProxy::start(&sim.url, sc.late_landings, window + sc.late_by).await?)
        }
        _ => None,
    };
    // Stopped and removed when the run ends (its processes are killed on drop).
    let redis = if sc.redis_cluster {
        if !idempotency_redis::testing::have_redis_binaries() {
            bail!("--redis-cluster needs redis-server and redis-cli on the PATH (Debian: redis-server, redis-tools)");
        }
        let with_replicas = usize::from(sc.redis_failovers > 0 || sc.record_store_replicas > 0);
        let cluster = tokio::task::spawn_blocking(move || {
            idempotency_redis::testing::Cluster::start_with_replicas(with_replicas)
        })
        .await
        .context("starting a Redis Cluster")?;
        extra.extend(["--record-store".to_owned(), cluster.url()]);
        if sc.record_store_replicas > 0 {
            extra.extend(["--record-store-replicas".to_owned(), sc.record_store_replicas.to_string()]);
        }
        Some(Arc::new(std::sync::Mutex::new(cluster)))
    } else {
        None
    };
    let config = ServeConfig {
        binary: bin.leasebroker.clone(),
        database: database.to_owned(),
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
    // One after the other: the first migrates and seeds the database.
    for _ in 0..replicas_n {
        replicas.push(Replica::start(replicas.len(), config.clone()).await?);
    }
    let plan = FaultPlan { rate, attempt_timeout: sc.attempt_timeout };
    let mut proxies = Vec::new();
    for r in &replicas {
        proxies.push(Proxy::start(r.addr, plan).await?);
    }
    let direct: Vec<String> = replicas.iter().map(Replica::url).collect();
    let vms = match (&own.libvirt, &hypervisor) {
        (Some(libvirt), _) => Vms::Libvirt(libvirt.clone()),
        (None, Some(sim)) => Vms::Simulator(sim.url.clone()),
        (None, None) => bail!("no hypervisor"),
    };
    let bmcs = hypervisor.as_ref().map(|sim| Bmcs { url: sim.url.clone(), redfish: sc.bmc == BmcMode::Redfish });
    let reader = Reader::new(direct, vms, bmcs, principals.clone())?;

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
        flash_share,
        pool_nodes: pool_nodes.min(FLASH_NODES),
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
    let pause = sc.pause_for.unwrap_or(sc.in_flight_ttl + Duration::from_secs(2));
    let mut pauser = JoinSet::new();
    pauser.spawn(pause_replicas(sc.pauses, pause, sc.ops, workload.clone(), replicas.clone(), proxies.clone()));
    let mut pauses_done = 0;
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
    let mut failover = JoinSet::new();
    if let Some(ha) = &own.ha {
        failover.spawn(fail_over_postgres(sc.postgres_failovers, sc.ops, workload.clone(), ha.clone()));
    }
    if let Some(cluster) = &redis {
        failover.spawn(fail_over_redis(sc.redis_failovers, sc.ops, workload.clone(), cluster.clone()));
    }
    let mut failovers_done = 0;
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
            Some(joined) = pauser.join_next() => match joined.context("the pause task panicked")? {
                Ok(n) => pauses_done = n,
                Err(e) => break Some(e.context("pausing a replica")),
            },
            Some(joined) = restarter.join_next() => match joined.context("the database restart task panicked")? {
                Ok(n) => restarts_done = n,
                Err(e) => break Some(e.context("restarting the database")),
            },
            Some(joined) = failover.join_next() => match joined.context("the failover task panicked")? {
                Ok(n) => failovers_done += n,
                Err(e) => break Some(e.context("failing over")),
            },
            _ = ticker.tick() => progress.set_message(status(&workload, &proxies, &replicas).await),
        }
    };
    // A pause still pending is not made; one under way is cut short, and no replica stays stopped.
    pauser.abort_all();
    while let Some(joined) = pauser.join_next().await {
        if let Ok(Ok(n)) = joined {
            pauses_done = n;
        }
    }
    for r in replicas.lock().await.iter() {
        r.resume().await;
    }
    let pauses_done = pauses_done.max(replicas.lock().await.iter().map(|r| r.pauses).sum());
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
    // Every failover asked for is made, also those whose point the workload reached last: each
    // point is before the last operation, so none waits for more.
    while let Some(joined) = failover.join_next().await {
        failovers_done += joined.context("the failover task panicked")?.context("failing over")?;
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
    // Flashes go to nodes 1..=FLASH_NODES; a planted flash to the next one, which no operation
    // flashes.
    let flash_nodes = pool_nodes.min(FLASH_NODES);
    let mut bmc_nodes: Vec<String> = (1..=flash_nodes).map(|n| format!("node-{n:04}")).collect();
    if sc.plant_orphans > 0 {
        let node = format!("node-{:04}", flash_nodes + 1);
        reader.plant_orphans(sc.plant_orphans, &node).await.context("planting orphans")?;
        bmc_nodes.push(node);
    }
    // A check of the checker: records a success was answered for, deleted behind the service's back.
    if sc.drop_acknowledged > 0 {
        let keys: Vec<String> = workload
            .ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .acknowledged
            .iter()
            .take(sc.drop_acknowledged as usize)
            .map(|a| a.key.clone())
            .collect();
        let dropped = verify::drop_records(database, &keys).await.context("deleting acknowledged records")?;
        eprintln!("faultline: deleted {dropped} acknowledged record(s) behind the service's back");
    }
    // Let cut-off handlers finish, late calls land, stale in-flight records age out and the
    // reaper roll back what was abandoned before reading the truth.
    let mut quiet = sc.in_flight_ttl + sc.hypervisor_timeout + Duration::from_secs(1);
    quiet += settle.unwrap_or_default().max(Duration::from_millis(sc.hv_latency_ms + sc.hv_slow_ms));
    if let Some(after) = abandon_after {
        quiet += after + settle.unwrap_or_default() + 2 * sc.sweep_interval;
    }
    if late.is_some() {
        quiet += sc.late_by;
    }
    reader.settle(quiet, Duration::from_secs(60)).await?;
    // What landed after its operation ended is the inventory sweep's: it removes a VM nobody owns
    // once the settle window has passed since its last send, on its next tick. Wait for it, with
    // a deadline (a few ticks, at most 20 s of them, and a margin for a busy machine): what is
    // left then runs without an owner.
    let owners_wait = Instant::now();
    let ticks = (4 * sc.sweep_interval).min(Duration::from_secs(20));
    let owners_deadline = owners_wait + settle.unwrap_or_default() + ticks + Duration::from_secs(10);
    let truth = reader.ground_truth_once_owned(owners_deadline).await?;
    let owners_wait_secs = owners_wait.elapsed().as_secs_f64();
    let lock_ledger = || workload.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let held: Vec<_> = lock_ledger()
        .workers
        .iter()
        .filter(|(_, k)| !k.deleted && !k.delete_unknown)
        .map(|(id, k)| (id.clone(), k.principal))
        .collect();
    let gets = reader.get_each(held).await;
    let flash_ops = lock_ledger().flash_ops.clone();
    let operations = reader.operations_ended(&flash_ops, Duration::from_secs(120)).await;
    let flashes_unowned = reader.flashes_without_operation(&bmc_nodes).await.context("reading the BMCs' flashes")?;
    let vms_unowned = truth.vms_without_worker();
    // What was acknowledged and is no longer there: read after everything settled (and after any
    // failover), by key from the records listing.
    let record_states = reader.record_states().await.context("reading the records")?;
    let records_lost = verify::records_lost(&lock_ledger().acknowledged, &record_states);
    let flash_ops_lost = operations.iter().filter(|(_, op)| op.is_none()).count() as u64;
    let late_counts = late.as_ref().map(|l| l.stats.snapshot()).unwrap_or_default();
    let report = {
        let ledger = lock_ledger();
        let c = &workload.counters;
        let reboots_ok = c.reboots_ok.load(Ordering::Relaxed);
        let failed = c.failed.load(Ordering::Relaxed);
        let (mut damage, mut invariants) =
            verify::check(&ledger, &truth, &gets, reboots_ok, failed, late_counts.delivered, own.libvirt.is_some());
        verify::check_flashes(&ledger, &truth, &operations, &mut damage, &mut invariants);
        verify::check_owners(&vms_unowned, &flashes_unowned, &mut damage, &mut invariants);
        verify::check_acknowledged(records_lost.len() as u64, flash_ops_lost, &mut damage, &mut invariants);

        let proxy = proxies.iter().map(|p| p.stats.snapshot()).fold(ProxyCounts::default(), |a, b| a + b);
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        RunReport {
            clients: kind,
            setup: Setup {
                database: if on_postgres { "postgres" } else { "sqlite" },
                record_store: match (&redis, sc.redis_failovers > 0 || sc.record_store_replicas > 0) {
                    (None, _) => "database",
                    (Some(_), false) => "redis-cluster x3",
                    (Some(_), true) => "redis-cluster x3 (+1 replica each)",
                },
                postgres_ha: sc.postgres_ha.then(|| sc.postgres_replication.name()),
                postgres_failovers: sc.postgres_failovers,
                redis_failovers: sc.redis_failovers,
                record_store_replicas: sc.record_store_replicas,
                replicas: replicas_n,
                ops: sc.ops,
                concurrency: sc.concurrency,
                client_fault_rate: rate,
                lbctl_share: sc.lbctl_share,
                flash_share,
                hypervisor: own
                    .libvirt
                    .as_ref()
                    .map_or_else(|| "simulator".to_owned(), |l| format!("libvirt {}", l.uri())),
                bmc: sc.bmc,
                server_kills: sc.server_kills,
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
            failovers: failovers_done,
            pauses: pauses_done,
            late: late_counts,
            outcomes: Outcomes {
                succeeded: load(&c.succeeded),
                refused: load(&c.refused),
                failed,
                abandoned: load(&c.abandoned),
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
            workers_without_vm: verify::workers_without_vm(&ledger, &truth),
            vms_without_worker: vms_unowned.iter().take(KEPT_UNOWNED).cloned().collect(),
            flashes_without_operation: flashes_unowned.iter().take(KEPT_UNOWNED).cloned().collect(),
            acknowledged: ledger.acknowledged.len() as u64,
            records_lost: records_lost.iter().take(KEPT_UNOWNED).cloned().collect(),
            owners_wait_secs,
            workload_secs,
            elapsed_secs: started.elapsed().as_secs_f64(),
        }
    };
    for r in replicas.lock().await.iter_mut() {
        r.stop().await;
    }
    drop(late);
    drop(hypervisor);
    Ok(report)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
