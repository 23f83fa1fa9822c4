//! The simulated BMCs served as a Redfish service (SPEC 3.3a): `hypervisor-sim --bmc redfish`.
//!
//! The same machines, faults, bricking rule and counters as [`super::bmc`], behind the shape a
//! Redfish service gives them:
//! - `GET /redfish/v1`: the service root, linking `Systems`, `UpdateService` and `TaskService`
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
}

impl Default for RedfishOptions {
    fn default() -> Self {
        Self { systems: 64, one_machine: false, keep_payload: true, terse: false }
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
        "Messages": [{"MessageId": message_id, "Message": message, "Severity": status}],
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
        "@Message.ExtendedInfo": [{"MessageId": message_id, "Message": message, "Severity": "Warning"}],
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
        "TaskService": {"@odata.id": format!("{ROOT}/TaskService")},
    }))
}

async fn systems(State(sim): State<Simulator>) -> Json<Value> {
    let ids = sim.redfish_options().system_ids();
    collection(
        &format!("{ROOT}/Systems"),
        "ComputerSystemCollection",
        "Computer System Collection",
        ids.iter().map(|id| format!("{ROOT}/Systems/{id}")),
    )
}

async fn system(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
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

async fn inventory(State(sim): State<Simulator>) -> Json<Value> {
    let ids = sim.redfish_options().system_ids();
    collection(
        &format!("{ROOT}/UpdateService/FirmwareInventory"),
        "SoftwareInventoryCollection",
        "Firmware Inventory Collection",
        ids.iter().map(|id| format!("{ROOT}/UpdateService/FirmwareInventory/{id}")),
    )
}

async fn inventory_member(State(sim): State<Simulator>, Path(id): Path<String>) -> Response {
    if !sim.redfish_options().has_system(&id) {
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

async fn tasks(State(sim): State<Simulator>) -> Json<Value> {
    let count = sim.state().tasks.tasks.len() as u64;
    collection(&format!("{ROOT}/TaskService/Tasks"), "TaskCollection", "Task Collection", (1..=count).map(task_uri))
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

/// What a `SimpleUpdate` asks for: the machine, the version and the tag.
fn read_update(options: &RedfishOptions, body: &Value) -> Result<(String, FlashRequest), Response> {
    let Some(body) = body.as_object() else {
        return Err(error(StatusCode::BAD_REQUEST, "Base.1.8.MalformedJSON", "the body must be a JSON object"));
    };
    let Some(image) = body.get("ImageURI").and_then(Value::as_str) else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "Base.1.8.ActionParameterMissing",
            "SimpleUpdate requires the ImageURI parameter",
        ));
    };
    let format_error = |detail: &str| error(StatusCode::BAD_REQUEST, "Base.1.8.ActionParameterValueFormatError", detail);
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
            return Err(error(
                StatusCode::BAD_REQUEST,
                "Base.1.8.ActionParameterMissing",
                "this service manages several systems: Targets must name one",
            ));
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
async fn simple_update(State(sim): State<Simulator>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let options = sim.redfish_options();
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => return error(rejection.status(), "Base.1.8.MalformedJSON", &rejection.body_text()),
    };
    let (machine, request) = match read_update(&options, &body) {
        Ok(update) => update,
        Err(response) => return response,
    };
    let json_body = options.keep_payload.then(|| body.to_string());
    // As with the native API, the write is scheduled inside the work: it runs on whatever the
    // caller does, even when the answer is dropped.
    let writer = sim.clone();
    let flash_time = sim.flash_time();
    let verified = !super::roll(sim.flash_failure());
    let created = sim
        .mutate(move |state| {
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
