//! The flash invariants, and the flashes the BMCs hold: the native API's tags, or the Redfish
//! tasks' requests.

use std::collections::HashSet;

use anyhow::anyhow;
use futures::StreamExt;
use leasebroker_client::{Operation, OperationId};
use serde::Deserialize;

use super::{Damage, GroundTruth, Invariant, Reader};
use crate::workload::Ledger;

impl Reader {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
