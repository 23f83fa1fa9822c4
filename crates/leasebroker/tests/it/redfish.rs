//! Issue 27: firmware flashes through a Redfish BMC (SPEC 3.3a). The real binary with
//! `--bmc-url redfish+http://...` against a standalone `hypervisor-sim --bmc redfish` (whose
//! machines brick when flashed while flashing), in the scenarios of `flashes`; flashes are counted
//! from ground truth: the simulator's stats, its tasks and its firmware inventory.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{ADMIN, Proc, Reply, fleet, http, send, serve, set_faults, sim, sim_stats, sqlite_url};

const POLL: [&str; 2] = ["--operation-poll", "100ms"];

/// `hypervisor-sim --bmc redfish` with 16 systems (the pool of `support::serve`).
fn redfish_sim(extra: &[&str]) -> Proc {
    sim(&[&["--bmc", "redfish", "--redfish-systems", "16"], extra].concat())
}

/// leasebroker with its VMs on `hv`'s hypervisor API and its flashes on `hv`'s Redfish service.
fn broker(db: &str, hv: &Proc, extra: &[&str]) -> Proc {
    let bmc = format!("redfish+{}", hv.url);
    serve(db, &[&["--hypervisor-url", hv.url.as_str(), "--bmc-url", bmc.as_str(), POLL[0], POLL[1]], extra].concat())
}

async fn flash(base: &str, node: &str, key: &str, version: &str) -> Reply {
    let url = format!("{base}/admin/v1/nodes/{node}/firmware");
    send(Method::POST, &url, ADMIN, Some(key), Some(&json!({"version": version}))).await
}

/// Flashes like a client that retries with one key: past `409 request-in-progress` and `503`.
async fn flash_until_answered(base: &str, node: &str, key: &str, version: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = flash(base, node, key, version).await;
        let retry = r.status == StatusCode::SERVICE_UNAVAILABLE
            || (r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress");
        if !retry || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the operation until it is no longer `running` (or 60 s passed); returns it.
async fn until_ended(base: &str, op_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let op = send(Method::GET, &format!("{base}/admin/v1/operations/{op_id}"), ADMIN, None, None).await.json();
        if op["state"] != "running" || Instant::now() > deadline {
            return op;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn redfish_get(sim: &str, path: &str) -> Value {
    http().get(format!("{sim}{path}")).send().await.expect("redfish").json().await.expect("json")
}

/// The firmware version the simulator's inventory shows for machine `id`.
async fn version(sim: &str, id: &str) -> Value {
    redfish_get(sim, &format!("/redfish/v1/UpdateService/FirmwareInventory/{id}")).await["Version"].clone()
}

/// The request bodies of the simulator's tasks (it keeps them unless `--redfish-no-payload`).
async fn task_bodies(sim: &str) -> Vec<Value> {
    let tasks = redfish_get(sim, "/redfish/v1/TaskService/Tasks").await;
    let mut bodies = vec![];
    for member in tasks["Members"].as_array().expect("members") {
        let task = redfish_get(sim, member["@odata.id"].as_str().expect("id")).await;
        let body = task["Payload"]["JsonBody"].as_str().map(|b| serde_json::from_str(b).expect("json body"));
        bodies.push(body.unwrap_or(Value::Null));
    }
    bodies
}

/// The flashes the simulator's BMCs took, the duplicates among them, and the nodes bricked.
async fn flashes_and_bricked(sim: &str) -> (i64, i64, i64) {
    let s = sim_stats(sim).await;
    (
        s["flashes_total"].as_i64().unwrap_or(-1),
        s["duplicate_flash_tags"].as_i64().unwrap_or(-1),
        s["bricked_nodes"].as_i64().unwrap_or(-1),
    )
}

fn op_id(reply: &Reply) -> String {
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&reply.body));
    reply.json()["id"].as_str().expect("id").to_owned()
}

#[tokio::test]
async fn a_flash_goes_through_simple_update_and_a_retry_replays_the_202() {
    let hv = redfish_sim(&["--flash-ms", "2000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &[]);

    let first = flash(&lb.url, "node-0003", "rf-1", "2.4.1").await;
    let op_id = op_id(&first);
    assert_eq!(first.json()["state"], "running");
    let retry = flash(&lb.url, "node-0003", "rf-1", "2.4.1").await;
    assert!(retry.replayed() && retry.status == StatusCode::ACCEPTED && retry.body == first.body, "the same 202");

    // What reached the BMC: one SimpleUpdate naming the node's system, the tag in the image URI.
    let bodies = task_bodies(&hv.url).await;
    assert_eq!(bodies.len(), 1, "{bodies:?}");
    assert_eq!(bodies[0]["Targets"], json!(["/redfish/v1/Systems/node-0003"]), "{}", bodies[0]);
    let image = bodies[0]["ImageURI"].as_str().expect("ImageURI");
    assert!(image.contains("/2.4.1?tag="), "{image}");

    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!((ended["state"].as_str(), &ended["error"]), (Some("succeeded"), &Value::Null), "{ended}");
    assert_eq!(version(&hv.url, "node-0003").await, "2.4.1");
    assert_eq!(redfish_get(&hv.url, "/redfish/v1/TaskService/Tasks/1").await["TaskState"], "Completed");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));
    let f = fleet(&lb.url).await;
    assert_eq!((f["firmware_flashes_total"].as_i64(), f["nodes_bricked"].as_i64()), (Some(1), Some(0)), "{f}");
    let after = flash(&lb.url, "node-0003", "rf-1", "2.4.1").await;
    assert!(after.replayed() && after.body == first.body, "a retry after the end replays the 202 too");
}

#[tokio::test]
async fn thirty_two_concurrent_requests_with_one_key_give_one_redfish_flash() {
    let hv = redfish_sim(&["--flash-ms", "1500", "--latency-ms", "200"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &[]);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let base = lb.url.clone();
            tokio::spawn(async move { flash_until_answered(&base, "node-0005", "rf-32", "3.0.0").await })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        ids.insert(op_id(&t.await.expect("task")));
    }
    assert_eq!(ids.len(), 1, "one operation: {ids:?}");
    let op_id = ids.pop_first().expect("one");
    assert_eq!(until_ended(&lb.url, &op_id).await["state"], "succeeded");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "one flash, no machine bricked");
}

#[tokio::test]
async fn a_different_key_on_a_flashing_node_is_refused_without_reaching_the_redfish_bmc() {
    let hv = redfish_sim(&["--flash-ms", "1500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &[]);
    let first = op_id(&flash(&lb.url, "node-0002", "rf-a", "1.1.0").await);

    let other = flash(&lb.url, "node-0002", "rf-b", "1.2.0").await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&other.body));
    assert_eq!(other.problem_type(), "operation-conflict");
    assert_eq!(other.json()["operation_id"], first.as_str());
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "the second key never reached the BMC");

    assert_eq!(until_ended(&lb.url, &first).await["state"], "succeeded");
    let later = op_id(&flash_until_answered(&lb.url, "node-0002", "rf-c", "1.2.0").await);
    assert_eq!(until_ended(&lb.url, &later).await["state"], "succeeded");
    assert_eq!(version(&hv.url, "node-0002").await, "1.2.0");
    assert_eq!(flashes_and_bricked(&hv.url).await, (2, 0, 0));
}

/// The BMC takes the flash and the answer is lost: the retry finds the task by the tag in its
/// payload, and the flash is not sent again.
#[tokio::test]
async fn a_lost_answer_is_found_by_its_tag_and_flashed_once() {
    let hv = redfish_sim(&["--flash-ms", "1500", "--fail-after", "1.0"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &[]);
    let first = flash(&lb.url, "node-0004", "rf-lost", "4.0.0").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "the BMC took it; its answer was lost");

    let retry = flash_until_answered(&lb.url, "node-0004", "rf-lost", "4.0.0").await;
    let op_id = op_id(&retry);
    assert_eq!(until_ended(&lb.url, &op_id).await["state"], "succeeded");
    assert_eq!(version(&hv.url, "node-0004").await, "4.0.0");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "found by tag, never sent again");
}

/// A BMC that keeps no task payload: the lost answer is settled from the firmware inventory once
/// the settle window has passed and no task runs, never by sending again. The flash writes longer
/// than the settle window: read at the window's end, the inventory would not show the version yet.
#[tokio::test]
async fn without_payloads_a_lost_answer_is_settled_by_the_firmware_inventory() {
    let hv = redfish_sim(&["--flash-ms", "5000", "--fail-after", "1.0", "--redfish-no-payload"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &["--hypervisor-timeout", "1s", "--hypervisor-settle", "3s"]);
    let sent = Instant::now();
    let first = flash(&lb.url, "node-0006", "rf-nopayload", "6.1.0").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&first.body));
    assert_eq!(task_bodies(&hv.url).await, [Value::Null], "the task keeps no payload");

    let early = flash(&lb.url, "node-0006", "rf-nopayload", "6.1.0").await;
    assert_eq!(early.status, StatusCode::SERVICE_UNAVAILABLE, "within the settle window nothing is concluded");
    assert!(early.headers.contains_key("retry-after"));

    let answered = flash_until_answered(&lb.url, "node-0006", "rf-nopayload", "6.1.0").await;
    assert!(sent.elapsed() >= Duration::from_secs(3), "concluded only after the settle window");
    let op_id = op_id(&answered);
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!((ended["state"].as_str(), &ended["error"]), (Some("succeeded"), &Value::Null), "{ended}");
    assert_eq!(version(&hv.url, "node-0006").await, "6.1.0");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "sent once");
}

/// The send was stamped and its fate unknown, and it never landed: with no payload to search
/// and the version absent from the inventory, the operation fails, and the flash is never sent
/// again (the BMC takes flashes again by then, so a second send would show).
#[tokio::test]
async fn a_stamped_flash_that_never_landed_fails_by_the_inventory_and_is_not_resent() {
    let hv = redfish_sim(&["--flash-ms", "500", "--fail-before", "1.0", "--redfish-no-payload"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &["--hypervisor-timeout", "1s", "--hypervisor-settle", "2s"]);
    let first = flash(&lb.url, "node-0007", "rf-never", "7.0.0").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "a 503 from the BMC is ambiguous");
    set_faults(&hv.url, 0.0, 0.0, 0).await;

    let answered = flash_until_answered(&lb.url, "node-0007", "rf-never", "7.0.0").await;
    let op_id = op_id(&answered);
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!(ended["state"], "failed", "{ended}");
    assert!(ended["error"].as_str().is_some_and(|e| e.contains("does not run the version")), "{ended}");
    assert_eq!(flashes_and_bricked(&hv.url).await, (0, 0, 0), "never sent again");
    assert_eq!(version(&hv.url, "node-0007").await, "factory");
}

#[tokio::test]
async fn sigkill_during_a_redfish_flash_then_restart_the_watcher_finds_the_task_by_tag() {
    let hv = redfish_sim(&["--flash-ms", "3000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let mut lb = broker(&db, &hv, &[]);
    let first = flash(&lb.url, "node-0008", "rf-kill", "8.0.0").await;
    let op_id = op_id(&first);
    tokio::time::sleep(Duration::from_millis(500)).await; // its watcher holds the operation
    lb.sigkill();

    let lb = broker(&db, &hv, &[]);
    let retry = flash(&lb.url, "node-0008", "rf-kill", "8.0.0").await;
    assert!(retry.replayed() && retry.body == first.body, "the 202 survived the kill");
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    assert_eq!(version(&hv.url, "node-0008").await, "8.0.0");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));
}

/// Killed while `SimpleUpdate` is on its way (the BMC takes it after a latency): the restarted
/// process's retry finds the stamped flash pending, and finds its task by tag instead of sending.
#[tokio::test]
async fn sigkill_while_simple_update_is_in_flight_then_a_retry_flashes_once() {
    let hv = redfish_sim(&["--flash-ms", "1000", "--latency-ms", "1500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let args = ["--in-flight-ttl", "1s", "--hypervisor-timeout", "3s", "--hypervisor-settle", "4s"];
    let mut lb = broker(&db, &hv, &args);
    let base = lb.url.clone();
    let pending = tokio::spawn(async move { flash(&base, "node-0012", "rf-midcall", "12.0.0").await });
    tokio::time::sleep(Duration::from_millis(700)).await; // the SimpleUpdate is on its way
    lb.sigkill();
    let _ = pending.await;

    let lb = broker(&db, &hv, &args);
    let op_id = op_id(&flash_until_answered(&lb.url, "node-0012", "rf-midcall", "12.0.0").await);
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!(ended["state"], "succeeded", "{ended}");
    assert_eq!(version(&hv.url, "node-0012").await, "12.0.0");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "one flash, never a second one");
}

/// A BMC that answers `204` with the task's `Location` and no body, and one that serves a single
/// machine (flashed without `Targets`).
#[tokio::test]
async fn a_terse_bmc_and_a_one_machine_bmc_are_flashed_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let terse = redfish_sim(&["--flash-ms", "500", "--redfish-terse"]);
    let lb = broker(&sqlite_url(&dir), &terse, &[]);
    let op = op_id(&flash(&lb.url, "node-0009", "rf-terse", "9.0.0").await);
    assert_eq!(until_ended(&lb.url, &op).await["state"], "succeeded");
    assert_eq!(version(&terse.url, "node-0009").await, "9.0.0");
    drop(lb);

    let single = sim(&["--bmc", "redfish", "--redfish-one-machine", "--flash-ms", "500"]);
    let lb = broker(&sqlite_url(&dir), &single, &[]);
    let op = op_id(&flash(&lb.url, "node-0010", "rf-single", "10.0.0").await);
    assert_eq!(until_ended(&lb.url, &op).await["state"], "succeeded");
    let bodies = task_bodies(&single.url).await;
    assert_eq!(bodies.len(), 1);
    assert!(bodies[0].get("Targets").is_none(), "one machine: no Targets: {}", bodies[0]);
    assert_eq!(version(&single.url, "1").await, "10.0.0");
    assert_eq!(flashes_and_bricked(&single.url).await, (1, 0, 0));
}

/// A node that already runs the version is not flashed again: its operation succeeds at once.
#[tokio::test]
async fn a_node_already_at_the_version_is_done_without_a_flash() {
    let hv = redfish_sim(&["--flash-ms", "500"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &[]);
    let op = op_id(&flash(&lb.url, "node-0011", "rf-v1", "11.0.0").await);
    assert_eq!(until_ended(&lb.url, &op).await["state"], "succeeded");

    let again = flash_until_answered(&lb.url, "node-0011", "rf-v1-again", "11.0.0").await;
    assert_eq!(op_id(&again).len(), op.len());
    assert_eq!(again.json()["state"], "succeeded", "{}", again.json());
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "no second flash");
}
