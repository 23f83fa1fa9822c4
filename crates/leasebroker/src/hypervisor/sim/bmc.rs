//! The simulated BMCs (docs/protocol.md#firmware-operations): firmware flashes by tag, per node, under the same faults as the
//! hypervisor API.
//!
//! - `POST /v1/bmc/{node_id}/flash` `{"version", "tag"}` -> `202` (the node, `flashing`)
//! - `GET /v1/bmc/{node_id}` -> `200 {"node_id", "firmware", "state", "flash_tags"}`
//! - `GET /v1/bmc?tag=T` -> `200 {"nodes": [...]}`: the nodes whose `flash_tags` hold `T`
//!
//! A flash writes for the simulator's flash time ([`Simulator::with_flash_time`], `--flash-ms`,
//! default 3 s), then the node runs the new version. A flash that starts while another one
//! writes on the same node **bricks** it, for good: a duplicate flash cannot hide. Every node
//! exists (a node never flashed runs [`FACTORY_FIRMWARE`]).

use std::collections::HashMap;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::Simulator;
use super::problem::{json_rejection, problem};
use crate::hypervisor::api::{BmcList, BmcNode, BmcState, FlashRequest};

/// The firmware of a node never flashed.
pub const FACTORY_FIRMWARE: &str = "factory";

/// The longest version and tag accepted.
const MAX_FIELD: usize = 200;

/// The BMCs the simulator has seen, by node.
#[derive(Debug, Default)]
pub(super) struct Bmcs {
    nodes: HashMap<String, SimBmc>,
    /// Every flash tag ever started, on any node: a second start of one is a duplicate.
    flashed_tags: std::collections::HashSet<String>,
}

#[derive(Debug)]
struct SimBmc {
    node: BmcNode,
    /// Counts the flashes started, so a flash's timer only finishes its own flash.
    flash_seq: u64,
}

/// What a started flash needs to finish.
pub(super) struct Started {
    node: BmcNode,
    seq: u64,
    version: String,
}

impl Bmcs {
    fn node(&mut self, node_id: &str) -> &mut SimBmc {
        self.nodes.entry(node_id.to_owned()).or_insert_with(|| SimBmc {
            node: BmcNode {
                node_id: node_id.to_owned(),
                firmware: FACTORY_FIRMWARE.to_owned(),
                state: BmcState::Ok,
                flash_tags: Vec::new(),
            },
            flash_seq: 0,
        })
    }

    /// Starts a flash: the node writes (or, if it was writing already, is bricked).
    pub(super) fn start(
        &mut self,
        node_id: &str,
        req: FlashRequest,
        stats: &mut crate::hypervisor::SimStats,
    ) -> Started {
        stats.flashes_total += 1;
        if !self.flashed_tags.insert(req.tag.clone()) {
            stats.duplicate_flash_tags += 1;
        }
        let bmc = self.node(node_id);
        bmc.flash_seq += 1;
        bmc.node.flash_tags.push(req.tag);
        bmc.node.state = match bmc.node.state {
            BmcState::Ok => BmcState::Flashing,
            BmcState::Flashing | BmcState::Bricked => {
                if bmc.node.state == BmcState::Flashing {
                    stats.bricked_nodes += 1;
                    tracing::warn!(node_id, "hypervisor-sim: a second flash while one writes: node bricked");
                }
                BmcState::Bricked
            }
        };
        Started { node: bmc.node.clone(), seq: bmc.flash_seq, version: req.version }
    }

    /// Ends the flash `started` if it is still the node's current one and the node is not bricked:
    /// `Some(verified)` then, `None` when a second flash bricked the node meanwhile.
    pub(super) fn finish(&mut self, started: &Started, verified: bool) -> Option<bool> {
        let bmc = self.node(&started.node.node_id);
        if bmc.flash_seq == started.seq && bmc.node.state == BmcState::Flashing {
            bmc.node.state = BmcState::Ok;
            if verified {
                bmc.node.firmware.clone_from(&started.version);
            } else {
                tracing::info!(node_id = %started.node.node_id, "hypervisor-sim: a flash failed its verification");
            }
            return Some(verified);
        }
        None
    }

    /// A node as it is now.
    pub(super) fn get(&mut self, node_id: &str) -> BmcNode {
        self.node(node_id).node.clone()
    }

    /// The nodes whose flash tags hold `tag`, by node id.
    pub(super) fn with_tag(&self, tag: &str) -> Vec<BmcNode> {
        let mut nodes: Vec<BmcNode> = self
            .nodes
            .values()
            .filter(|b| b.node.flash_tags.iter().any(|t| t == tag))
            .map(|b| b.node.clone())
            .collect();
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        nodes
    }
}

pub(super) fn validate(node_id: &str, req: &FlashRequest) -> Result<(), String> {
    if node_id.is_empty() || node_id.len() > MAX_FIELD {
        return Err(format!("node_id must be 1-{MAX_FIELD} characters"));
    }
    if req.version.trim().is_empty() || req.version.len() > MAX_FIELD {
        return Err(format!("version must be 1-{MAX_FIELD} characters"));
    }
    if req.tag.len() > MAX_FIELD {
        return Err(format!("tag must be at most {MAX_FIELD} characters"));
    }
    Ok(())
}

/// `POST /v1/bmc/{node_id}/flash`.
pub(super) async fn flash(
    State(sim): State<Simulator>,
    headers: axum::http::HeaderMap,
    node_id: Result<Path<String>, PathRejection>,
    body: Result<Json<FlashRequest>, JsonRejection>,
) -> Response {
    let Path(node_id) = match node_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    let Json(req) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    if let Err(detail) = validate(&node_id, &req) {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-request", &detail);
    }
    // The write is scheduled with the start, inside the simulator's work: it runs on whatever
    // the caller does, even when the answer is dropped (a fail-after fault) or the caller hangs
    // up before it.
    let writer = sim.clone();
    let flash_time = sim.flash_time();
    let verified = !super::roll(sim.flash_failure());
    let keyed = Simulator::keyed_by(&headers, &req.tag);
    let node = match sim
        .mutate(move |state| {
            state.stats.tag_keyed_calls += u64::from(keyed);
            let started = state.bmcs.start(&node_id, req, &mut state.stats);
            let node = started.node.clone();
            tokio::spawn(async move {
                tokio::time::sleep(flash_time).await;
                let _ = writer.state().bmcs.finish(&started, verified);
            });
            node
        })
        .await
    {
        Ok(node) => node,
        Err(response) => return response,
    };
    (StatusCode::ACCEPTED, Json(node)).into_response()
}

/// `GET /v1/bmc/{node_id}`.
pub(super) async fn get(State(sim): State<Simulator>, node_id: Result<Path<String>, PathRejection>) -> Response {
    match node_id {
        Ok(Path(node_id)) => Json(sim.state().bmcs.get(&node_id)).into_response(),
        Err(rejection) => problem(rejection.status(), "invalid-path", &rejection.body_text()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TagQuery {
    tag: String,
}

/// `GET /v1/bmc?tag=T`.
pub(super) async fn list(State(sim): State<Simulator>, query: Result<Query<TagQuery>, QueryRejection>) -> Response {
    match query {
        Ok(Query(q)) => Json(BmcList { nodes: sim.state().bmcs.with_tag(&q.tag) }).into_response(),
        Err(rejection) => problem(StatusCode::BAD_REQUEST, "invalid-query", &rejection.body_text()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::{Value, json};

    use super::*;
    use crate::hypervisor::SimConfig;

    use super::super::tests::serve_on_loopback as start;

    async fn flash(url: &str, node: &str, version: &str, tag: &str) -> (u16, Value) {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/bmc/{node}/flash"))
            .json(&json!({"version": version, "tag": tag}))
            .send()
            .await
            .expect("flash");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn node(url: &str, node: &str) -> Value {
        reqwest::get(format!("{url}/v1/bmc/{node}")).await.expect("get").json().await.expect("json")
    }

    /// A flash whose answer is lost (fail-after) still writes to its end: the node does not stay
    /// `flashing` for ever because nobody heard the 202.
    #[tokio::test]
    async fn a_flash_whose_answer_is_lost_still_finishes() {
        let faults = SimConfig { fail_after: 1.0, ..SimConfig::default() };
        let sim = Simulator::new(faults).with_flash_time(Duration::from_millis(200));
        let url = start(&sim).await;
        let sent = reqwest::Client::new()
            .post(format!("{url}/v1/bmc/node-0009/flash"))
            .json(&json!({"version": "4.0.0", "tag": "sk-lost"}))
            .send()
            .await;
        assert!(sent.is_err(), "the answer was dropped: {sent:?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let done = node(&url, "node-0009").await;
        assert_eq!((done["state"].as_str(), done["firmware"].as_str()), (Some("ok"), Some("4.0.0")), "{done}");
    }

    #[tokio::test]
    async fn a_flash_writes_then_the_node_runs_the_new_version() {
        let sim = Simulator::new(SimConfig::default()).with_flash_time(Duration::from_millis(300));
        let url = start(&sim).await;
        assert_eq!(node(&url, "node-0001").await["firmware"], FACTORY_FIRMWARE);
        let (status, body) = flash(&url, "node-0001", "2.1.0", "sk-a").await;
        assert_eq!((status, body["state"].as_str()), (202, Some("flashing")), "{body}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let done = node(&url, "node-0001").await;
        assert_eq!((done["state"].as_str(), done["firmware"].as_str()), (Some("ok"), Some("2.1.0")), "{done}");
        assert_eq!(done["flash_tags"], json!(["sk-a"]));
        let listed: Value =
            reqwest::get(format!("{url}/v1/bmc?tag=sk-a")).await.expect("list").json().await.expect("json");
        assert_eq!(listed["nodes"].as_array().map(Vec::len), Some(1), "{listed}");
        let stats = sim.stats();
        assert_eq!((stats.flashes_total, stats.duplicate_flash_tags, stats.bricked_nodes), (1, 0, 0));
    }

    #[tokio::test]
    async fn a_second_flash_while_one_writes_bricks_the_node_for_good() {
        let sim = Simulator::new(SimConfig::default()).with_flash_time(Duration::from_millis(300));
        let url = start(&sim).await;
        assert_eq!(flash(&url, "node-0002", "2.1.0", "sk-b").await.0, 202);
        let (status, body) = flash(&url, "node-0002", "2.1.0", "sk-b").await;
        assert_eq!((status, body["state"].as_str()), (202, Some("bricked")), "{body}");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let after = node(&url, "node-0002").await;
        assert_eq!((after["state"].as_str(), after["firmware"].as_str()), (Some("bricked"), Some(FACTORY_FIRMWARE)));
        // One after another is fine on another node.
        assert_eq!(flash(&url, "node-0003", "2.1.0", "sk-c").await.0, 202);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(flash(&url, "node-0003", "2.2.0", "sk-d").await.1["state"], "flashing");
        let stats = sim.stats();
        assert_eq!((stats.flashes_total, stats.duplicate_flash_tags, stats.bricked_nodes), (4, 1, 1));
    }

    #[tokio::test]
    async fn faults_apply_to_flashes_and_bad_input_changes_nothing() {
        let sim = Simulator::new(SimConfig { refuse: 1.0, ..SimConfig::default() });
        let url = start(&sim).await;
        assert_eq!(flash(&url, "node-0004", "2.1.0", "sk-e").await.0, 409);
        sim.set_faults(SimConfig { fail_before: 1.0, ..SimConfig::default() });
        assert_eq!(flash(&url, "node-0004", "2.1.0", "sk-e").await.0, 503);
        sim.set_faults(SimConfig::default());
        assert_eq!(flash(&url, "node-0004", "", "sk-e").await.0, 422);
        let raw = reqwest::Client::new()
            .post(format!("{url}/v1/bmc/node-0004/flash"))
            .header("content-type", "application/json")
            .body("{\"version\": \"1\"")
            .send()
            .await
            .expect("send");
        assert_eq!(raw.status().as_u16(), 400);
        assert_eq!(node(&url, "node-0004").await["flash_tags"], json!([]));
        assert_eq!(sim.stats().flashes_total, 0);
    }
}
