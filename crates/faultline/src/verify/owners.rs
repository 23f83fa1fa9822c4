//! "Nothing runs that nobody owns" (docs/protocol.md#side-effects): the flashes no operation owns (the VMs without a
//! worker are `GroundTruth::vms_without_worker`), the orphans `--plant-orphans` plants to check
//! the checker, and the invariant.

use std::collections::HashMap;
use std::time::Duration;

use leasebroker_client::Operation;

use super::{Damage, Invariant, Reader, Vms};
use crate::cluster::ADMIN_TOKEN;

impl Reader {
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
        let owners: HashMap<String, String> = self.all_records().await?.iter().filter_map(flash_keys).collect();
        let mut out = Vec::new();
        for (node, tag) in flashed {
            let owned = match owners.get(&tag) {
                Some(op) => self
                    .get::<Operation>(&format!("{}/admin/v1/operations/{op}", self.replicas[0]), ADMIN_TOKEN)
                    .await?
                    .is_some_and(|op| {
                        // An uncertain operation holds its flash too, until an operator resolves it.
                        matches!(
                            op.state,
                            leasebroker_client::OperationState::Succeeded
                                | leasebroker_client::OperationState::Running
                                | leasebroker_client::OperationState::Uncertain
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

/// The invariant "nothing runs that nobody owns" (docs/protocol.md#side-effects): at the end, no VM without a worker
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

#[cfg(test)]
mod tests {
    use leasebroker_client::{Fleet, Worker};

    use super::*;
    use crate::verify::{GroundTruth, ServerCounters, SimStats};

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
                "created_at": "2026-11-30T22:14:07.000000Z", "started_at": "2026-11-30T22:14:07.000000Z",
                "expires_at": "2026-12-01T22:14:07.000000Z",
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
}
