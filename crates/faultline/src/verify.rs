//! Ground truth and the invariants: what the servers and the hypervisor hold once they have
//! settled, compared with what the clients were told.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::{Context, anyhow};
use futures::StreamExt;
use leasebroker_client::{Fleet, Operation, OperationId, Worker, WorkerId, WorkerPage};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cluster::{ADMIN_TOKEN, Principal};
use crate::workload::Ledger;

/// The hypervisor simulator's counters (`GET /v1/stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimStats {
    /// Boots ever.
    pub boots_total: u64,
    /// VMs that exist now.
    pub running: u64,
    /// Boots of a tag booted before.
    pub duplicate_boot_tags: u64,
    /// Reboots ever.
    pub reboots_total: u64,
    /// Reboots with a tag the VM had been rebooted with before.
    pub duplicate_reboot_tags: u64,
    /// Firmware flashes the BMCs started.
    #[serde(default)]
    pub flashes_total: u64,
    /// Flashes of a tag flashed before.
    #[serde(default)]
    pub duplicate_flash_tags: u64,
    /// Nodes bricked by a flash that started while another wrote.
    #[serde(default)]
    pub bricked_nodes: u64,
}

/// What the servers say they did about refusals, late landings and abandoned operations, summed
/// over the replicas' `/metrics` (a replica killed mid-run forgot what it counted before).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ServerCounters {
    /// `leasebroker_refusals_released_total`: creates that gave back node and lease on a refusal.
    pub refusals_released: u64,
    /// `leasebroker_duplicate_vms_destroyed_total`: late landings past the settle window destroyed.
    pub duplicate_vms_destroyed: u64,
    /// `leasebroker_reaper_rolled_back_total{resource="operation"}`: abandoned operations rolled back.
    pub operations_reaped: u64,
    /// `leasebroker_orphans_removed_total`: VMs with the service's tag that nothing owned, deleted
    /// by the inventory sweep (a boot that landed after its operation was rolled back).
    pub orphans_removed: u64,
}

/// The value of the first sample of `name` whose labels contain `labels` (Prometheus text).
fn sample(metrics: &str, name: &str, labels: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            series.strip_prefix(name).is_some_and(|rest| rest.is_empty() || rest.starts_with('{'))
                && series.contains(labels)
        })
        .and_then(|(_, value)| value.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// What the servers and the hypervisor hold.
#[derive(Debug, Clone)]
pub struct GroundTruth {
    /// `GET /admin/v1/fleet`.
    pub fleet: Fleet,
    /// `GET /v1/stats` of the simulator.
    pub sim: SimStats,
    /// Every worker each principal lists, by id, with its principal's index.
    pub workers: HashMap<WorkerId, (usize, Worker)>,
    /// The replicas' own counters.
    pub server: ServerCounters,
    /// The VMs the simulator runs: their ids and tags.
    pub vms: HashMap<String, String>,
}

impl GroundTruth {
    /// The VMs the simulator runs that no listed worker runs on (`vm_id (tag)`, sorted): what runs
    /// that nobody owns.
    pub fn vms_without_worker(&self) -> Vec<String> {
        let owned: HashSet<&str> = self.workers.values().filter_map(|(_, w)| w.vm_id.as_deref()).collect();
        let mut out: Vec<String> = self
            .vms
            .iter()
            .filter(|(id, _)| !owned.contains(id.as_str()))
            .map(|(id, tag)| format!("{id} ({tag})"))
            .collect();
        out.sort();
        out
    }
}

/// Where the VMs run, as the ground truth reads them.
#[derive(Debug, Clone)]
pub enum Vms {
    /// The simulator at this base URL (`/v1/stats`, `/v1/vms`).
    Simulator(String),
    /// A real libvirt host (`--libvirt`): the run's domains and their events.
    Libvirt(std::sync::Arc<crate::libvirt::Libvirt>),
}

/// Where the flashes go: the simulator's BMCs, through its native API or its Redfish service.
#[derive(Debug, Clone)]
pub struct Bmcs {
    /// The simulator's base URL.
    pub url: String,
    /// Served as Redfish (`hypervisor-sim --bmc redfish`).
    pub redfish: bool,
}

/// Direct (unproxied, fault-free) reads of the servers and the simulator.
#[derive(Debug, Clone)]
pub struct Reader {
    http: reqwest::Client,
    replicas: Vec<String>,
    vms: Vms,
    /// `None` when the BMCs are the servers' in-process ones (`--libvirt` without `--bmc
    /// redfish`): no flashes are run then.
    bmcs: Option<Bmcs>,
    principals: Vec<Principal>,
}

impl Reader {
    /// A reader for these replicas (direct URLs), the VMs and the BMCs.
    pub fn new(
        replicas: Vec<String>,
        vms: Vms,
        bmcs: Option<Bmcs>,
        principals: Vec<Principal>,
    ) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build()?;
        Ok(Reader { http, replicas, vms, bmcs, principals })
    }

    /// The simulator's counters, or on libvirt what its domains and events show beside the
    /// BMCs' counters of the simulator (when there is one).
    async fn hypervisor_stats(&self) -> anyhow::Result<SimStats> {
        match &self.vms {
            Vms::Simulator(url) => self.get(&format!("{url}/v1/stats"), "").await?.ok_or_else(|| anyhow!("no stats")),
            Vms::Libvirt(libvirt) => {
                let mut stats = libvirt.stats().await?;
                if let Some(bmcs) = &self.bmcs {
                    let sim: SimStats =
                        self.get(&format!("{}/v1/stats", bmcs.url), "").await?.ok_or_else(|| anyhow!("no stats"))?;
                    stats.flashes_total = sim.flashes_total;
                    stats.duplicate_flash_tags = sim.duplicate_flash_tags;
                    stats.bricked_nodes = sim.bricked_nodes;
                }
                Ok(stats)
            }
        }
    }

    /// The flash tags the BMCs of `nodes` hold, as `(node, tag)`: the native API's `flash_tags`,
    /// or the Redfish tasks' requests (`Targets` and the `tag` of `ImageURI`).
    pub async fn bmc_flash_tags(&self, nodes: &[String]) -> anyhow::Result<Vec<(String, String)>> {
        let Some(bmcs) = &self.bmcs else { return Ok(Vec::new()) };
        let mut flashed = Vec::new();
        if !bmcs.redfish {
            #[derive(Deserialize)]
            struct Bmc {
                #[serde(default)]
                flash_tags: Vec<String>,
            }
            for node in nodes {
                let bmc: Bmc = self
                    .get(&format!("{}/v1/bmc/{node}", bmcs.url), "")
                    .await?
                    .ok_or_else(|| anyhow!("no BMC {node}"))?;
                flashed.extend(bmc.flash_tags.into_iter().map(|tag| (node.clone(), tag)));
            }
            return Ok(flashed);
        }
        let tasks: serde_json::Value = self
            .get(&format!("{}/redfish/v1/TaskService/Tasks", bmcs.url), "")
            .await?
            .ok_or_else(|| anyhow!("no Redfish task collection"))?;
        let members: Vec<String> = tasks["Members"]
            .as_array()
            .ok_or_else(|| anyhow!("the Redfish task collection has no Members"))?
            .iter()
            .filter_map(|m| m["@odata.id"].as_str().map(str::to_owned))
            .collect();
        let read: Vec<anyhow::Result<Option<serde_json::Value>>> = futures::stream::iter(members)
            .map(|path| async move { self.get::<serde_json::Value>(&format!("{}{path}", bmcs.url), "").await })
            .buffer_unordered(16)
            .collect()
            .await;
        for task in read {
            let Some(task) = task? else { continue };
            if let Some((node, tag)) = redfish_task_flash(&task)
                && nodes.contains(&node)
            {
                flashed.push((node, tag));
            }
        }
        Ok(flashed)
    }

    /// GETs `url` as JSON, retrying a few times on errors (the servers have no injected faults
    /// here, but one may still be coming back from the last kill). `Ok(None)` on a 404.
    async fn get<T: DeserializeOwned>(&self, url: &str, token: &str) -> anyhow::Result<Option<T>> {
        let mut last = anyhow!("not tried");
        for attempt in 0..10u64 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
            match self.http.get(url).bearer_auth(token).send().await {
                Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => return Ok(None),
                Ok(r) if r.status().is_success() => {
                    return r.json::<T>().await.map(Some).with_context(|| format!("decoding {url}"));
                }
                Ok(r) => last = anyhow!("{url}: {}", r.status()),
                Err(e) => last = anyhow!("{url}: {e}"),
            }
        }
        Err(last)
    }

    /// The fleet and the simulator's counters.
    pub async fn counters(&self) -> anyhow::Result<(Fleet, SimStats)> {
        let fleet = self.get(&format!("{}/admin/v1/fleet", self.replicas[0]), ADMIN_TOKEN).await?;
        let sim = self.hypervisor_stats().await?;
        Ok((fleet.ok_or_else(|| anyhow!("no fleet"))?, sim))
    }

    /// Waits until nothing moves any more: handlers cut off by a client finish, stale in-flight
    /// records age out. Two equal readings `interval` apart, within `cap`.
    pub async fn settle(&self, quiet: Duration, cap: Duration) -> anyhow::Result<()> {
        tokio::time::sleep(quiet).await;
        let start = tokio::time::Instant::now();
        let mut previous = self.counters().await?;
        while start.elapsed() < cap {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = self.counters().await?;
            if now == previous {
                return Ok(());
            }
            previous = now;
        }
        Ok(())
    }

    /// Reads the ground truth: counters, and every principal's workers page by page.
    pub async fn ground_truth(&self) -> anyhow::Result<GroundTruth> {
        let (fleet, sim) = self.counters().await?;
        let mut workers = HashMap::new();
        for (index, principal) in self.principals.iter().enumerate() {
            let mut cursor: Option<String> = None;
            for _ in 0..10_000 {
                let mut url = format!("{}/v1/workers?limit=500", self.replicas[0]);
                if let Some(c) = &cursor {
                    url.push_str("&cursor=");
                    url.push_str(c);
                }
                let page: WorkerPage =
                    self.get(&url, &principal.token).await?.ok_or_else(|| anyhow!("listing answered 404"))?;
                for w in page.workers {
                    workers.insert(w.id.clone(), (index, w));
                }
                match page.next_cursor {
                    Some(next) if cursor.as_ref() != Some(&next) => cursor = Some(next),
                    _ => break,
                }
            }
        }
        let mut server = ServerCounters::default();
        for replica in &self.replicas {
            let text = match self.http.get(format!("{replica}/metrics")).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            server.refusals_released += sample(&text, "leasebroker_refusals_released_total", "");
            server.duplicate_vms_destroyed += sample(&text, "leasebroker_duplicate_vms_destroyed_total", "");
            server.operations_reaped += sample(&text, "leasebroker_reaper_rolled_back_total", "resource=\"operation\"");
            server.orphans_removed += sample(&text, "leasebroker_orphans_removed_total", "");
        }
        #[derive(Deserialize)]
        struct VmList {
            vms: Vec<VmId>,
        }
        #[derive(Deserialize)]
        struct VmId {
            vm_id: String,
            #[serde(default)]
            tag: String,
        }
        let vms = match &self.vms {
            Vms::Simulator(url) => {
                let vms: VmList = self.get(&format!("{url}/v1/vms"), "").await?.ok_or_else(|| anyhow!("no VM list"))?;
                vms.vms.into_iter().map(|v| (v.vm_id, v.tag)).collect()
            }
            Vms::Libvirt(libvirt) => libvirt.domains().await?.into_iter().map(|d| (d.name, d.tag)).collect(),
        };
        Ok(GroundTruth { fleet, sim, workers, server, vms })
    }

    /// Reads the ground truth until nothing runs that nobody owns (no VM without a worker), or
    /// until `deadline`: the service's inventory sweep removes what landed after its operation
    /// ended once the settle window has passed, on its next tick. Returns the last reading.
    pub async fn ground_truth_once_owned(&self, deadline: tokio::time::Instant) -> anyhow::Result<GroundTruth> {
        loop {
            let truth = self.ground_truth().await?;
            if truth.vms_without_worker().is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(truth);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The flashes the BMCs of `nodes` hold that no operation owns (`node: tag`, sorted): a flash
    /// tag that is the `flash` sub-key of no flash request record, or whose operation did not
    /// succeed (one that failed or never existed, while the BMC flashed). A flash request's tag
    /// and operation id derive from its record (`idempotency::derive`, as leasebroker's
    /// `firmware::keys` derives them), read from `GET /admin/v1/records`.
    pub async fn flashes_without_operation(&self, nodes: &[String]) -> anyhow::Result<Vec<String>> {
        let flashed = self.bmc_flash_tags(nodes).await?;
        if flashed.is_empty() {
            return Ok(Vec::new());
        }
        // Every flash request's tag and operation, from the records.
        let mut owners: HashMap<String, String> = HashMap::new();
        let mut cursor: Option<String> = None;
        for _ in 0..100_000 {
            let mut url = format!("{}/admin/v1/records?limit=500", self.replicas[0]);
            if let Some(c) = &cursor {
                url.push_str("&cursor=");
                url.push_str(c);
            }
            let page: leasebroker_client::RecordPage =
                self.get(&url, ADMIN_TOKEN).await?.ok_or_else(|| anyhow!("listing records answered 404"))?;
            for r in &page.records {
                if let Some((tag, op)) = flash_keys(r) {
                    owners.insert(tag, op);
                }
            }
            match page.next_cursor {
                Some(next) if cursor.as_ref() != Some(&next) => cursor = Some(next),
                _ => break,
            }
        }
        let mut out = Vec::new();
        for (node, tag) in flashed {
            let owned = match owners.get(&tag) {
                Some(op) => self
                    .get::<Operation>(&format!("{}/admin/v1/operations/{op}", self.replicas[0]), ADMIN_TOKEN)
                    .await?
                    .is_some_and(|op| {
                        matches!(
                            op.state,
                            leasebroker_client::OperationState::Succeeded | leasebroker_client::OperationState::Running
                        )
                    }),
                None => false,
            };
            if !owned {
                out.push(format!("{node}: {tag}"));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The state of every record the service holds, by key (`GET /admin/v1/records`, page by
    /// page, every principal's).
    pub async fn record_states(&self) -> anyhow::Result<HashMap<String, String>> {
        let mut states = HashMap::new();
        let mut cursor: Option<String> = None;
        for _ in 0..100_000 {
            let mut url = format!("{}/admin/v1/records?limit=500", self.replicas[0]);
            if let Some(c) = &cursor {
                url.push_str("&cursor=");
                url.push_str(c);
            }
            let page: leasebroker_client::RecordPage =
                self.get(&url, ADMIN_TOKEN).await?.ok_or_else(|| anyhow!("listing records answered 404"))?;
            for r in page.records {
                states.insert(r.key, r.state);
            }
            match page.next_cursor {
                Some(next) if cursor.as_ref() != Some(&next) => cursor = Some(next),
                _ => break,
            }
        }
        Ok(states)
    }

    /// Boots `vms` VMs on the simulator directly and starts one flash on `flash_node`'s BMC, each
    /// tagged `faultline-planted-N`: nothing in the service owns them. Retries a call the
    /// simulator's faults cut until its tag is there.
    pub async fn plant_orphans(&self, vms: u32, flash_node: &str) -> anyhow::Result<()> {
        let (Vms::Simulator(hv), Some(bmcs)) = (&self.vms, &self.bmcs) else {
            anyhow::bail!("--plant-orphans plants on the simulator, which this run does not use");
        };
        for n in 0..=vms {
            let tag = format!("{PLANTED_PREFIX}{n}");
            let bmc = &bmcs.url;
            let (send, check) = if n < vms {
                let body = serde_json::json!({"image": "planted", "cpu": 1, "memory_gb": 1, "tag": tag});
                (self.http.post(format!("{hv}/v1/vms")).json(&body), Some(format!("{hv}/v1/vms?tag={tag}")))
            } else if bmcs.redfish {
                let body = serde_json::json!({
                    "ImageURI": format!("http://firmware.invalid/images/planted?tag={tag}"),
                    "Targets": [format!("/redfish/v1/Systems/{flash_node}")],
                });
                let url = format!("{bmc}/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate");
                (self.http.post(url).json(&body), None)
            } else {
                let body = serde_json::json!({"version": "planted", "tag": tag});
                (
                    self.http.post(format!("{bmc}/v1/bmc/{flash_node}/flash")).json(&body),
                    Some(format!("{bmc}/v1/bmc?tag={tag}")),
                )
            };
            let mut planted = false;
            for _ in 0..50 {
                let Some(request) = send.try_clone() else { break };
                if request.send().await.is_ok_and(|r| r.status().is_success()) {
                    planted = true;
                    break;
                }
                let listed = match &check {
                    Some(check) => self
                        .get::<serde_json::Value>(check, "")
                        .await?
                        .is_some_and(|v| v["vms"].as_array().or(v["nodes"].as_array()).is_some_and(|a| !a.is_empty())),
                    None => self.bmc_flash_tags(&[flash_node.to_owned()]).await?.iter().any(|(_, t)| *t == tag),
                };
                if listed {
                    planted = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            if !planted {
                anyhow::bail!("could not plant {tag} on the simulator");
            }
        }
        Ok(())
    }

    /// Each of the operations `ids` once it has ended, or as it still is after `cap` (each one
    /// read until it is no longer `running`; `None` when it could not be read at all).
    pub async fn operations_ended(&self, ids: &[OperationId], cap: Duration) -> Vec<(OperationId, Option<Operation>)> {
        let deadline = tokio::time::Instant::now() + cap;
        futures::stream::iter(ids.iter().enumerate())
            .map(|(n, id)| async move {
                let url = format!("{}/admin/v1/operations/{id}", self.replicas[n % self.replicas.len()]);
                loop {
                    let op = self.get::<Operation>(&url, ADMIN_TOKEN).await.ok().flatten();
                    if op.as_ref().is_some_and(Operation::is_finished) || tokio::time::Instant::now() >= deadline {
                        return (id.clone(), op);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
            .buffer_unordered(16)
            .collect()
            .await
    }

    /// GETs each of `workers` as its principal, spread over the replicas.
    pub async fn get_each(&self, workers: Vec<(WorkerId, usize)>) -> Vec<(WorkerId, anyhow::Result<Option<Worker>>)> {
        futures::stream::iter(workers.into_iter().enumerate())
            .map(|(n, (id, principal))| async move {
                let base = &self.replicas[n % self.replicas.len()];
                let got =
                    self.get::<Worker>(&format!("{base}/v1/workers/{id}"), &self.principals[principal].token).await;
                (id, got)
            })
            .buffer_unordered(16)
            .collect()
            .await
    }
}

/// The acknowledged keys (a `2xx` was answered for each) whose record the service no longer
/// holds completed, as `key (what): gone` or `key (what): <state>`, sorted: what a failover (or
/// anything else) lost after it was acknowledged. A retry of such a key runs again.
pub fn records_lost(acknowledged: &[crate::workload::Acknowledged], states: &HashMap<String, String>) -> Vec<String> {
    let mut out: Vec<String> = acknowledged
        .iter()
        .filter_map(|a| match states.get(&a.key).map(String::as_str) {
            Some("completed") => None,
            Some(state) => Some(format!("{} ({}): {state}", a.key, a.what)),
            None => Some(format!("{} ({}): gone", a.key, a.what)),
        })
        .collect();
    out.sort();
    out
}

/// The invariant "nothing acknowledged is lost": every key a success was answered for still has
/// its completed record; every worker a client holds is still listed; every accepted flash
/// operation can still be read.
pub fn check_acknowledged(
    records_lost: u64,
    flash_ops_lost: u64,
    damage: &mut Damage,
    invariants: &mut Vec<Invariant>,
) {
    damage.acknowledged_records_lost = records_lost;
    damage.acknowledged_flash_ops_lost = flash_ops_lost;
    for (name, actual) in [
        (ACKNOWLEDGED_RECORDS_LOST, records_lost),
        ("acknowledged flash operations lost (accepted, no longer found)", flash_ops_lost),
    ] {
        invariants.push(Invariant { name: name.to_owned(), expected: 0, actual, at_most: false, ok: actual == 0 });
    }
}

/// The name of the invariant on acknowledged records.
pub const ACKNOWLEDGED_RECORDS_LOST: &str = "acknowledged records lost (2xx answered, record gone or not completed)";

/// Deletes the records of `keys` straight from the database at `database` (a `sqlite://` or
/// `postgres://` URL), behind the service's back (`--drop-acknowledged`). Returns how many rows
/// went.
pub async fn drop_records(database: &str, keys: &[String]) -> anyhow::Result<u64> {
    const DELETE: &str = "DELETE FROM idempotency_records WHERE key = $1";
    let mut dropped = 0;
    if database.starts_with("sqlite:") {
        let options: sqlx::sqlite::SqliteConnectOptions = database.parse().context("the SQLite URL")?;
        let pool = sqlx::SqlitePool::connect_with(options.busy_timeout(Duration::from_secs(10))).await?;
        for key in keys {
            dropped += sqlx::query(DELETE).bind(key).execute(&pool).await?.rows_affected();
        }
        pool.close().await;
    } else {
        let pool = sqlx::PgPool::connect(database).await.context("connecting to PostgreSQL")?;
        for key in keys {
            dropped += sqlx::query(DELETE).bind(key).execute(&pool).await?.rows_affected();
        }
        pool.close().await;
    }
    Ok(dropped)
}

/// The node and the tag of a Redfish task's flash: the last segment of its request's first
/// `Targets` entry and the `tag` query parameter of its `ImageURI` (`None` when the task kept no
/// request, or it names neither).
pub fn redfish_task_flash(task: &serde_json::Value) -> Option<(String, String)> {
    // A string of JSON, as Redfish has it (some BMCs put the object itself).
    let body = &task["Payload"]["JsonBody"];
    let body: serde_json::Value = match body.as_str() {
        Some(text) => serde_json::from_str(text).ok()?,
        None => body.clone(),
    };
    let node = body["Targets"].as_array()?.first()?.as_str()?.rsplit('/').next()?.to_owned();
    let uri = body["ImageURI"].as_str()?;
    let query = uri.split_once('?')?.1;
    let tag = query.split('&').find_map(|p| p.strip_prefix("tag="))?;
    Some((node, tag.to_owned()))
}

/// The tag prefix of what `--plant-orphans` plants.
pub const PLANTED_PREFIX: &str = "faultline-planted-";

/// The `flash` tag and the operation id of a flash request's record (`None` for other records):
/// the sub-keys `flash` and `flash-op` of the record (`idempotency::derive`), the operation id
/// being `op-` and the first 16 hex digits of the latter, as leasebroker names it.
pub fn flash_keys(r: &leasebroker_client::Record) -> Option<(String, String)> {
    let endpoint = r.endpoint.as_str();
    if !(endpoint.starts_with("POST /admin/v1/nodes/") && endpoint.ends_with("/firmware")) {
        return None;
    }
    let record_id = idempotency::RecordId::from_hex(r.id.as_str())?;
    let key = idempotency::IdempotencyKey::parse_header(r.key.as_bytes()).ok()?;
    let scope = idempotency::Scope::new(
        idempotency::Principal::new(r.principal.as_str()),
        idempotency::Endpoint::from_stored(r.endpoint.as_str()),
        key,
    );
    let tag = idempotency::derive(&scope, &record_id, "flash").as_str().to_owned();
    let op = idempotency::derive(&scope, &record_id, "flash-op");
    let hex = op.as_str().trim_start_matches("sk-");
    Some((tag, format!("op-{}", &hex[..16.min(hex.len())])))
}

/// One checked invariant: `actual` must equal `expected`, or with `at_most` must not exceed it.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    /// What is checked.
    pub name: String,
    /// What it should be (or its upper bound).
    pub expected: u64,
    /// What it is.
    pub actual: u64,
    /// `expected` is an upper bound, not the exact value.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub at_most: bool,
    /// Whether they agree.
    pub ok: bool,
}

/// The damage counts of one run: all zero when idempotency held.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Damage {
    /// Workers the server has that no client was told about (beyond one per abandoned create).
    pub phantom_workers: u64,
    /// Workers a client holds that the server does not have (or answers differently about).
    pub lost_workers: u64,
    /// `leases_active - workers_active`.
    pub leaked_leases: i64,
    /// `nodes_allocated - workers_active`.
    pub leaked_nodes: i64,
    /// `VMs running - workers_active`.
    pub leaked_vms: i64,
    /// Boots of a tag that had been booted before.
    pub duplicate_boot_tags: u64,
    /// Boots beyond the workers clients were told they created and the creates they abandoned.
    pub extra_boots: i64,
    /// Reboots with a tag already in that VM's reboot tags.
    pub duplicate_reboot_tags: u64,
    /// Reboots beyond the reboot operations that succeeded or were abandoned.
    pub extra_reboots: i64,
    /// Workers whose `reboot_count` differs from the reboots that succeeded on them (beyond the
    /// abandoned ones), plus reboot answers that did.
    pub reboot_count_mismatches: u64,
    /// Create operations told the id of a worker another operation was told about.
    pub same_id_twice: u64,
    /// Workers whose delete did not succeed (existence unknown to the client; not counted above).
    pub delete_unknown: u64,
    /// Abandoned creates the server finished anyway (their worker is listed; not a phantom).
    pub abandoned_creates_finished: u64,
    /// Nodes a flash bricked (the BMC's count).
    pub bricked_nodes: u64,
    /// Tags the BMCs flashed more than once.
    pub duplicate_flash_tags: u64,
    /// Accepted flash operations that never ended.
    pub stuck_operations: u64,
    /// BMC flashes beyond one per accepted operation (and one per abandoned one).
    pub extra_flashes: i64,
    /// VMs the simulator runs that no worker runs on, once the inventory sweep had its time.
    pub vms_without_worker: u64,
    /// Flashes the BMCs hold that no operation owns (none, or one that did not succeed).
    pub flashes_without_operation: u64,
    /// Keys a success was answered for whose record is gone or no longer completed at the end.
    pub acknowledged_records_lost: u64,
    /// Accepted flash operations (`202`) that cannot be found at the end.
    pub acknowledged_flash_ops_lost: u64,
}

/// The create operation a listed worker belongs to, from its label.
fn op_of(worker: &Worker) -> Option<u64> {
    worker.labels.get(crate::workload::OP_LABEL)?.parse().ok()
}

/// The listed workers whose VM the hypervisor does not run, each with what the clients know of
/// it (for the report: a worker without its VM holds a node and a lease for nothing).
pub fn workers_without_vm(ledger: &Ledger, truth: &GroundTruth) -> Vec<String> {
    let mut out: Vec<String> = truth
        .workers
        .iter()
        .filter(|(_, (_, w))| w.vm_id.as_ref().is_none_or(|vm| !truth.vms.contains_key(vm)))
        .map(|(id, (_, w))| {
            let known = match ledger.workers.get(id) {
                Some(k) if k.delete_abandoned => "its delete was abandoned",
                Some(k) if k.delete_unknown => "its delete did not succeed",
                Some(_) => "held by a client",
                None => "no client knows it",
            };
            format!("{id} (vm {}): {known}", w.vm_id.as_deref().unwrap_or("none"))
        })
        .collect();
    out.sort();
    out
}

/// The flash invariants: no node bricked, no tag flashed twice, every accepted operation ended
/// (`succeeded` or `failed`, none left `running`), and one BMC flash per accepted operation (plus
/// at most one per abandoned one).
pub fn check_flashes(
    ledger: &Ledger,
    truth: &GroundTruth,
    operations: &[(OperationId, Option<Operation>)],
    damage: &mut Damage,
    invariants: &mut Vec<Invariant>,
) {
    let sim = &truth.sim;
    let accepted = ledger.flash_ops.len() as u64;
    let distinct: HashSet<&OperationId> = ledger.flash_ops.iter().collect();
    let stuck = operations.iter().filter(|(_, op)| !op.as_ref().is_some_and(Operation::is_finished)).count() as u64;
    damage.bricked_nodes = sim.bricked_nodes;
    damage.duplicate_flash_tags = sim.duplicate_flash_tags;
    damage.stuck_operations = stuck;
    damage.extra_flashes = (sim.flashes_total as i64 - (accepted + ledger.abandoned_flashes) as i64).max(0);
    let mut eq = |name: &str, expected: u64, actual: u64| {
        invariants.push(Invariant { name: name.to_owned(), expected, actual, at_most: false, ok: expected == actual });
    };
    eq("nodes bricked (a second flash while one wrote)", 0, sim.bricked_nodes);
    eq("duplicate_flash_tags", 0, sim.duplicate_flash_tags);
    eq("accepted flash operations not ended (stuck running)", 0, stuck);
    eq("flash ops told another op's operation id", 0, accepted - distinct.len() as u64);
    eq("fleet firmware_flashes_total == BMC flashes", sim.flashes_total, truth.fleet.firmware_flashes_total);
    // Each operation that succeeded flashed once; one the BMC refused (a 4xx) flashed nothing.
    let succeeded = operations
        .iter()
        .filter(|(_, op)| op.as_ref().is_some_and(|op| op.state == leasebroker_client::OperationState::Succeeded))
        .count() as u64;
    let high = accepted + ledger.abandoned_flashes;
    invariants.push(Invariant {
        name: "BMC flashes: one per succeeded flash op, at most one per accepted or abandoned one".to_owned(),
        expected: high,
        actual: sim.flashes_total,
        at_most: true,
        ok: (succeeded..=high).contains(&sim.flashes_total),
    });
}

/// The invariant "nothing runs that nobody owns" (SPEC 1.5): at the end, no VM without a worker
/// and no flash without an operation.
pub fn check_owners(
    vms_without_worker: &[String],
    flashes_without_operation: &[String],
    damage: &mut Damage,
    invariants: &mut Vec<Invariant>,
) {
    damage.vms_without_worker = vms_without_worker.len() as u64;
    damage.flashes_without_operation = flashes_without_operation.len() as u64;
    for (name, actual) in [
        ("nothing runs that nobody owns: VMs without a worker", damage.vms_without_worker),
        ("nothing runs that nobody owns: flashes without an operation", damage.flashes_without_operation),
    ] {
        invariants.push(Invariant { name: name.to_owned(), expected: 0, actual, at_most: false, ok: actual == 0 });
    }
}

/// Compares the ground truth with the clients' ledger.
pub fn check(
    ledger: &Ledger,
    truth: &GroundTruth,
    gets: &[(WorkerId, anyhow::Result<Option<Worker>>)],
    reboots_ok: u64,
    failed_ops: u64,
    late_boots: u64,
    on_libvirt: bool,
) -> (Damage, Vec<Invariant>) {
    let fleet = &truth.fleet;
    let sim = &truth.sim;
    let held = |k: &crate::workload::Known| !k.deleted && !k.delete_unknown;
    let known_active = ledger.workers.values().filter(|k| held(k)).count() as u64;
    let known_created = ledger.workers.len() as u64;
    let delete_unknown = ledger.workers.values().filter(|k| k.delete_unknown && !k.deleted).count() as u64;

    // A listed worker no client knows: the one worker of an abandoned create the server finished
    // anyway, or a phantom (a second worker for one operation, or one nobody asked for).
    let mut finished_abandoned: HashMap<u64, u64> = HashMap::new();
    let mut phantom_workers = 0;
    for (id, (_, w)) in &truth.workers {
        if ledger.workers.contains_key(id) {
            continue;
        }
        match op_of(w).filter(|op| ledger.abandoned_creates.contains(op)) {
            Some(op) => *finished_abandoned.entry(op).or_default() += 1,
            None => phantom_workers += 1,
        }
    }
    let abandoned_creates_finished = finished_abandoned.len() as u64;
    phantom_workers += finished_abandoned.values().map(|n| n - 1).sum::<u64>();

    let mut lost_workers = 0;
    let mut reboot_count_mismatches = ledger.reboot_count_mismatches;
    let mut listed_wrong = 0;
    let count_fits =
        |k: &crate::workload::Known, count: u64| (k.reboots_ok..=k.reboots_ok + k.reboots_abandoned).contains(&count);
    for (id, known) in ledger.workers.iter().filter(|(_, k)| held(k)) {
        match truth.workers.get(id) {
            Some((principal, w)) => {
                if *principal != known.principal {
                    listed_wrong += 1;
                }
                if !count_fits(known, w.reboot_count) {
                    reboot_count_mismatches += 1;
                }
            }
            None => lost_workers += 1,
        }
    }
    // A worker a client deleted must be gone.
    let deleted_but_listed =
        ledger.workers.iter().filter(|(id, k)| k.deleted && truth.workers.contains_key(*id)).count() as u64;
    let get_mismatches = gets
        .iter()
        .filter(|(id, got)| !matches!(got, Ok(Some(w)) if w.id == *id && ledger.workers.get(id).is_some_and(|k| count_fits(k, w.reboot_count))))
        .count() as u64;

    let abandoned_creates = ledger.abandoned_creates.len() as u64;
    let abandoned_reboots = ledger.abandoned_reboots;
    let diff = |a: u64, b: u64| a as i64 - b as i64;
    let damage = Damage {
        phantom_workers,
        lost_workers,
        leaked_leases: diff(fleet.leases_active, fleet.workers_active),
        leaked_nodes: diff(fleet.nodes_allocated, fleet.workers_active),
        leaked_vms: diff(sim.running, fleet.workers_active),
        duplicate_boot_tags: sim.duplicate_boot_tags,
        extra_boots: diff(sim.boots_total, known_created + abandoned_creates + late_boots).max(0),
        duplicate_reboot_tags: sim.duplicate_reboot_tags,
        extra_reboots: diff(sim.reboots_total, reboots_ok + abandoned_reboots).max(0),
        reboot_count_mismatches,
        same_id_twice: ledger.same_id_twice,
        delete_unknown,
        abandoned_creates_finished,
        bricked_nodes: 0,
        duplicate_flash_tags: 0,
        stuck_operations: 0,
        extra_flashes: 0,
        vms_without_worker: 0,
        flashes_without_operation: 0,
        acknowledged_records_lost: 0,
        acknowledged_flash_ops_lost: 0,
    };

    let mut invariants = Vec::new();
    let mut eq = |name: &str, expected: u64, actual: u64| {
        invariants.push(Invariant { name: name.to_owned(), expected, actual, at_most: false, ok: expected == actual });
    };
    eq("workers listed that no client created (phantoms)", 0, phantom_workers);
    // A worker whose delete did not succeed may or may not exist; the ones listed count as held.
    let unknown_listed = ledger
        .workers
        .iter()
        .filter(|(id, k)| k.delete_unknown && !k.deleted && truth.workers.contains_key(*id))
        .count() as u64;
    eq(
        "workers_active == created - deleted by clients (+ abandoned creates finished)",
        known_active + unknown_listed + abandoned_creates_finished,
        fleet.workers_active,
    );
    eq("workers a client holds that the server lacks", 0, lost_workers);
    eq("workers a client deleted that are still listed", 0, deleted_but_listed);
    eq("workers listed under another principal", 0, listed_wrong);
    eq("nodes_allocated == workers_active", fleet.workers_active, fleet.nodes_allocated);
    eq("leases_active == workers_active", fleet.workers_active, fleet.leases_active);
    if late_boots == 0 {
        eq("duplicate_boot_tags", 0, sim.duplicate_boot_tags);
    }
    eq("VMs running == workers_active", fleet.workers_active, sim.running);
    eq("fleet vms_running == workers_active", fleet.workers_active, fleet.vms_running);
    eq("duplicate_reboot_tags", 0, sim.duplicate_reboot_tags);
    eq("reboot_count mismatches", 0, reboot_count_mismatches);
    eq("ops told another op's worker id", 0, ledger.same_id_twice);
    eq("GET of each held worker returns it with its id", 0, get_mismatches);
    eq("operations that gave up or failed", 0, failed_ops);
    let mut within = |name: &str, low: u64, high: u64, actual: u64| {
        let exact = low == high;
        let ok = (low..=high).contains(&actual);
        invariants.push(Invariant { name: name.to_owned(), expected: high, actual, at_most: !exact, ok });
    };
    // An abandoned create booted at most once (its VM since rolled back, or kept with its worker).
    // A boot held past the settle window may land beside the one a retry made after the window
    // (a second VM of its tag, which the service destroys) or after its create was rolled back
    // (an orphan): at most one more boot and one more boot of a tag each.
    if on_libvirt {
        // A domain shows its boot by its `Started` event, which libvirt sends once the start has
        // completed. A create a retry adopted after a SIGKILL answers as soon as libvirt lists the
        // domain active, which it does from QEMU's launch on; a delete of that worker before the
        // start completed destroys it mid-start (libvirt logs `reason=failed`) and no `Started`
        // event ever comes. So fewer boots than workers created may be seen, never fewer than the
        // workers still held (their domains run), never more than one per create.
        within(
            "libvirt boots (Started) <= workers created (+ at most one per abandoned create), >= workers held",
            known_active,
            known_created + abandoned_creates,
            sim.boots_total,
        );
    } else if late_boots == 0 {
        within(
            "hypervisor boots == workers created (+ at most one per abandoned create)",
            known_created + abandoned_creates_finished,
            known_created + abandoned_creates,
            sim.boots_total,
        );
    } else {
        within("duplicate_boot_tags (at most one per late landing)", 0, late_boots, sim.duplicate_boot_tags);
        within(
            "hypervisor boots == workers created (+ at most one per abandoned create and per late landing)",
            known_created + abandoned_creates_finished,
            known_created + abandoned_creates + late_boots,
            sim.boots_total,
        );
    }
    if on_libvirt {
        // A reset leaves no trace but its event: a server killed after it recorded the reboot's
        // tag on the domain and before the reset reads the reboot as done on the retry (the
        // libvirt backend's documented "at most once"), so fewer resets than reboots may be.
        within(
            "libvirt resets <= successful reboot ops (+ at most one per abandoned reboot)",
            0,
            reboots_ok + abandoned_reboots,
            sim.reboots_total,
        );
    } else {
        within(
            "hypervisor reboots == successful reboot ops (+ at most one per abandoned reboot)",
            reboots_ok,
            reboots_ok + abandoned_reboots,
            sim.reboots_total,
        );
    }
    within(
        "fleet reboots_total == successful reboot ops (+ at most one per abandoned reboot)",
        reboots_ok,
        reboots_ok + abandoned_reboots,
        fleet.reboots_total,
    );
    (damage, invariants)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, vm: Option<&str>) -> Worker {
        serde_json::from_value(serde_json::json!({
            "id": id, "state": "running", "image": "i", "cpu": 1, "memory_gb": 1, "node_id": "node-0001",
            "lease_id": "lease-1", "vm_id": vm, "created_at": "2026-12-02T00:00:00Z",
        }))
        .expect("a worker")
    }

    #[test]
    fn a_vm_no_listed_worker_runs_on_is_unowned() {
        let fleet: Fleet = serde_json::from_value(serde_json::json!({
            "nodes_total": 1, "nodes_allocated": 0, "leases_active": 0, "workers_active": 2, "vms_running": 3,
            "vm_boots_total": 3, "reboots_total": 0,
        }))
        .expect("a fleet");
        let workers = [worker("wkr-a", Some("vm-1")), worker("wkr-b", None)]
            .into_iter()
            .map(|w| (w.id.clone(), (0, w)))
            .collect();
        let vms = [("vm-1", "sk-1"), ("vm-2", "sk-2"), ("vm-3", "faultline-planted-0")]
            .into_iter()
            .map(|(id, tag)| (id.to_owned(), tag.to_owned()))
            .collect();
        let truth = GroundTruth { fleet, sim: SimStats::default(), workers, server: ServerCounters::default(), vms };
        assert_eq!(truth.vms_without_worker(), ["vm-2 (sk-2)", "vm-3 (faultline-planted-0)"]);

        let (mut damage, mut invariants) = (Damage::default(), Vec::new());
        check_owners(&truth.vms_without_worker(), &[], &mut damage, &mut invariants);
        assert_eq!((damage.vms_without_worker, damage.flashes_without_operation), (2, 0));
        assert_eq!(invariants.iter().map(|i| (i.actual, i.ok)).collect::<Vec<_>>(), [(2, false), (0, true)]);
    }

    #[test]
    fn derives_a_flash_requests_tag_and_operation_from_its_record() {
        let record = |endpoint: &str| -> leasebroker_client::Record {
            serde_json::from_value(serde_json::json!({
                "id": "0123456789abcdef0123456789abcdef", "principal": "admin", "endpoint": endpoint,
                "key": "k-1", "state": "completed", "fingerprint": "sha256:00", "response_status": 202,
                "created_at": "x", "started_at": "x", "expires_at": "x",
            }))
            .expect("a record")
        };
        let flash = record("POST /admin/v1/nodes/node-0003/firmware");
        let (tag, op) = flash_keys(&flash).expect("a flash record");
        let scope = idempotency::Scope::new(
            idempotency::Principal::new("admin"),
            idempotency::Endpoint::new("POST", "/admin/v1/nodes/node-0003/firmware"),
            idempotency::IdempotencyKey::parse_header(b"k-1").expect("a key"),
        );
        let id = idempotency::RecordId::from_hex("0123456789abcdef0123456789abcdef").expect("an id");
        assert_eq!(tag, idempotency::derive(&scope, &id, "flash").as_str());
        let op_key = idempotency::derive(&scope, &id, "flash-op");
        assert_eq!(op, format!("op-{}", &op_key.as_str()[3..19]));
        assert_eq!(flash_keys(&record("POST /v1/workers")), None);
        assert_eq!(flash_keys(&record("POST /admin/v1/nodes/node-0003/reboot")), None);
    }

    #[test]
    fn an_acknowledged_key_whose_record_is_gone_or_not_completed_is_lost() {
        use crate::workload::Acknowledged;
        let ack = |key: &str| Acknowledged { key: key.to_owned(), what: format!("create op {key}") };
        let acknowledged = [ack("k1"), ack("k2"), ack("k3"), ack("k4")];
        let states: HashMap<String, String> = [("k1", "completed"), ("k3", "in_flight"), ("k4", "completed")]
            .into_iter()
            .map(|(k, s)| (k.to_owned(), s.to_owned()))
            .collect();
        let lost = records_lost(&acknowledged, &states);
        assert_eq!(lost, ["k2 (create op k2): gone", "k3 (create op k3): in_flight"]);

        let (mut damage, mut invariants) = (Damage::default(), Vec::new());
        check_acknowledged(lost.len() as u64, 0, &mut damage, &mut invariants);
        assert_eq!((damage.acknowledged_records_lost, damage.acknowledged_flash_ops_lost), (2, 0));
        assert_eq!(invariants.iter().map(|i| (i.actual, i.ok)).collect::<Vec<_>>(), [(2, false), (0, true)]);
        assert!(
            records_lost(
                &acknowledged,
                &[("k2", "completed"), ("k3", "completed")]
                    .into_iter()
                    .chain([("k1", "completed"), ("k4", "completed")])
                    .map(|(k, s)| (k.to_owned(), s.to_owned()))
                    .collect()
            )
            .is_empty()
        );
    }

    #[test]
    fn reads_the_node_and_tag_of_a_redfish_tasks_flash() {
        let body = r#"{"ImageURI":"http://firmware.invalid/images/fw-1?tag=sk-abc","Targets":["/redfish/v1/Systems/node-0003"]}"#;
        let task = serde_json::json!({"Id": "1", "Payload": {"JsonBody": body}});
        assert_eq!(redfish_task_flash(&task), Some(("node-0003".to_owned(), "sk-abc".to_owned())));
        let object =
            serde_json::json!({"Payload": {"JsonBody": serde_json::from_str::<serde_json::Value>(body).unwrap()}});
        assert_eq!(redfish_task_flash(&object), Some(("node-0003".to_owned(), "sk-abc".to_owned())));
        assert_eq!(redfish_task_flash(&serde_json::json!({"Id": "2"})), None, "a task without its request");
        let untagged = serde_json::json!({"Payload": {"JsonBody": r#"{"ImageURI":"http://x/fw","Targets":["/redfish/v1/Systems/1"]}"#}});
        assert_eq!(redfish_task_flash(&untagged), None);
    }

    #[test]
    fn reads_a_sample_by_name_and_labels() {
        let text = "# HELP leasebroker_reaper_rolled_back_total x\n\
                    leasebroker_reaper_rolled_back_total{resource=\"vm\"} 3\n\
                    leasebroker_reaper_rolled_back_total{resource=\"operation\"} 7\n\
                    leasebroker_refusals_released_total_other 9\n\
                    leasebroker_refusals_released_total 4\n";
        assert_eq!(sample(text, "leasebroker_reaper_rolled_back_total", "resource=\"operation\""), 7);
        assert_eq!(sample(text, "leasebroker_refusals_released_total", ""), 4);
        assert_eq!(sample(text, "leasebroker_duplicate_vms_destroyed_total", ""), 0);
    }
}
