//! Issue 27: firmware flashes through a Redfish BMC (docs/protocol.md#real-downstreams). The real binary with
//! `--bmc-url redfish+http://...` against a standalone `hypervisor-sim --bmc redfish` (whose
//! machines brick when flashed while flashing), in the scenarios of `flashes`; flashes are counted
//! from ground truth: the simulator's stats, its tasks and its firmware inventory.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::flashes::{flash, flash_until_answered, flashes_and_bricked, operation, until_ended};
use crate::support::{
    ADMIN, Proc, Reply, TOKEN, fleet, http, send, serve, serve_with_env, set_faults, sim, sqlite_url,
};

const POLL: [&str; 2] = ["--operation-poll", "100ms"];

/// `hypervisor-sim --bmc redfish` with 16 systems (the pool of `support::serve`).
fn redfish_sim(extra: &[&str]) -> Proc {
    sim(&[&["--bmc", "redfish", "--redfish-systems", "16"], extra].concat())
}

/// leasebroker with its VMs on `hv`'s hypervisor API and its flashes on `hv`'s Redfish service.
fn broker(db: &str, hv: &Proc, extra: &[&str]) -> Proc {
    broker_with_env(db, hv, extra, &[])
}

/// [`broker`] with `env` set.
fn broker_with_env(db: &str, hv: &Proc, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let bmc = format!("redfish+{}", hv.url);
    let args = [&["--hypervisor-url", hv.url.as_str(), "--bmc-url", bmc.as_str(), POLL[0], POLL[1]], extra].concat();
    serve_with_env(db, &args, env)
}

/// A BMC shaped like sushy-tools': `204` with the task's `Location`, no task payload, no task
/// list and no firmware inventory.
const SUSHY_LIKE: [&str; 4] =
    ["--redfish-terse", "--redfish-no-payload", "--redfish-no-task-list", "--redfish-no-inventory"];

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

/// OpenStack's sushy-tools emulator (a Redfish BMC this client did not come with), with its
/// libvirt driver on libvirt's in-process `test://` driver (no daemon): one machine, named like
/// the node. It wants `Targets`, answers `SimpleUpdate` with `204` and the `Location` of a task
/// that reads `Completed`/`OK`, and serves no task list and no firmware inventory. Its access log
/// is the ground truth: one `SimpleUpdate`, whatever the retries.
#[tokio::test]
async fn sushy_tools_takes_a_flash_once() {
    let Some(emulator) = sushy_emulator() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let node = dir.path().join("node.xml");
    std::fs::write(
        &node,
        "<node><domain type='test'><name>node-0001</name><uuid>6695eb01-f6a4-8304-79aa-97f2502e193f</uuid>\
         <memory>32768</memory><vcpu>1</vcpu><os><type arch='x86_64'>hvm</type>\
         <loader type='rom'>/usr/share/OVMF/OVMF_CODE.fd</loader></os></domain></node>",
    )
    .expect("node.xml");
    let config = dir.path().join("sushy.conf");
    std::fs::write(&config, "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = 0\n").expect("conf");
    let bmc = Sushy::start(&emulator, &config, &format!("test://{}", node.display()));

    let hv = sim(&[]);
    let lb = serve(
        &sqlite_url(&dir),
        &["--hypervisor-url", &hv.url, "--bmc-url", &format!("redfish+{}", bmc.url), POLL[0], POLL[1]],
    );
    let first = flash(&lb.url, "node-0001", "sushy-1", "1.1.0").await;
    let op_id = op_id(&first);
    let retry = flash(&lb.url, "node-0001", "sushy-1", "1.1.0").await;
    assert!(retry.replayed() && retry.body == first.body, "the same 202");
    let ended = until_ended(&lb.url, &op_id).await;
    assert_eq!((ended["state"].as_str(), &ended["error"]), (Some("succeeded"), &Value::Null), "{ended}");
    // The emulator writes each request's log line after it has answered, and the test reads
    // its output from a pipe: the last lines may come a moment after the operation ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = bmc.log();
        if log.contains("GET /redfish/v1/TaskService/Tasks/42") || Instant::now() > deadline {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let updates: Vec<&str> = log.lines().filter(|l| l.contains("POST /redfish/v1/UpdateService/Actions/")).collect();
    assert_eq!(updates.len(), 1, "one SimpleUpdate:\n{log}");
    assert!(updates[0].contains(" 204 "), "{}", updates[0]);
    assert!(log.contains("GET /redfish/v1/TaskService/Tasks/42"), "the task was followed:\n{log}");
}

/// The sushy-tools emulator: `$SUSHY_EMULATOR`, or the one `scripts/install-test-tools sushy` puts
/// under target/tools; `None` after a loud SKIPPED line (a failure under `CI=true`).
fn sushy_emulator() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("SUSHY_EMULATOR").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/sushy/bin/sushy-emulator")
    });
    if path.is_file() {
        return Some(path);
    }
    let message = format!(
        "the sushy-tools emulator is missing at {} (scripts/install-test-tools sushy installs it)",
        path.display()
    );
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
    eprintln!("SKIPPED: {message}");
    None
}

/// A running sushy-emulator, killed when dropped, with its log (stderr: the access log).
struct Sushy {
    child: std::process::Child,
    url: String,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Sushy {
    fn start(emulator: &std::path::Path, config: &std::path::Path, libvirt_uri: &str) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(emulator)
            .args(["--config", &config.display().to_string(), "--libvirt-uri", libvirt_uri])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start sushy-emulator");
        let stderr = child.stderr.take().expect("stderr");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("Running on http://") {
                    let _ = tx.send(line[i + "Running on ".len()..].trim().to_owned());
                }
                let mut log = sink.lock().expect("log");
                log.push_str(&line);
                log.push('\n');
            }
        });
        let url = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("sushy-emulator did not report its address:\n{}", log.lock().expect("log"))
        });
        Sushy { child, url, log }
    }

    fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }
}

impl Drop for Sushy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two replicas on one PostgreSQL database and one Redfish BMC: eight flashes, each watched by
/// one replica once; a node already at its version ends at once with no flash (the send stamp's
/// compare-and-set on PostgreSQL).
#[tokio::test]
async fn two_replicas_on_postgres_flash_through_redfish_once_each() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv = redfish_sim(&["--flash-ms", "1500"]);
    let a = broker(pg.url(), &hv, &[]);
    let b = broker(pg.url(), &hv, &[]);
    let mut ops = vec![];
    for i in 0..8 {
        let base = if i % 2 == 0 { &a.url } else { &b.url };
        let node = format!("node-{:04}", i + 1);
        ops.push(op_id(&flash_until_answered(base, &node, &format!("rf-replica-{i}"), "7.0.0").await));
    }
    for op_id in &ops {
        assert_eq!(until_ended(&a.url, op_id).await["state"], "succeeded", "{op_id}");
    }
    let mut watches = 0.0;
    for base in [&a.url, &b.url] {
        let text = http().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
        watches += text
            .lines()
            .filter(|l| l.starts_with("leasebroker_operation_watches_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    assert_eq!(watches, 8.0, "each operation was taken up by one watcher, once");
    let again = flash_until_answered(&b.url, "node-0001", "rf-replica-again", "7.0.0").await;
    assert_eq!(again.json()["state"], "succeeded", "{}", again.json());
    assert_eq!(flashes_and_bricked(&hv.url).await, (8, 0, 0));
}

/// Slows the simulator's next `reads` reads of `Systems` by `latency_ms` each.
async fn stall_systems(sim: &str, latency_ms: u64, reads: u64) {
    let r = http()
        .put(format!("{sim}/v1/faults/systems"))
        .json(&json!({"latency_ms": latency_ms, "reads": reads}))
        .send()
        .await
        .expect("faults");
    assert_eq!(r.status(), StatusCode::NO_CONTENT, "setting the Systems stall");
}

/// Issue 45, item 1: a BMC whose `Systems` listing stalls (each of the next four reads takes
/// 3.5 s, under the 4 s call timeout). Every read a flash needs comes before its send stamp, so
/// the `SimpleUpdate` leaves right after the stamp, and a second key's flash is refused while the
/// first writes. (Before, the send step read `Systems` again after the stamp: the POST left two
/// slow reads later, past the settle window; the watcher, finding no task, failed the operation
/// and freed the node, and the second key's flash bricked it.)
#[tokio::test]
async fn a_stalling_systems_listing_never_lets_a_second_key_brick_the_node() {
    let hv = redfish_sim(&["--flash-ms", "5000"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = broker(&sqlite_url(&dir), &hv, &["--hypervisor-timeout", "4s", "--hypervisor-settle", "4100ms"]);
    stall_systems(&hv.url, 3500, 4).await;

    let first = flash(&lb.url, "node-0003", "rf-stall-a", "3.1.0").await;
    let op_id = op_id(&first);
    let second = flash(&lb.url, "node-0003", "rf-stall-b", "3.2.0").await;
    let ended = until_ended(&lb.url, &op_id).await;
    let answers = format!("first: {}\nsecond: {}\nended: {ended}", first.json(), second.json());
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "one flash, no machine bricked\n{answers}");
    assert_eq!(first.json()["state"], "running", "{answers}");
    assert_eq!(
        (second.status, second.problem_type().as_str()),
        (StatusCode::CONFLICT, "operation-conflict"),
        "{answers}"
    );
    assert_eq!(second.json()["operation_id"], op_id.as_str());
    assert_eq!((ended["state"].as_str(), &ended["error"]), (Some("succeeded"), &Value::Null), "{answers}");
    assert_eq!(version(&hv.url, "node-0003").await, "3.1.0");
}

/// Issue 45, item 1: two replicas on one PostgreSQL database, a BMC like sushy-tools' (no task
/// list, no payload, no inventory), no delay anywhere. The task monitor's `Location` is kept
/// with the operation, so whichever replica's watcher takes the flash follows the task and every
/// accepted flash succeeds. (Before, the sending replica kept the `Location` in memory only: the
/// other replica's watcher found neither a task nor an inventory and failed the operation, 5 times
/// in 10 in the run.)
#[tokio::test]
async fn two_replicas_follow_the_task_of_a_bmc_without_a_task_list_or_an_inventory() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv = redfish_sim(&[&["--flash-ms", "300"][..], &SUSHY_LIKE].concat());
    let a = broker(pg.url(), &hv, &[]);
    let b = broker(pg.url(), &hv, &[]);
    let mut ops = vec![];
    for i in 0..12 {
        let base = if i % 2 == 0 { &a.url } else { &b.url };
        let node = format!("node-{:04}", i + 1);
        ops.push(op_id(&flash_until_answered(base, &node, &format!("rf-sushy-{i}"), "7.1.0").await));
    }
    let mut ends = vec![];
    for op_id in &ops {
        let ended = until_ended(&a.url, op_id).await;
        ends.push(format!("{}: {}", ended["state"], ended["error"]));
    }
    assert!(ends.iter().all(|e| e.starts_with("\"succeeded\"")), "every accepted flash succeeds: {ends:#?}");
    assert_eq!(flashes_and_bricked(&hv.url).await, (12, 0, 0));
}

/// `POST /admin/v1/operations/{op_id}/resolve` with `key` and `body`, as `token`.
async fn resolve(base: &str, token: &str, op_id: &str, key: Option<&str>, body: &Value) -> Reply {
    let url = format!("{base}/admin/v1/operations/{op_id}/resolve");
    send(reqwest::Method::POST, &url, token, key, Some(body)).await
}

/// Issue 45, item 1 (docs/protocol.md#real-downstreams, #firmware-operations): a flash whose answer was lost on a BMC like sushy-tools'
/// (no task list, no payload, no inventory) cannot be read: once the settle window has passed it
/// ends `uncertain`, never `failed` on a guess, and is never sent again. The node takes no other
/// key's flash (`409 operation-conflict` naming it) until an operator resolves it; the resolve is
/// keyed, audited, and refused (`409 operation-not-uncertain`) for an operation in any other
/// state.
#[tokio::test]
async fn an_unreadable_flash_ends_uncertain_holds_the_node_and_an_operator_resolves_it() {
    let hv = redfish_sim(&[&["--flash-ms", "500", "--fail-after", "1.0"][..], &SUSHY_LIKE].concat());
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = [("RUST_LOG", "warn,leasebroker::audit=info")];
    let settle = ["--hypervisor-timeout", "1s", "--hypervisor-settle", "2s"];
    let lb = broker_with_env(&sqlite_url(&dir), &hv, &settle, &audit);
    let first = flash(&lb.url, "node-0005", "rf-unc-1", "5.0.0").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "the answer was lost: {}", first.json());
    set_faults(&hv.url, 0.0, 0.0, 0).await; // the BMC answers again: a second send would show

    let uncertain = op_id(&flash_until_answered(&lb.url, "node-0005", "rf-unc-1", "5.0.0").await);
    let op = until_ended(&lb.url, &uncertain).await;
    assert_eq!(op["state"], "uncertain", "{op}");
    assert!(op["error"].as_str().is_some_and(|e| e.contains("cannot be read")), "{op}");
    assert!(op["finished_at"].is_string(), "{op}");
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0), "never sent again");
    let metrics = http().get(format!("{}/metrics", lb.url)).send().await.expect("metrics").text().await.expect("text");
    assert!(
        metrics.lines().any(|l| l.starts_with("leasebroker_operations_total")
            && l.contains("outcome=\"uncertain\"")
            && l.ends_with(" 1")),
        "{metrics}"
    );

    // The node is held: another key's flash is refused and named, and never reaches the BMC.
    let other = flash(&lb.url, "node-0005", "rf-unc-2", "5.0.1").await;
    assert_eq!((other.status, other.problem_type().as_str()), (StatusCode::CONFLICT, "operation-conflict"));
    assert_eq!(other.json()["operation_id"], uncertain.as_str());
    assert!(other.json()["detail"].as_str().is_some_and(|d| d.contains("resolve")), "{}", other.json());
    assert_eq!(flashes_and_bricked(&hv.url).await, (1, 0, 0));

    // Resolving: admin token, a key, a known state and a reason.
    let found = json!({"state": "succeeded", "reason": "the BMC's web page shows 5.0.0"});
    assert_eq!(resolve(&lb.url, TOKEN, &uncertain, Some("res-t"), &found).await.status, StatusCode::UNAUTHORIZED);
    let unkeyed = resolve(&lb.url, ADMIN, &uncertain, None, &found).await;
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST, "{}", unkeyed.json());
    let bad = [
        json!({"state": "running", "reason": "x"}),
        json!({"state": "failed", "reason": " "}),
        json!({"state": "failed"}),
    ];
    for (i, bad) in bad.iter().enumerate() {
        let r = resolve(&lb.url, ADMIN, &uncertain, Some(&format!("res-bad-{i}")), bad).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {}", r.json());
    }
    let unknown = resolve(&lb.url, ADMIN, "op-00000000", Some("res-unknown"), &found).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(operation(&lb.url, &uncertain).await.json()["state"], "uncertain", "nothing resolved it yet");

    let resolved = resolve(&lb.url, ADMIN, &uncertain, Some("res-1"), &found).await;
    assert_eq!(resolved.status, StatusCode::OK, "{}", resolved.json());
    let body = resolved.json();
    assert_eq!(
        (body["id"].as_str(), body["state"].as_str(), &body["error"]),
        (Some(uncertain.as_str()), Some("succeeded"), &Value::Null)
    );
    let replay = resolve(&lb.url, ADMIN, &uncertain, Some("res-1"), &found).await;
    assert!(replay.replayed() && replay.body == resolved.body, "a retry with its key replays the 200");
    let again =
        resolve(&lb.url, ADMIN, &uncertain, Some("res-2"), &json!({"state": "failed", "reason": "changed my mind"}))
            .await;
    assert_eq!((again.status, again.problem_type().as_str()), (StatusCode::CONFLICT, "operation-not-uncertain"));
    assert_eq!(again.json()["operation_id"], uncertain.as_str());
    assert_eq!(operation(&lb.url, &uncertain).await.json()["state"], "succeeded");
    let f = fleet(&lb.url).await;
    assert_eq!(f["firmware_flashes_total"].as_i64(), Some(1), "the operator found it done: the BMC took it: {f}");
    let line = lb.wait_for_line(&["resolve-operation", &uncertain]);
    assert!(line.contains("the BMC's web page shows 5.0.0") && line.contains("res-1"), "{line}");

    // Resolved, the node takes a flash again; a running or succeeded operation is not uncertain.
    let next = op_id(&flash_until_answered(&lb.url, "node-0005", "rf-unc-3", "5.0.1").await);
    let running = resolve(&lb.url, ADMIN, &next, Some("res-3"), &found).await;
    assert_eq!(running.problem_type(), "operation-not-uncertain", "{}", running.json());
    assert_eq!(flashes_and_bricked(&hv.url).await, (2, 0, 0));
    assert_eq!(until_ended(&lb.url, &next).await["state"], "succeeded");
    assert_eq!(fleet(&lb.url).await["firmware_flashes_total"].as_i64(), Some(2), "as many as the BMC took");
}
