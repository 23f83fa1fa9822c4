//! Firmware flashes through a Redfish BMC (docs/protocol.md#real-downstreams): `--bmc-url redfish+http://HOST:PORT`.
//!
//! Redfish has no request id: `UpdateService.SimpleUpdate` answers `202` and a task monitor, and
//! a caller that lost that answer must find out by itself whether the BMC took the flash. So the
//! flash's tag rides in the image URI (`IMAGES/VERSION?tag=T`), where a BMC that keeps its tasks'
//! payloads shows it again in `Payload.JsonBody`.
//!
//! The client reads only what Redfish promises (`@odata.id`, `Members`, `TaskState`, `TaskStatus`,
//! the `Location` header; `Id`, `Name` and an inventory item's `Version` where it must) and
//! tolerates the absence of everything else; a collection's members may come expanded or as
//! links. Every URI it follows is taken relative to the service's own host, whatever host a
//! `Location` names, so the credentials in `--bmc-url` never go elsewhere.
//!
//! - [`RedfishBmc::target`]: the `Systems` member whose `Id` or `Name` is the node id goes in
//!   `Targets`; a BMC that serves one machine is flashed without `Targets`.
//! - [`RedfishBmc::flash`]: `SimpleUpdate`, any `2xx` accepted, one request and nothing else (every
//!   read it needs, [`RedfishBmc::target`], comes before); returns where the task is followed
//!   (the `Location`, else the answer's `@odata.id`), as a path on the BMC, which the caller keeps
//!   with the operation in its database.
//! - [`RedfishBmc::find_task`]: the task whose payload carries the tag, or, in the same pass,
//!   whether any task still runs; or that the BMC lists no tasks at all.
//! - [`RedfishBmc::task_outcome`]: `Completed` with `TaskStatus` `OK` (or `Warning`) succeeded;
//!   `Exception`, `Killed`, `Cancelled` (or `Completed` + `Critical`) failed; anything else runs.
//! - [`RedfishBmc::firmware`]: what a caller reads when no task carries its tag (a BMC that
//!   keeps no payload): whether the node's `FirmwareInventory` shows the version, or that the BMC
//!   serves no inventory.

use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode, Url};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::HvError;
use super::http::{Endpoint, check, check_success};

/// The scheme prefix that selects this backend in `--bmc-url`.
pub const URL_PREFIX: &str = super::url::REDFISH_PREFIX;

const SYSTEMS: &str = "/redfish/v1/Systems";
const SIMPLE_UPDATE: &str = "/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate";
const FIRMWARE_INVENTORY: &str = "/redfish/v1/UpdateService/FirmwareInventory";
const TASKS: &str = "/redfish/v1/TaskService/Tasks";

/// A Redfish service's BMC, for firmware flashes.
///
/// Cheap to clone: clones share the connection pool. It keeps nothing of the flashes it sent:
/// where a task is followed goes to the caller's database, so any replica can follow it.
#[derive(Debug, Clone)]
pub struct RedfishBmc {
    /// The hypervisor client's HTTP client with the key propagation: a flash carries its tag as
    /// `Idempotency-Key: "<tag>"`.
    keyed: reqwest_middleware::ClientWithMiddleware,
    /// The service's root (`http[s]://[USER:PASSWORD@]HOST:PORT/`): reqwest sends the user
    /// information as basic authentication.
    base: Url,
    /// Where the firmware images are: a flash's `ImageURI` is `IMAGES/VERSION?tag=T`.
    images: Url,
}

/// Where a node's flash goes on a BMC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The `Systems` member (its `@odata.id`) that is the node: named in `Targets`.
    System(String),
    /// The BMC serves one machine (or lists none): flashed without `Targets`.
    OnlyMachine,
    /// The BMC lists several systems and none is the node: nothing can be flashed.
    NotListed {
        /// How many systems it lists.
        systems: usize,
    },
}

/// What [`RedfishBmc::find_task`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskLookup {
    /// Where the flash's task is followed: a path (and query) on the BMC.
    Found(String),
    /// No task carries the tag; `busy`: another task still runs (which may be this flash, on a
    /// BMC that keeps no payload).
    NotFound {
        /// Whether any task on the BMC still runs.
        busy: bool,
    },
    /// The BMC serves no task list (`404`, as sushy-tools): no task can be found by its tag,
    /// and whether one still runs cannot be read.
    Unlisted,
}

/// What a node's firmware inventory says of a version ([`RedfishBmc::firmware`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Firmware {
    /// An item of the node shows the version.
    Runs,
    /// The BMC serves an inventory, and no item of the node shows the version.
    Absent,
    /// The BMC serves no firmware inventory (`404`): the version cannot be read.
    NotServed,
}

/// What a flash's task says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskOutcome {
    /// Still running (or not started).
    Running,
    /// Completed.
    Succeeded,
    /// Ended without completing, or completed with a critical status: why.
    Failed(String),
    /// The task (or its monitor) is gone: the BMC no longer says.
    Gone,
}

/// A resource as this client reads it: every field optional, anything else ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Resource {
    #[serde(rename = "@odata.id")]
    odata_id: Option<String>,
    id: Option<String>,
    name: Option<String>,
    members: Option<Vec<Resource>>,
    task_state: Option<String>,
    task_status: Option<String>,
    payload: Option<Payload>,
    version: Option<String>,
    related_item: Option<Vec<Resource>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Payload {
    /// A string holding the request's JSON (as the schema says), or, on some BMCs, the JSON itself.
    json_body: Option<Value>,
}

impl Resource {
    fn names(&self, node_id: &str) -> bool {
        self.id.as_deref() == Some(node_id) || self.name.as_deref() == Some(node_id)
    }

    /// The tag of the `SimpleUpdate` whose payload this task keeps, if it keeps one.
    fn payload_tag(&self) -> Option<String> {
        let body = self.payload.as_ref()?.json_body.as_ref()?;
        let body = match body {
            Value::String(text) => serde_json::from_str::<Value>(text).ok()?,
            other => other.clone(),
        };
        let image = Url::parse(body.get("ImageURI")?.as_str()?).ok()?;
        image.query_pairs().find(|(k, _)| k == "tag").map(|(_, v)| v.into_owned())
    }

    /// Whether an expanded member already holds what a caller reads, so it need not be fetched.
    fn is_expanded(&self) -> bool {
        self.id.is_some() || self.task_state.is_some() || self.version.is_some()
    }
}

/// The last segment of a URI's path.
fn last_segment(uri: &str) -> &str {
    uri.trim_end_matches('/').rsplit('/').next().unwrap_or_default()
}

impl RedfishBmc {
    /// The BMC at `url` (`redfish+http://HOST:PORT` or `redfish+https://...`, optionally with
    /// `USER:PASSWORD@`), each call bounded by `timeout`, trusting `ca_cert` (PEM) besides the
    /// system's roots for https; images are named under `images`. Contacts nothing.
    pub fn new(url: &str, timeout: Duration, ca_cert: Option<&Path>, images: &str) -> Result<Self, HvError> {
        let invalid = |reason: &str| HvError::InvalidSetting {
            flag: "--bmc-url",
            value: url.to_owned(),
            reason: reason.to_owned(),
        };
        let plain = url
            .strip_prefix(URL_PREFIX)
            .ok_or_else(|| invalid("a Redfish URL is redfish+http://HOST:PORT or redfish+https://HOST:PORT"))?;
        let endpoint = Endpoint::new(plain, timeout, reqwest::header::HeaderMap::new(), ca_cert, None)
            .map_err(|e| if let HvError::InvalidUrl { reason, .. } = e { invalid(&reason) } else { e })?;
        let base = Url::parse(plain).map_err(|e| invalid(&e.to_string()))?;
        if !matches!(base.path(), "" | "/") {
            return Err(invalid("a Redfish service is at its host's root: give no path"));
        }
        let invalid_images =
            |reason: String| HvError::InvalidSetting { flag: "--firmware-images", value: images.to_owned(), reason };
        let images = Url::parse(images).map_err(|e| invalid_images(e.to_string()))?;
        if !matches!(images.scheme(), "http" | "https" | "ftp" | "sftp" | "tftp" | "nfs" | "cifs" | "file")
            || images.cannot_be_a_base()
            || images.query().is_some()
            || images.fragment().is_some()
        {
            return Err(invalid_images("an absolute URL a BMC can fetch from, without a query".to_owned()));
        }
        Ok(Self { keyed: endpoint.keyed, base, images })
    }

    /// The `ImageURI` of `version`, carrying `tag`.
    pub fn image_uri(&self, version: &str, tag: &str) -> Url {
        let mut uri = self.images.clone();
        if let Ok(mut path) = uri.path_segments_mut() {
            path.pop_if_empty().push(version);
        }
        uri.query_pairs_mut().append_pair("tag", tag);
        uri
    }

    /// Where the node's flash goes (see [`Target`]).
    pub async fn target(&self, node_id: &str) -> Result<Target, HvError> {
        let systems = self.members(SYSTEMS).await?;
        // The member whose URI ends in the node id is the likely one: read it first.
        let mut order: Vec<&Resource> = systems.iter().collect();
        order.sort_by_key(|m| m.odata_id.as_deref().map(last_segment) != Some(node_id));
        for member in order {
            let Some(uri) = &member.odata_id else { continue };
            let system = if member.is_expanded() { None } else { self.read(uri).await? };
            if system.as_ref().unwrap_or(member).names(node_id) {
                return Ok(Target::System(uri.clone()));
            }
        }
        Ok(if systems.len() <= 1 { Target::OnlyMachine } else { Target::NotListed { systems: systems.len() } })
    }

    /// Sends `SimpleUpdate` of `version` tagged `tag` to `target`: that one request, no read
    /// before it (the caller resolved `target` before it decided to send). Any `2xx` is accepted;
    /// returns where its task is followed (the `Location`, else the answer's `@odata.id`), as a
    /// path on the BMC, when the BMC said.
    pub async fn flash(&self, target: &Target, version: &str, tag: &str) -> Result<Option<String>, HvError> {
        let mut body = json!({"ImageURI": self.image_uri(version, tag).as_str()});
        if let Target::System(system) = target {
            body["Targets"] = json!([system]);
        }
        let response = self.send(Method::POST, self.at(SIMPLE_UPDATE), Some(&body), Some(tag)).await?;
        let response = check_success(response).await?;
        let location = response.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok());
        let mut follow = location.and_then(on_bmc);
        // The body is optional: a flash the BMC accepted stays accepted whatever follows.
        if let Ok(answer) = response.json::<Resource>().await
            && follow.is_none()
        {
            follow = answer.odata_id.as_deref().and_then(on_bmc);
        }
        if follow.is_none() {
            tracing::info!(tag, "the BMC took the flash without saying where its task is");
        }
        Ok(follow)
    }

    /// The task whose `Payload.JsonBody` carries `tag`. When no task does (the BMC keeps no
    /// payload, or never took the flash), whether any task still runs, read in the same pass;
    /// [`TaskLookup::Unlisted`] when the BMC serves no task list.
    pub async fn find_task(&self, tag: &str) -> Result<TaskLookup, HvError> {
        let Some(tasks) = self.read(TASKS).await? else { return Ok(TaskLookup::Unlisted) };
        let mut busy = false;
        // Newest first: the flash looked for is most likely among the last tasks.
        for member in tasks.members.unwrap_or_default().iter().rev() {
            let fetched = match &member.odata_id {
                Some(uri) if member.task_state.is_none() || member.payload.is_none() => self.read(uri).await?,
                _ => None,
            };
            let task = fetched.as_ref().unwrap_or(member);
            if task.payload_tag().as_deref() == Some(tag)
                && let Some(uri) = member.odata_id.as_deref().and_then(on_bmc)
            {
                return Ok(TaskLookup::Found(uri));
            }
            // A member that is gone by now (or says nothing of its state) does not run.
            busy |= task.task_state.is_some() && outcome(task) == TaskOutcome::Running;
        }
        Ok(TaskLookup::NotFound { busy })
    }

    /// Reads a task or its monitor (`uri`, as [`RedfishBmc::flash`] or [`RedfishBmc::find_task`]
    /// gave it). A monitor answers its operation's own status once it ended: a `4xx` there is a
    /// failed flash. A `5xx` or a lost connection is an error (ask again later).
    pub async fn task_outcome(&self, uri: &str) -> Result<TaskOutcome, HvError> {
        let Some(url) = self.resolve(uri) else { return Ok(TaskOutcome::Gone) };
        let response = self.send(Method::GET, url, None, None).await?;
        let status = response.status();
        if matches!(status, StatusCode::NOT_FOUND | StatusCode::GONE) {
            return Ok(TaskOutcome::Gone);
        }
        if status == StatusCode::ACCEPTED {
            return Ok(TaskOutcome::Running);
        }
        if status.is_client_error() {
            return Ok(TaskOutcome::Failed(format!("the BMC's task monitor answered {}", status.as_u16())));
        }
        let response = check_success(response).await?;
        match response.json::<Resource>().await {
            Ok(task) if task.task_state.is_some() => Ok(outcome(&task)),
            // A monitor that answers its operation's own success, without the task.
            _ => Ok(TaskOutcome::Succeeded),
        }
    }

    /// Whether the node's firmware inventory shows `version`: an item related to the node's
    /// system `target` (or named after the node) on a BMC of several systems, any item on a BMC
    /// of one; [`Firmware::NotServed`] when the BMC serves no inventory.
    pub async fn firmware(&self, target: &Target, node_id: &str, version: &str) -> Result<Firmware, HvError> {
        let Some(inventory) = self.read(FIRMWARE_INVENTORY).await? else { return Ok(Firmware::NotServed) };
        for member in inventory.members.unwrap_or_default() {
            let item = match &member.odata_id {
                Some(uri) if !member.is_expanded() => match self.read(uri).await? {
                    Some(item) => item,
                    None => continue,
                },
                _ => member,
            };
            let relates = match target {
                Target::OnlyMachine => true,
                Target::NotListed { .. } => false,
                Target::System(system) => {
                    item.names(node_id)
                        || item.related_item.iter().flatten().any(|r| {
                            r.odata_id.as_deref().map(|id| id.trim_end_matches('/'))
                                == Some(system.trim_end_matches('/'))
                        })
                }
            };
            if relates && item.version.as_deref() == Some(version) {
                return Ok(Firmware::Runs);
            }
        }
        Ok(Firmware::Absent)
    }

    /// Whether the node runs `version` (its `Systems` member read first): what comes before a
    /// flash is sent, and what a failed task is checked against.
    pub async fn runs_version(&self, node_id: &str, version: &str) -> Result<Firmware, HvError> {
        let target = self.target(node_id).await?;
        self.firmware(&target, node_id, version).await
    }

    /// `path` on the service.
    fn at(&self, path: &str) -> Url {
        let mut url = self.base.clone();
        url.set_path(path);
        url
    }

    /// A URI the BMC gave (absolute or a path), on the service's own host.
    fn resolve(&self, uri: &str) -> Option<Url> {
        let relative = on_bmc(uri)?;
        let (path, query) = match relative.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (relative.as_str(), None),
        };
        let mut url = self.at(path);
        url.set_query(query);
        Some(url)
    }

    /// A collection's members (empty when it has none).
    async fn members(&self, path: &str) -> Result<Vec<Resource>, HvError> {
        Ok(self.read(path).await?.and_then(|c| c.members).unwrap_or_default())
    }

    /// A resource, or `None` when the BMC has none there (`404`).
    async fn read(&self, uri: &str) -> Result<Option<Resource>, HvError> {
        let Some(url) = self.resolve(uri) else { return Ok(None) };
        let response = self.send(Method::GET, url, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let response = check(response, StatusCode::OK).await?;
        response.json().await.map(Some).map_err(|e| HvError::from_transport(e.without_url()))
    }

    /// One call; `key` (a flash's tag, its derived sub-key) goes out as its `Idempotency-Key`
    /// through the key propagation middleware.
    async fn send(
        &self,
        method: Method,
        url: Url,
        body: Option<&Value>,
        key: Option<&str>,
    ) -> Result<reqwest::Response, HvError> {
        let mut request = self.keyed.request(method.clone(), url);
        if let Some(key) = key {
            request = request.with_extension(idempotency_tower::CallKey::new(key));
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let span = tracing::info_span!(
            target: "leasebroker::downstream",
            "bmc.call",
            otel.name = %format!("{method} redfish"),
            otel.kind = "client",
            http.request.method = %method,
            http.response.status_code = tracing::field::Empty,
        );
        // The URL may carry the BMC's credentials: it stays out of the error.
        let result = tracing::Instrument::instrument(request.send(), span.clone()).await.map_err(|e| match e {
            reqwest_middleware::Error::Reqwest(e) => reqwest_middleware::Error::Reqwest(e.without_url()),
            e => e,
        });
        match &result {
            Ok(response) => {
                span.record("http.response.status_code", response.status().as_u16());
            }
            Err(err) => tracing::debug!(%method, error = %err, "Redfish call failed"),
        }
        result.map_err(HvError::from_middleware)
    }
}

/// A URI the BMC gave (absolute or a path) as a path and query on the BMC: its host (which may
/// name another) and any user information dropped, so that what is kept names nothing but the
/// resource and is always followed on the BMC's own host.
fn on_bmc(uri: &str) -> Option<String> {
    match Url::parse(uri) {
        Ok(absolute) => Some(match absolute.query() {
            Some(query) => format!("{}?{query}", absolute.path()),
            None => absolute.path().to_owned(),
        }),
        Err(_) if uri.starts_with('/') => Some(uri.to_owned()),
        Err(_) => None,
    }
}

/// What a task's `TaskState` and `TaskStatus` say.
fn outcome(task: &Resource) -> TaskOutcome {
    let status = task.task_status.as_deref();
    match task.task_state.as_deref() {
        Some("Completed") if status == Some("Critical") => {
            TaskOutcome::Failed("the BMC's task completed with status Critical".to_owned())
        }
        Some("Completed") => TaskOutcome::Succeeded,
        Some(state @ ("Exception" | "Killed" | "Cancelled")) => {
            TaskOutcome::Failed(format!("the BMC's task ended {state}"))
        }
        _ => TaskOutcome::Running,
    }
}

#[cfg(test)]
mod tests {
    use axum::Json;
    use axum::http::HeaderMap;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// A BMC shaped unlike the simulator: systems whose `Id` is not the node (their `Name` is),
    /// a `202` with no body and a `Location` on another host, expanded task members whose
    /// payload's `JsonBody` is an object, a task with no `TaskStatus`, and basic authentication.
    async fn other_bmc() -> String {
        let app = axum::Router::new()
            .route(
                "/redfish/v1/Systems",
                get(|| async {
                    Json(json!({"Members": [{"@odata.id": "/redfish/v1/Systems/A"}, {"@odata.id": "/redfish/v1/Systems/B"}]}))
                }),
            )
            .route("/redfish/v1/Systems/A", get(|| async { Json(json!({"Id": "A", "Name": "node-0001"})) }))
            .route("/redfish/v1/Systems/B", get(|| async { Json(json!({"Id": "B", "Name": "spare"})) }))
            .route(
                "/redfish/v1/UpdateService/Actions/UpdateService.SimpleUpdate",
                post(|headers: HeaderMap, Json(body): Json<Value>| async move {
                    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Basic YWRtaW46czNjcmV0") {
                        return StatusCode::UNAUTHORIZED.into_response();
                    }
                    if body["Targets"] != json!(["/redfish/v1/Systems/A"]) {
                        return StatusCode::BAD_REQUEST.into_response();
                    }
                    // The flash carries its tag as its Idempotency-Key (key propagation).
                    let tag = body["ImageURI"].as_str().and_then(|u| u.split("tag=").nth(1)).unwrap_or_default();
                    if headers.get("idempotency-key").and_then(|v| v.to_str().ok()) != Some(&format!("\"{tag}\"")) {
                        return StatusCode::BAD_REQUEST.into_response();
                    }
                    let location = [("location", "https://elsewhere.example/redfish/v1/TaskService/Tasks/7")];
                    (StatusCode::ACCEPTED, location).into_response()
                }),
            )
            .route(
                "/redfish/v1/TaskService/Tasks",
                get(|| async {
                    Json(json!({"Members": [
                        {"@odata.id": "/redfish/v1/TaskService/Tasks/6", "TaskState": "Exception"},
                        {"@odata.id": "/redfish/v1/TaskService/Tasks/7", "TaskState": "Running",
                         "Payload": {"JsonBody": {"ImageURI": "http://images.test/x/9?tag=t-9"}}},
                    ]}))
                }),
            )
            .route("/redfish/v1/TaskService/Tasks/7", get(|| async { Json(json!({"TaskState": "Completed"})) }))
            .route("/monitors/8", get(|| async { (StatusCode::BAD_REQUEST, Json(json!({"error": {}}))) }))
            .route("/monitors/9", get(|| async { StatusCode::SERVICE_UNAVAILABLE }))
            .route(
                "/redfish/v1/UpdateService/FirmwareInventory",
                get(|| async { Json(json!({"Members": [{"@odata.id": "/inv/1"}, {"@odata.id": "/inv/2"}]})) }),
            )
            .route(
                "/inv/1",
                get(|| async { Json(json!({"Version": "9", "RelatedItem": [{"@odata.id": "/redfish/v1/Systems/A/"}]})) }),
            )
            .route("/inv/2", get(|| async { Json(json!({"Version": "10", "Name": "spare"})) }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("redfish+http://admin:s3cret@{addr}")
    }

    #[tokio::test]
    async fn a_bmc_of_another_shape_is_read_by_what_redfish_promises() {
        let url = other_bmc().await;
        let bmc = RedfishBmc::new(&url, TIMEOUT, None, "http://images.test/x").expect("client");
        let target = bmc.target("node-0001").await.expect("systems");
        assert_eq!(target, Target::System("/redfish/v1/Systems/A".into()), "found by Name");
        assert_eq!(bmc.target("node-0002").await.expect("systems"), Target::NotListed { systems: 2 });

        let task = bmc.flash(&target, "9", "t-9").await.expect("a 202 without a body, with basic authentication");
        let task = task.expect("the Location");
        assert_eq!(task, "/redfish/v1/TaskService/Tasks/7", "kept as a path: no other host, no credentials");
        assert_eq!(bmc.task_outcome(&task).await.expect("task"), TaskOutcome::Succeeded, "Completed, no TaskStatus");
        let failed = bmc.task_outcome("/monitors/8").await.expect("a 400");
        assert_eq!(failed, TaskOutcome::Failed("the BMC's task monitor answered 400".into()));
        let err = bmc.task_outcome("https://elsewhere.example/monitors/9").await.expect_err("a 503: ask again");
        assert!(err.may_have_happened(), "{err:?}");
        assert_eq!(bmc.task_outcome("/monitors/10").await.expect("a 404"), TaskOutcome::Gone);

        let TaskLookup::Found(found) = bmc.find_task("t-9").await.expect("tasks") else {
            panic!("by the tag in an expanded payload")
        };
        assert_eq!(found, "/redfish/v1/TaskService/Tasks/7");
        let lookup = bmc.find_task("t-8").await.expect("tasks");
        assert_eq!(lookup, TaskLookup::NotFound { busy: true }, "task 7 runs, as listed");

        assert_eq!(bmc.firmware(&target, "node-0001", "9").await.expect("inventory"), Firmware::Runs, "system A's");
        assert_eq!(bmc.firmware(&target, "node-0001", "10").await.expect("inventory"), Firmware::Absent, "B's item");
        assert_eq!(bmc.firmware(&Target::OnlyMachine, "node-0001", "10").await.expect("inventory"), Firmware::Runs);
        assert_eq!(bmc.runs_version("node-0001", "9").await.expect("inventory"), Firmware::Runs);
    }

    /// A BMC like sushy-tools: no task list and no firmware inventory (both `404`). Neither is
    /// read as empty: what they would say cannot be read.
    #[tokio::test]
    async fn a_bmc_without_a_task_list_or_an_inventory_says_so() {
        let app = axum::Router::new()
            .route(
                "/redfish/v1/Systems",
                get(|| async { Json(json!({"Members": [{"@odata.id": "/redfish/v1/Systems/u"}]})) }),
            )
            .route("/redfish/v1/Systems/u", get(|| async { Json(json!({"Id": "u", "Name": "node-0001"})) }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        let bmc =
            RedfishBmc::new(&format!("redfish+http://{addr}"), TIMEOUT, None, "http://images.test/x").expect("ok");
        assert_eq!(bmc.find_task("t-1").await.expect("tasks"), TaskLookup::Unlisted);
        assert_eq!(bmc.runs_version("node-0001", "1.0").await.expect("inventory"), Firmware::NotServed);
    }

    #[tokio::test]
    async fn without_credentials_the_bmc_refuses_definitely() {
        let url = other_bmc().await.replace("admin:s3cret@", "");
        let bmc = RedfishBmc::new(&url, TIMEOUT, None, "http://images.test/x").expect("client");
        let err = bmc.flash(&Target::System("/redfish/v1/Systems/A".into()), "9", "t").await.expect_err("401");
        assert_eq!(err.status(), Some(StatusCode::UNAUTHORIZED));
        assert!(!err.may_have_happened());
    }

    #[test]
    fn task_states_map_to_outcomes() {
        let task = |state: &str, status: Option<&str>| Resource {
            task_state: Some(state.to_owned()),
            task_status: status.map(str::to_owned),
            ..Resource::default()
        };
        assert_eq!(outcome(&task("Completed", Some("OK"))), TaskOutcome::Succeeded);
        assert_eq!(outcome(&task("Completed", Some("Warning"))), TaskOutcome::Succeeded);
        assert!(matches!(outcome(&task("Completed", Some("Critical"))), TaskOutcome::Failed(_)));
        for ended in ["Exception", "Killed", "Cancelled"] {
            assert!(matches!(outcome(&task(ended, Some("OK"))), TaskOutcome::Failed(e) if e.contains(ended)));
        }
        for running in ["New", "Starting", "Running", "Pending", "Suspended", "Interrupted", "Stopping", "Service"] {
            assert_eq!(outcome(&task(running, None)), TaskOutcome::Running, "{running}");
        }
    }

    #[test]
    fn urls_are_checked_up_front_and_image_uris_carry_the_tag() {
        for bad in
            ["http://bmc:8000", "redfish+ftp://bmc", "redfish+http://bmc/redfish/v1", "redfish+http://", "redfish+"]
        {
            let err = RedfishBmc::new(bad, TIMEOUT, None, "http://images.test/fw").expect_err(bad);
            assert!(matches!(err, HvError::InvalidSetting { flag: "--bmc-url", .. }), "{bad}: {err:?}");
        }
        for bad in ["http://images.test/fw?x=1", "images", "mailto:fw@images.test"] {
            let err = RedfishBmc::new("redfish+http://bmc:8000", TIMEOUT, None, bad).expect_err(bad);
            assert!(matches!(err, HvError::InvalidSetting { flag: "--firmware-images", .. }), "{bad}: {err:?}");
        }
        let bmc = RedfishBmc::new("redfish+https://bmc.example/", TIMEOUT, None, "http://images.test/fw/").expect("ok");
        assert_eq!(bmc.image_uri("2.4.1+b7", "tag&1").as_str(), "http://images.test/fw/2.4.1+b7?tag=tag%261");
    }
}
