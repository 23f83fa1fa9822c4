//! `faultline run --gateway`: the client faults of a run through `idempotency-gateway`, in front
//! of an upstream that counts its own side effects, and the same clients sent straight to that
//! upstream beside it (what the upstream sees without the gateway).
//!
//! The upstream is the gateway's own test service (`upstream.py`, Python's standard library only,
//! embedded here): every POST is one execution, counted under the logical operation its body
//! names (`{"op": "op-17"}`) whatever key it carried, and its answer carries the execution's order
//! number. So a duplicate is counted by the service that would have done the work twice, never
//! by the gateway under test. Faults: the proxy's client faults in front of each gateway replica
//! (a request that never arrives, an answer lost after the work, a client that gives up
//! mid-flight), gateway replicas SIGKILLed while they hold requests and restarted on their port,
//! and on an operation's first attempt, upstream faults asked for by header: an answer slower
//! than the gateway's `--upstream-timeout` after the work was done, a connection reset after the
//! work, a `503` that did nothing. Then the faults stop, every operation whose client spent its
//! budget is sent once more with its key, and the upstream's counts are read.
//!
//! Invariants, through the gateway: no operation ran twice; every success answered was run, and
//! is the answer of that run; every operation ends (a success, or `409 outcome-uncertain` held
//! for an operator under `--on-uncertain hold` without a probe). Without the gateway the same
//! checks count what the gateway prevents.

mod client;
mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use futures::StreamExt;
use rand::Rng;
use tokio::process::Command;

use crate::cli::{GatewayOptions, OnUncertainMode, RunArgs};
use crate::cluster::{self, GatewayConfig, Replica};
use crate::pg::TempDatabase;
use crate::proxy::{FaultPlan, Proxy};
use crate::workload::ClientKind;
use client::{Client, Counters, Op, UpstreamFault};
pub use report::{GatewayRun, Setup};

/// The upstream under test, the same file the gateway's integration tests run.
const UPSTREAM_PY: &str = include_str!("../../../idempotency-gateway/tests/upstreams/upstream.py");

/// The route file the gateway gets unless `--no-probe`: the upstream's lookup by forwarded key.
const PROBE_ROUTE: &str = "[[route]]\nmatch = \"POST /orders\"\nprobe = \"GET /orders/by-key/{key}\"\n";

/// How long an operation that gave up gets for its one rerun, once the faults are over.
const RERUN_BUDGET: Duration = Duration::from_secs(60);

/// Runs `faultline run --gateway`. `Ok(false)` when the run through the gateway broke an invariant.
pub async fn main(args: RunArgs) -> anyhow::Result<bool> {
    let options = &args.gateway_options;
    let sc = &args.scenario;
    let binary = locate(options)?;
    check_python(&options.python).await?;
    std::fs::create_dir_all(&sc.out).with_context(|| format!("creating {}", sc.out.display()))?;
    let kinds = args.clients();
    let mut runs = Vec::new();
    for kind in kinds {
        let through = if kind == ClientKind::Protected { "the gateway" } else { "the upstream alone" };
        eprintln!("faultline: clients through {through}, client fault rate {}", args.client_faults);
        let run = tokio::time::timeout(sc.max_duration, run_one(&args, &binary, kind))
            .await
            .map_err(|_| anyhow!("the run took longer than --max-duration {:?}", sc.max_duration))??;
        runs.push(run);
    }
    let passed = runs.iter().filter(|r| r.clients == ClientKind::Protected).all(|r| r.passed);
    println!("{}", report::table(&runs));
    let broken = report::broken(&runs);
    if !broken.is_empty() {
        println!("broken invariants:\n{broken}");
    }
    let json = sc.out.join("gateway.json");
    crate::report::write_json(
        &json,
        &report::ReportFile { command: "run --gateway", runs: &runs, protected_passed: passed },
    )?;
    println!("report: {}", json.display());
    Ok(passed)
}

/// The gateway binary: `--gateway-binary`, or `idempotency-gateway` beside this executable.
fn locate(options: &GatewayOptions) -> anyhow::Result<PathBuf> {
    let path = match &options.gateway_binary {
        Some(path) => path.clone(),
        None => {
            let exe = std::env::current_exe().context("locating this executable")?;
            exe.with_file_name("idempotency-gateway")
        }
    };
    if !path.is_file() {
        bail!("{} not found (build it: cargo build -p idempotency-gateway, or pass --gateway-binary)", path.display());
    }
    Ok(path)
}

async fn check_python(python: &Path) -> anyhow::Result<()> {
    let status = Command::new(python).arg("--version").output().await;
    match status {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "--python {}: not a Python interpreter that runs (the upstream is a Python service)",
            python.display()
        ),
    }
}

/// One run with a fresh upstream (and, through the gateway, fresh gateways on a fresh store).
async fn run_one(args: &RunArgs, binary: &Path, kind: ClientKind) -> anyhow::Result<GatewayRun> {
    let (sc, options) = (&args.scenario, &args.gateway_options);
    let started = Instant::now();
    let temp = tempfile::Builder::new().prefix("faultline-gateway-").tempdir().context("temporary directory")?;
    let dir = temp.path();
    let through_gateway = kind == ClientKind::Protected;
    // Under `resend` the upstream deduplicates by the key it receives, as `resend` asks of it.
    let dedupe = through_gateway && options.on_uncertain == OnUncertainMode::Resend;
    let (upstream, upstream_addr) = start_upstream(&options.python, dir, dedupe).await?;
    let upstream_url = format!("http://{upstream_addr}");
    let database = match (&sc.postgres, through_gateway) {
        (Some(url), true) => Some(TempDatabase::create(url).await?),
        _ => None,
    };
    let plan = FaultPlan { rate: args.client_faults, attempt_timeout: sc.attempt_timeout };
    let mut replicas = Vec::new();
    let mut proxies = Vec::new();
    let setup = report::setup(args, database.is_some(), through_gateway);
    let result = async {
        if through_gateway {
            let config = gateway_config(args, binary, dir, &upstream_url, database.as_ref())?;
            for index in 0..setup.replicas as usize {
                replicas.push(Replica::start(index, config.clone()).await?);
            }
            for replica in &replicas {
                proxies.push(Proxy::start(replica.addr, plan).await?);
            }
        } else {
            proxies.push(Proxy::start(upstream_addr, plan).await?);
        }
        drive(args, kind, setup, &mut replicas, proxies, &upstream_url, started).await
    }
    .await;
    for replica in &mut replicas {
        replica.stop().await;
    }
    drop(upstream);
    if let Some(db) = database
        && let Err(e) = db.drop_now().await
    {
        eprintln!("faultline: warning: {e:#}");
    }
    if sc.keep_temp {
        eprintln!("faultline: kept {}", temp.keep().display());
    }
    result
}

async fn start_upstream(
    python: &Path,
    dir: &Path,
    dedupe: bool,
) -> anyhow::Result<(cluster::Running, std::net::SocketAddr)> {
    let script = dir.join("upstream.py");
    std::fs::write(&script, UPSTREAM_PY).with_context(|| format!("writing {}", script.display()))?;
    let mut command = Command::new(python);
    command.arg(&script).args(["--listen", "127.0.0.1:0"]);
    if dedupe {
        command.arg("--dedupe");
    }
    cluster::start(command, &dir.join("upstream.log")).await.context("the upstream (upstream.py)")
}

fn gateway_config(
    args: &RunArgs,
    binary: &Path,
    dir: &Path,
    upstream: &str,
    database: Option<&TempDatabase>,
) -> anyhow::Result<GatewayConfig> {
    let (sc, options) = (&args.scenario, &args.gateway_options);
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let record_store = match database {
        Some(db) => db.url.clone(),
        None => format!("sqlite://{}", dir.join("gateway.db").display()),
    };
    let mut extra = vec![
        "--in-flight-ttl".to_owned(),
        ms(sc.in_flight_ttl),
        "--upstream-timeout".to_owned(),
        ms(options.upstream_timeout),
        "--on-uncertain".to_owned(),
        options.on_uncertain.name().to_owned(),
    ];
    if !options.no_probe {
        let routes = dir.join("gateway.toml");
        std::fs::write(&routes, PROBE_ROUTE).with_context(|| format!("writing {}", routes.display()))?;
        extra.extend(["--config".to_owned(), routes.display().to_string()]);
    }
    Ok(GatewayConfig {
        binary: binary.to_owned(),
        upstream: upstream.to_owned(),
        record_store,
        extra,
        dir: dir.to_owned(),
    })
}

/// Drives the operations through `proxies` while gateway replicas are killed, then reruns those
/// that gave up with the faults off, reads the upstream's counts and checks.
async fn drive(
    args: &RunArgs,
    kind: ClientKind,
    setup: Setup,
    replicas: &mut [Replica],
    proxies: Vec<Proxy>,
    upstream: &str,
    started: Instant,
) -> anyhow::Result<GatewayRun> {
    let (sc, options) = (&args.scenario, &args.gateway_options);
    let counters = Arc::new(Counters::default());
    let targets: Vec<String> = proxies.iter().map(Proxy::url).collect();
    let client = Client::new(targets, sc.attempt_timeout, sc.op_max_elapsed, counters.clone())?;
    let ops = operations(args, upstream_delay(options, sc.attempt_timeout));
    let show_progress = !sc.no_progress;
    let workload = futures::stream::iter(ops.iter())
        .map(|op| client.run(op))
        .buffer_unordered(sc.concurrency as usize)
        .inspect(|_| {
            let done = counters.done.fetch_add(1, Ordering::Relaxed) + 1;
            if show_progress && done % (sc.ops / 10).max(1) == 0 {
                eprintln!("faultline: {done}/{} operations", sc.ops);
            }
        })
        .collect::<Vec<_>>();
    let kills = if kind == ClientKind::Protected { sc.server_kills } else { 0 };
    let (mut endings, killed) =
        tokio::join!(workload, kill_gateways(kills, sc.server_down, sc.ops, &counters, replicas, &proxies));
    let killed = killed?;
    endings.sort_by_key(|e| e.op);
    for proxy in &proxies {
        proxy.set_faults(false);
    }
    let rerun_client = client.with_budget(RERUN_BUDGET);
    for ending in endings.iter_mut().filter(|e| e.gave_up()) {
        ending.rerun = Some(rerun_client.rerun(&ops[ending.op as usize]).await);
    }
    let faults = proxies.iter().map(|p| p.stats.snapshot()).fold(Default::default(), |a, b| a + b);
    let counts = client::upstream_counts(upstream).await?;
    let seen = report::Observed {
        ops: &ops,
        endings: &endings,
        counts: &counts,
        client_faults: faults,
        counters: &counters,
        gateway_kills: killed,
        took: started.elapsed(),
    };
    Ok(report::check(kind, setup, seen))
}

/// How long a slow upstream answer waits after the work: past the gateway's timeout and the
/// client's attempt timeout both, so that neither sees the answer.
fn upstream_delay(options: &GatewayOptions, attempt_timeout: Duration) -> Duration {
    options.upstream_timeout + attempt_timeout + Duration::from_millis(250)
}

/// The run's logical operations, each with its key, its principal and its first attempt's
/// upstream fault.
fn operations(args: &RunArgs, delay: Duration) -> Vec<Op> {
    let (sc, options) = (&args.scenario, &args.gateway_options);
    let mut rng = rand::rng();
    (0..sc.ops)
        .map(|index| {
            let roll: f64 = rng.random();
            let fault = if roll < options.upstream_slow {
                Some(UpstreamFault::Slow(delay))
            } else if roll < options.upstream_slow + options.upstream_resets {
                Some(UpstreamFault::Reset)
            } else if roll < options.upstream_slow + options.upstream_resets + options.upstream_5xx {
                Some(UpstreamFault::Unavailable)
            } else {
                None
            };
            let principal = rng.random_range(0..sc.principals);
            Op::new(index, principal, fault)
        })
        .collect()
}

/// Kills a random gateway replica `kills` times, at evenly spread points of the workload, each
/// time while it has a request open, and after `down` starts it again on its port. Returns the
/// kills made.
async fn kill_gateways(
    kills: u32,
    down: Duration,
    ops: u64,
    counters: &Counters,
    replicas: &mut [Replica],
    proxies: &[Proxy],
) -> anyhow::Result<u32> {
    let mut done = 0;
    for k in 1..=u64::from(kills) {
        let milestone = ops * k / (u64::from(kills) + 1);
        while counters.done.load(Ordering::Relaxed) < milestone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let victim = rand::rng().random_range(0..replicas.len());
        let wait_until = Instant::now() + Duration::from_secs(2);
        while proxies[victim].stats.active_upstream.load(Ordering::Relaxed) == 0 && Instant::now() < wait_until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        replicas[victim].kill().await?;
        tokio::time::sleep(down).await;
        replicas[victim].start_again().await?;
        done += 1;
    }
    Ok(done)
}
