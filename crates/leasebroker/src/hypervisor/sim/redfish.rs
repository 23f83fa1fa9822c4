//! The simulated BMCs served as a Redfish service (docs/protocol.md#real-downstreams): `hypervisor-sim --bmc redfish`.
//!
//! The same machines, faults, bricking rule and counters as [`super::bmc`], behind the shape a
//! Redfish service gives them:
//! - `GET /redfish/v1`: the service root, linking `Systems`, `UpdateService` and (as `Tasks`) the
//!   `TaskService`
//! - `GET /redfish/v1/Systems[/{id}]`: one member per node (`node-0001`.. `--redfish-systems`),
//!   or, with `--redfish-one-machine`, the one machine `1`
//! - `POST /redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate`
//!   `{"ImageURI": ".../VERSION?tag=T", "Targets": ["/redfish/v1/Systems/node-0003"]}` -> `202`,
//!   `Location` of the task's monitor, body: the task; with `--redfish-terse`, `204` and the
//!   task's own `Location`. `Targets` is required unless the service has one machine.
//! - `GET /redfish/v1/UpdateService/FirmwareInventory[/{id}]`: the `Version` each machine runs
//! - `GET /redfish/v1/TaskService/Tasks[/{id}]`: one task per flash, `Running` while it writes,
//!   then `Completed`/`OK`, or `Exception`/`Critical` (the image failed its verification, or a
//!   second flash bricked the machine). Its `Payload.JsonBody` keeps the request's body, unless
//!   `--redfish-no-payload` (as many BMCs do).
//! - `GET /redfish/v1/TaskService/TaskMonitors/{id}`: `202` with the task while it runs, then
//!   `200` with the task.
//! - With `--redfish-no-task-list` the task collection answers `404` (its tasks and monitors are
//!   still served), and with `--redfish-no-inventory` the firmware inventory does: together with
//!   `--redfish-terse` and `--redfish-no-payload`, a BMC like sushy-tools', where a flash whose
//!   monitor is unknown cannot be read at all.
//! - Simulator extension: `PUT /v1/faults/systems` `{"latency_ms", "reads"}` slows the next
//!   `reads` reads of `Systems` (the collection or a member; absent or 0: every read) by
//!   `latency_ms` each: a BMC whose listing stalls, so a caller that reads it between deciding to
//!   flash and flashing sends its flash late.
//!
//! The version flashed is the last path segment of `ImageURI`, the tag its `tag` query parameter.
//! Faults apply to `SimpleUpdate` as to every mutating call; `GET /v1/stats` counts the flashes.
//! Errors are Redfish's `{"error": {"code", "message", "@Message.ExtendedInfo"}}`.

use axum::Router;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Json, Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::Simulator;
use crate::hypervisor::api::{BmcState, FlashRequest};

/// How the simulator's BMCs answer over Redfish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedfishOptions {
    /// Systems `node-0001`..`node-NNNN`, one per node (ignored with `one_machine`).
    pub systems: u32,
    /// One machine, `1`, flashed without `Targets` (the common real BMC).
    pub one_machine: bool,
    /// Whether a task keeps its request in `Payload.JsonBody` (many BMCs do not).
    pub keep_payload: bool,
    /// Answer a `SimpleUpdate` with `204` and the task's `Location`, no body.
    pub terse: bool,
    /// Whether `TaskService/Tasks` lists the tasks (sushy-tools serves no such collection).
    pub list_tasks: bool,
    /// Whether `UpdateService/FirmwareInventory` is served (sushy-tools serves none).
    pub inventory: bool,
}

impl Default for RedfishOptions {
    fn default() -> Self {
        Self { systems: 64, one_machine: false, keep_payload: true, terse: false, list_tasks: true, inventory: true }
    }
}

/// The `Systems` reads still to be slowed, and by how much (`PUT /v1/faults/systems`).
#[derive(Debug, Default)]
pub(super) struct Stall {
    latency: std::time::Duration,
    /// `None`: every read.
    reads: Option<u64>,
}

impl Stall {
    /// How long the next read waits (counting it against the reads left).
    fn take(&mut self) -> std::time::Duration {
        match &mut self.reads {
            Some(0) => std::time::Duration::ZERO,
            Some(n) => {
                *n -= 1;
                self.latency
            }
            None => self.latency,
        }
    }
}

/// `PUT /v1/faults/systems` body.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StallBody {
    latency_ms: u64,
    #[serde(default)]
    reads: u64,
}

/// `PUT /v1/faults/systems`: slows the next `reads` `Systems` reads (0: every one).
async fn put_stall(State(sim): State<Simulator>, body: Result<Json<StallBody>, JsonRejection>) -> Response {
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => return super::problem::json_rejection(rejection),
    };
    let latency = std::time::Duration::from_millis(body.latency_ms);
    sim.state().systems_stall = Stall { latency, reads: (body.reads > 0).then_some(body.reads) };
    StatusCode::NO_CONTENT.into_response()
}

/// Waits out the `Systems` stall, if one is set.
async fn stall(sim: &Simulator) {
    let wait = sim.state().systems_stall.take();
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}

impl RedfishOptions {
    /// The machines' ids, as `Systems` lists them.
    fn system_ids(&self) -> Vec<String> {
        if self.one_machine { vec!["1".to_owned()] } else { (1..=self.systems).map(node_name).collect() }
    }

    fn has_system(&self, id: &str) -> bool {
        if self.one_machine {
            return id == "1";
        }
        id.strip_prefix("node-")
            .filter(|n| n.len() >= 4 && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| (1..=self.systems).contains(&n) && node_name(n) == id)
    }
}

/// leasebroker's name for node `n`.
fn node_name(n: u32) -> String {
    format!("node-{n:04}")
}

const ROOT: &str = "/redfish/v1";
const SIMPLE_UPDATE: &str = "/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate";

/// Where a task is read, and its monitor.
fn task_uri(id: u64) -> String {
    format!("{ROOT}/TaskService/Tasks/{id}")
}

fn monitor_uri(id: u64) -> String {
    format!("{ROOT}/TaskService/TaskMonitors/{id}")
}

/// The tasks, one per flash, oldest first (task `n` is at index `n - 1`).
#[derive(Debug, Default)]
pub(super) struct Tasks {
    tasks: Vec<SimTask>,
}

#[derive(Debug)]
struct SimTask {
    state: TaskState,
    /// The request's body, when the service keeps payloads.
    json_body: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskState {
    Running,
    Completed,
    /// The image failed its verification: the machine runs what it ran.
    Failed,
    /// A second flash started while this one wrote.
    Bricked,
}

impl Tasks {
    fn create(&mut self, json_body: Option<String>) -> u64 {
        self.tasks.push(SimTask { state: TaskState::Running, json_body });
        self.tasks.len() as u64
    }

    /// Ends task `id` with what the write came to (see [`super::bmc::Bmcs::finish`]).
    fn end(&mut self, id: u64, outcome: Option<bool>) {
        let index = id.checked_sub(1).and_then(|i| usize::try_from(i).ok());
        if let Some(task) = index.and_then(|i| self.tasks.get_mut(i)) {
            task.state = match outcome {
                Some(true) => TaskState::Completed,
                Some(false) => TaskState::Failed,
                None => TaskState::Bricked,
            };
        }
    }

    /// Task `id` (its decimal number, as in its URI).
    fn get(&self, id: &str) -> Option<(u64, &SimTask)> {
        let n = id.parse::<u64>().ok().filter(|n| *n > 0 && id == n.to_string())?;
        let task = self.tasks.get(usize::try_from(n - 1).ok()?)?;
        Some((n, task))
    }

    fn view(&self, id: u64) -> Value {
        self.get(&id.to_string()).map_or(Value::Null, |(n, task)| task_view(n, task))
    }
}

fn task_view(id: u64, task: &SimTask) -> Value {
    let (state, status, message_id, message) = match task.state {
        TaskState::Running => ("Running", "OK", "TaskEvent.1.0.TaskStarted", "The update is being written."),
        TaskState::Completed => ("Completed", "OK", "TaskEvent.1.0.TaskCompletedOK", "The update completed."),
        TaskState::Failed => {
            ("Exception", "Critical", "TaskEvent.1.0.TaskAborted", "The image failed its verification.")
        }
        TaskState::Bricked => (
            "Exception",
            "Critical",
            "TaskEvent.1.0.TaskAborted",
            "A second update started while this one was writing: the system is inoperable.",
        ),
    };
    let mut view = json!({
        "@odata.id": task_uri(id),
        "@odata.type": "#Task.v1_7_0.Task",
        "Id": id.to_string(),
        "Name": format!("Task {id}"),
        "TaskState": state,
        "TaskStatus": status,
        "TaskMonitor": monitor_uri(id),
        "Messages": [{"MessageId": message_id, "Message": message, "MessageSeverity": status}],
    });
    if let Some(body) = &task.json_body {
        view["Payload"] = json!({
            "HttpOperation": "POST",
            "TargetUri": SIMPLE_UPDATE,
            "JsonBody": body,
            "HttpHeaders": [],
        });
    }
    view
}

/// The Redfish routes, beside the hypervisor API's.
pub(super) fn routes() -> Router<Simulator> {
    Router::new()
        .route("/redfish", get(|| async { Json(json!({"v1": "/redfish/v1/"})) }))
        .route("/redfish/v1", get(service_root))
        .route("/redfish/v1/", get(service_root))
        .route("/redfish/v1/SessionService/Sessions", get(sessions))
        .route("/redfish/v1/Systems", get(systems))
        .route("/redfish/v1/Systems/{id}", get(system))
        .route("/redfish/v1/UpdateService", get(update_service))
        .route("/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate", post(simple_update))
        .route("/redfish/v1/UpdateService/FirmwareInventory", get(inventory))
        .route("/redfish/v1/UpdateService/FirmwareInventory/{id}", get(inventory_member))
        .route("/redfish/v1/TaskService", get(task_service))
        .route("/redfish/v1/TaskService/Tasks", get(tasks))
        .route("/redfish/v1/TaskService/Tasks/{id}", get(task))
        .route("/redfish/v1/TaskService/TaskMonitors/{id}", get(task_monitor))
        .route("/v1/faults/systems", axum::routing::put(put_stall))
        .layer(axum::middleware::map_response(|mut response: Response| async move {
            response.headers_mut().insert("odata-version", HeaderValue::from_static("4.0"));
            response
        }))
}

/// A Redfish error answer.
fn error(status: StatusCode, message_id: &str, message: &str) -> Response {
    let body = json!({"error": {
        "code": message_id,
        "message": message,
        "@Message.ExtendedInfo": [{"MessageId": message_id, "Message": message, "MessageSeverity": "Warning"}],
    }});
    (status, Json(body)).into_response()
}

fn missing(uri: &str) -> Response {
    error(StatusCode::NOT_FOUND, "Base.1.8.ResourceMissingAtURI", &format!("no resource at {uri}"))
}

fn collection(uri: &str, kind: &str, name: &str, members: impl IntoIterator<Item = String>) -> Json<Value> {
    let members: Vec<Value> = members.into_iter().map(|m| json!({"@odata.id": m})).collect();
    Json(json!({
        "@odata.id": uri,
        "@odata.type": format!("#{kind}.{kind}"),
        "Name": name,
        "Members@odata.count": members.len(),
        "Members": members,
    }))
}

async fn service_root() -> Json<Value> {
    Json(json!({
        "@odata.id": ROOT,
        "@odata.type": "#ServiceRoot.v1_15_0.ServiceRoot",
        "Id": "RootService",
        "Name": "leasebroker hypervisor-sim",
        "RedfishVersion": "1.17.0",
        "UUID": "6c8f5d4e-0b9a-4c1e-9f43-5d1a2b3c4d5e",
        "Systems": {"@odata.id": format!("{ROOT}/Systems")},
        "UpdateService": {"@odata.id": format!("{ROOT}/UpdateService")},
        // The task service's link is named `Tasks` in the service root.
        "Tasks": {"@odata.id": format!("{ROOT}/TaskService")},
        "Links": {"Sessions": {"@odata.id": format!("{ROOT}/SessionService/Sessions")}},
    }))
}

/// No sessions (the simulator has no authentication), but the root must link their collection.
async fn sessions() -> Json<Value> {
    collection(&format!("{ROOT}/SessionService/Sessions"), "SessionCollection", "Session Collection", [])
}

async fn systems(State(sim): State<Simulator>) -> Json<Value> {
    stall(&sim).await;
    let ids = sim.redfish_options().system_ids();
    collection(
        &format!("{ROOT}/Systems"),
        "ComputerSystemCollection",
        "Computer System Collection",
        ids.iter().map(|id| format!("{ROOT}/Systems/{id}")),
    )
}

async fn system(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
    stall(&sim).await;
    if !sim.redfish_options().has_system(&id) {
        return missing(&format!("{ROOT}/Systems/{id}"));
    }
    let node = sim.state().bmcs.get(&id);
    let (state, health) =
        if node.state == BmcState::Bricked { ("UnavailableOffline", "Critical") } else { ("Enabled", "OK") };
    Json(json!({
        "@odata.id": format!("{ROOT}/Systems/{id}"),
        "@odata.type": "#ComputerSystem.v1_20_0.ComputerSystem",
        "Id": id,
        "Name": id,
        "SystemType": "Physical",
        "Status": {"State": state, "Health": health},
    }))
    .into_response()
}

async fn update_service() -> Json<Value> {
    Json(json!({
        "@odata.id": format!("{ROOT}/UpdateService"),
        "@odata.type": "#UpdateService.v1_11_0.UpdateService",
        "Id": "UpdateService",
        "Name": "Update Service",
        "ServiceEnabled": true,
        "FirmwareInventory": {"@odata.id": format!("{ROOT}/UpdateService/FirmwareInventory")},
        "Actions": {"#UpdateService.SimpleUpdate": {
            "target": SIMPLE_UPDATE,
            "TransferProtocol@Redfish.AllowableValues": ["HTTP", "HTTPS"],
        }},
    }))
}

async fn inventory(State(sim): State<Simulator>) -> Response {
    let options = sim.redfish_options();
    if !options.inventory {
        return missing(&format!("{ROOT}/UpdateService/FirmwareInventory"));
    }
    let ids = options.system_ids();
    collection(
        &format!("{ROOT}/UpdateService/FirmwareInventory"),
        "SoftwareInventoryCollection",
        "Firmware Inventory Collection",
        ids.iter().map(|id| format!("{ROOT}/UpdateService/FirmwareInventory/{id}")),
    )
    .into_response()
}

async fn inventory_member(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
    let options = sim.redfish_options();
    if !options.inventory || !options.has_system(&id) {
        return missing(&format!("{ROOT}/UpdateService/FirmwareInventory/{id}"));
    }
    let node = sim.state().bmcs.get(&id);
    Json(json!({
        "@odata.id": format!("{ROOT}/UpdateService/FirmwareInventory/{id}"),
        "@odata.type": "#SoftwareInventory.v1_10_0.SoftwareInventory",
        "Id": id,
        "Name": format!("System firmware of {id}"),
        "Version": node.firmware,
        "Updateable": true,
        "RelatedItem": [{"@odata.id": format!("{ROOT}/Systems/{id}")}],
    }))
    .into_response()
}

async fn task_service() -> Json<Value> {
    Json(json!({
        "@odata.id": format!("{ROOT}/TaskService"),
        "@odata.type": "#TaskService.v1_2_0.TaskService",
        "Id": "TaskService",
        "Name": "Task Service",
        "ServiceEnabled": true,
        "Tasks": {"@odata.id": format!("{ROOT}/TaskService/Tasks")},
    }))
}

async fn tasks(State(sim): State<Simulator>) -> Response {
    if !sim.redfish_options().list_tasks {
        return missing(&format!("{ROOT}/TaskService/Tasks"));
    }
    let count = sim.state().tasks.tasks.len() as u64;
    collection(&format!("{ROOT}/TaskService/Tasks"), "TaskCollection", "Task Collection", (1..=count).map(task_uri))
        .into_response()
}

async fn task(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
    match sim.state().tasks.get(&id) {
        Some((n, task)) => Json(task_view(n, task)).into_response(),
        None => missing(&format!("{ROOT}/TaskService/Tasks/{id}")),
    }
}

/// `202` with the task while it runs; then `200` with the task.
async fn task_monitor(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
    let state = sim.state();
    let Some((n, task)) = state.tasks.get(&id) else {
        return missing(&format!("{ROOT}/TaskService/TaskMonitors/{id}"));
    };
    if task.state == TaskState::Running {
        let mut response = (StatusCode::ACCEPTED, Json(task_view(n, task))).into_response();
        if let Ok(location) = HeaderValue::from_str(&monitor_uri(n)) {
            response.headers_mut().insert(header::LOCATION, location);
        }
        return response;
    }
    Json(task_view(n, task)).into_response()
}

/// Why a `SimpleUpdate` is refused (`400`): a Base message id and the message.
type Refusal = (&'static str, String);

const MISSING: &str = "Base.1.8.ActionParameterMissing";
const FORMAT: &str = "Base.1.8.ActionParameterValueFormatError";

/// What a `SimpleUpdate` asks for: the machine, the version and the tag.
fn read_update(options: &RedfishOptions, body: &Value) -> Result<(String, FlashRequest), Refusal> {
    let Some(body) = body.as_object() else {
        return Err(("Base.1.8.MalformedJSON", "the body must be a JSON object".to_owned()));
    };
    let Some(image) = body.get("ImageURI").and_then(Value::as_str) else {
        return Err((MISSING, "SimpleUpdate requires the ImageURI parameter".to_owned()));
    };
    let format_error = |detail: &str| (FORMAT, detail.to_owned());
    let url = reqwest::Url::parse(image).map_err(|_| format_error("ImageURI is not an absolute URI"))?;
    let version = url
        .path_segments()
        .and_then(|mut segments| segments.rfind(|s| !s.is_empty()))
        .ok_or_else(|| format_error("ImageURI names no image"))?
        .to_owned();
    let tag = url.query_pairs().find(|(k, _)| k == "tag").map(|(_, v)| v.into_owned()).unwrap_or_default();
    let machine = match body.get("Targets") {
        None | Some(Value::Null) if options.one_machine => "1".to_owned(),
        None | Some(Value::Null) => {
            return Err((MISSING, "this service manages several systems: Targets must name one".to_owned()));
        }
        Some(Value::Array(targets)) => {
            let [Value::String(target)] = targets.as_slice() else {
                return Err(format_error("Targets must name exactly one system"));
            };
            // A target is a URI: the path, or an absolute one.
            let path = reqwest::Url::parse(target).map(|u| u.path().to_owned()).unwrap_or_else(|_| target.clone());
            match path.trim_end_matches('/').strip_prefix("/redfish/v1/Systems/") {
                Some(id) if options.has_system(id) => id.to_owned(),
                _ => return Err(format_error("Targets names no system of this service")),
            }
        }
        Some(_) => return Err(format_error("Targets must be an array of URIs")),
    };
    let request = FlashRequest { version, tag };
    super::bmc::validate(&machine, &request).map_err(|detail| format_error(&detail))?;
    Ok((machine, request))
}

/// `POST /redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate`.
async fn simple_update(
    State(sim): State<Simulator>,
    headers: axum::http::HeaderMap,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    let options = sim.redfish_options();
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => return error(rejection.status(), "Base.1.8.MalformedJSON", &rejection.body_text()),
    };
    let (machine, request) = match read_update(&options, &body) {
        Ok(update) => update,
        Err((message_id, message)) => return error(StatusCode::BAD_REQUEST, message_id, &message),
    };
    let json_body = options.keep_payload.then(|| body.to_string());
    // As with the native API, the write is scheduled inside the work: it runs on whatever the
    // caller does, even when the answer is dropped.
    let writer = sim.clone();
    let flash_time = sim.flash_time();
    let verified = !super::roll(sim.flash_failure());
    let keyed = Simulator::keyed_by(&headers, &request.tag);
    let created = sim
        .mutate(move |state| {
            state.stats.tag_keyed_calls += u64::from(keyed);
            let started = state.bmcs.start(&machine, request, &mut state.stats);
            let id = state.tasks.create(json_body);
            tokio::spawn(async move {
                tokio::time::sleep(flash_time).await;
                let mut state = writer.state();
                let outcome = state.bmcs.finish(&started, verified);
                state.tasks.end(id, outcome);
            });
            (id, state.tasks.view(id))
        })
        .await;
    let (id, view) = match created {
        Ok(created) => created,
        Err(response) => return response,
    };
    let (status, location, body) = if options.terse {
        (StatusCode::NO_CONTENT, task_uri(id), None)
    } else {
        (StatusCode::ACCEPTED, monitor_uri(id), Some(Json(view)))
    };
    let mut response = match body {
        Some(body) => (status, body).into_response(),
        None => status.into_response(),
    };
    if let Ok(location) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::hypervisor::SimConfig;

    use super::super::tests::serve_on_loopback as start;

    fn redfish(options: RedfishOptions) -> Simulator {
        Simulator::new(SimConfig::default()).with_flash_time(Duration::from_millis(300)).with_redfish(options)
    }

    async fn update(url: &str, body: &Value) -> reqwest::Response {
        reqwest::Client::new().post(format!("{url}{SIMPLE_UPDATE}")).json(body).send().await.expect("send")
    }

    async fn get(url: &str, path: &str) -> (u16, Value) {
        let r = reqwest::get(format!("{url}{path}")).await.expect("get");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    fn image(version: &str, tag: &str) -> String {
        format!("http://images.test/fw/{version}?tag={tag}")
    }

    /// Polls task `id` until it leaves `Running` (or 10 s passed).
    async fn until_ended(url: &str, id: u64) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (_, task) = get(url, &task_uri(id)).await;
            if task["TaskState"] != "Running" || tokio::time::Instant::now() > deadline {
                return task;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn a_second_simple_update_while_one_writes_bricks_the_system() {
        // Long enough a write that the second update surely comes while the first one writes.
        let sim = redfish(RedfishOptions { systems: 4, ..RedfishOptions::default() })
            .with_flash_time(Duration::from_millis(3000));
        let url = start(&sim).await;
        let body = json!({"ImageURI": image("2.0", "t-1"), "Targets": ["/redfish/v1/Systems/node-0002"]});
        let first = update(&url, &body).await;
        assert_eq!(first.status(), 202);
        assert_eq!(first.headers()["location"], monitor_uri(1).as_str());
        let (status, running) = get(&url, &monitor_uri(1)).await;
        assert_eq!((status, running["TaskState"].as_str()), (202, Some("Running")), "{running}");
        assert_eq!(update(&url, &body).await.status(), 202, "the BMC takes it: that is the danger");
        let (first, second) = (until_ended(&url, 1).await, until_ended(&url, 2).await);
        for task in [&first, &second] {
            assert_eq!(
                (task["TaskState"].as_str(), task["TaskStatus"].as_str()),
                (Some("Exception"), Some("Critical"))
            );
        }
        let (_, system) = get(&url, "/redfish/v1/Systems/node-0002").await;
        assert_eq!(system["Status"]["Health"], "Critical", "{system}");
        let (_, item) = get(&url, "/redfish/v1/UpdateService/FirmwareInventory/node-0002").await;
        assert_eq!(item["Version"], super::super::bmc::FACTORY_FIRMWARE);
        let stats = sim.stats();
        assert_eq!((stats.flashes_total, stats.duplicate_flash_tags, stats.bricked_nodes), (2, 1, 1));
    }

    #[tokio::test]
    async fn a_flash_completes_and_the_inventory_shows_its_version() {
        let sim = redfish(RedfishOptions { systems: 2, terse: true, keep_payload: false, ..RedfishOptions::default() });
        let url = start(&sim).await;
        let r =
            update(&url, &json!({"ImageURI": image("3.1", "t-2"), "Targets": ["/redfish/v1/Systems/node-0001"]})).await;
        assert_eq!(r.status(), 204);
        assert_eq!(r.headers()["location"], task_uri(1).as_str(), "terse: the task itself");
        let task = until_ended(&url, 1).await;
        assert_eq!((task["TaskState"].as_str(), task["TaskStatus"].as_str()), (Some("Completed"), Some("OK")));
        assert!(task.get("Payload").is_none(), "no payload kept: {task}");
        assert_eq!(get(&url, &monitor_uri(1)).await.0, 200, "the monitor answers 200 once done");
        let (_, item) = get(&url, "/redfish/v1/UpdateService/FirmwareInventory/node-0001").await;
        assert_eq!(item["Version"], "3.1");
        let (_, systems) = get(&url, "/redfish/v1/Systems").await;
        assert_eq!(
            systems["Members"],
            json!([{"@odata.id": "/redfish/v1/Systems/node-0001"}, {"@odata.id": "/redfish/v1/Systems/node-0002"}])
        );
    }

    #[tokio::test]
    async fn bad_updates_are_redfish_errors_and_flash_nothing() {
        let sim = redfish(RedfishOptions { systems: 4, ..RedfishOptions::default() });
        let url = start(&sim).await;
        let cases = [
            json!({"ImageURI": image("1", "a")}),
            json!({"ImageURI": image("1", "a"), "Targets": ["/redfish/v1/Systems/node-0009"]}),
            json!({"ImageURI": image("1", "a"), "Targets": ["/redfish/v1/Systems/node-0001", "/redfish/v1/Systems/node-0002"]}),
            json!({"ImageURI": image("1", "a"), "Targets": "/redfish/v1/Systems/node-0001"}),
            json!({"ImageURI": "not a uri", "Targets": ["/redfish/v1/Systems/node-0001"]}),
            json!({"Targets": ["/redfish/v1/Systems/node-0001"]}),
            json!([]),
        ];
        for body in cases {
            let r = update(&url, &body).await;
            assert_eq!(r.status(), 400, "{body}");
            let error: Value = r.json().await.expect("json");
            assert!(error["error"]["code"].as_str().is_some_and(|c| c.starts_with("Base.")), "{error}");
        }
        let raw = reqwest::Client::new()
            .post(format!("{url}{SIMPLE_UPDATE}"))
            .header("content-type", "application/json")
            .body("{\"ImageURI\": ")
            .send()
            .await
            .expect("send");
        assert_eq!(raw.status(), 400);
        assert_eq!(get(&url, "/redfish/v1/Systems/node-0005").await.0, 404);
        assert_eq!(get(&url, "/redfish/v1/TaskService/Tasks/01").await.0, 404);
        assert_eq!(get(&url, "/v1/bmc/node-0001").await.0, 404, "the native BMC API is not served beside it");
        assert_eq!(sim.stats().flashes_total, 0);
        assert_eq!(get(&url, "/redfish/v1/TaskService/Tasks").await.1["Members"], json!([]));
    }

    #[tokio::test]
    async fn a_sushy_like_service_lists_no_tasks_and_serves_no_inventory_but_serves_each_task() {
        let options = RedfishOptions { systems: 2, list_tasks: false, inventory: false, ..RedfishOptions::default() };
        let sim = redfish(options);
        let url = start(&sim).await;
        let r =
            update(&url, &json!({"ImageURI": image("1.5", "t-s"), "Targets": ["/redfish/v1/Systems/node-0002"]})).await;
        assert_eq!(r.status(), 202);
        assert_eq!(get(&url, "/redfish/v1/TaskService/Tasks").await.0, 404);
        assert_eq!(get(&url, "/redfish/v1/UpdateService/FirmwareInventory").await.0, 404);
        assert_eq!(get(&url, "/redfish/v1/UpdateService/FirmwareInventory/node-0002").await.0, 404);
        assert_eq!(until_ended(&url, 1).await["TaskState"], "Completed", "its task is served");
    }

    #[tokio::test]
    async fn a_stall_slows_the_next_systems_reads_only() {
        let sim = redfish(RedfishOptions { systems: 2, ..RedfishOptions::default() });
        let url = start(&sim).await;
        let put = reqwest::Client::new()
            .put(format!("{url}/v1/faults/systems"))
            .json(&json!({"latency_ms": 400, "reads": 2}))
            .send()
            .await
            .expect("put");
        assert_eq!(put.status(), 204);
        let timed = |path: &'static str| {
            let url = url.clone();
            async move {
                let started = tokio::time::Instant::now();
                assert_eq!(get(&url, path).await.0, 200);
                started.elapsed()
            }
        };
        assert!(timed("/redfish/v1/Systems").await >= Duration::from_millis(400));
        assert!(timed("/redfish/v1/Systems/node-0001").await >= Duration::from_millis(400));
        // The budget is spent: the next read is not held (it is not timed for speed: the stall
        // state itself says so).
        timed("/redfish/v1/Systems").await;
        assert!(sim.state().systems_stall.take().is_zero());
    }

    #[tokio::test]
    async fn one_machine_is_flashed_without_targets() {
        let sim = redfish(RedfishOptions { one_machine: true, ..RedfishOptions::default() });
        let url = start(&sim).await;
        assert_eq!(update(&url, &json!({"ImageURI": image("5.5", "t-5")})).await.status(), 202);
        assert_eq!(until_ended(&url, 1).await["TaskState"], "Completed");
        let (_, item) = get(&url, "/redfish/v1/UpdateService/FirmwareInventory/1").await;
        assert_eq!(item["Version"], "5.5");
        let (_, root) = get(&url, "/redfish/v1").await;
        for link in ["Systems", "UpdateService", "Tasks"] {
            assert!(root[link]["@odata.id"].is_string(), "{root}");
        }
    }
}
