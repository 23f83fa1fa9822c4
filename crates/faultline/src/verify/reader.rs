//! The direct reads: the counters, waiting until they settle, the ground truth (fleet, workers,
//! the replicas' metrics, the VMs), the operations until they end and each worker as its
//! principal sees it.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, anyhow};
use futures::StreamExt;
use leasebroker_client::{Fleet, Operation, OperationId, Worker, WorkerId, WorkerPage};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use super::{GroundTruth, ServerCounters, SimStats};
use crate::cluster::{ADMIN_TOKEN, Principal};

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
    pub(super) http: reqwest::Client,
    pub(super) replicas: Vec<String>,
    pub(super) vms: Vms,
    /// `None` when the BMCs are the servers' in-process ones (`--libvirt` without `--bmc
    /// redfish`): no flashes are run then.
    pub(super) bmcs: Option<Bmcs>,
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

    /// GETs `url` as JSON, retrying a few times on errors (the servers have no injected faults
    /// here, but one may still be coming back from the last kill). `Ok(None)` on a 404.
    pub(super) async fn get<T: DeserializeOwned>(&self, url: &str, token: &str) -> anyhow::Result<Option<T>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
