//! The JSON shapes of the leasebroker API (SPEC 3.2).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Whether `s` is 1 to 128 ASCII letters, digits, `-` or `_`: safe in a URL path as it is (no `/`,
/// `.` or `%`), so a validated id can never address another route.
pub(crate) fn is_path_safe_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// An id type: a validated string, parsed with `FromStr` or `TryFrom<String>` (also by serde).
macro_rules! path_safe_id {
    ($(#[$doc:meta])* $name:ident, $(#[$err_doc:meta])* $error:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        $(#[$err_doc])*
        #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
        #[error("{} is 1 to 128 ASCII letters, digits, '-' or '_' (got {:?})", $what, .0)]
        pub struct $error(String);

        impl FromStr for $name {
            type Err = $error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                if is_path_safe_id(s) { Ok($name(s.to_owned())) } else { Err($error(s.to_owned())) }
            }
        }

        impl TryFrom<String> for $name {
            type Error = $error;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

pub(crate) use path_safe_id;

path_safe_id!(
    /// A worker id such as `wkr-7Q2K9`: 1 to 128 ASCII letters, digits, `-` or `_`.
    ///
    /// The restriction keeps an id safe to put in a URL path as it is (no `/`, `.` or `%`).
    WorkerId,
    /// A string that is not a valid worker id.
    InvalidWorkerId,
    "a worker id"
);

path_safe_id!(
    /// A node id such as `node-0001`: 1 to 128 ASCII letters, digits, `-` or `_`, like [`WorkerId`].
    NodeId,
    /// A string that is not a valid node id.
    InvalidNodeId,
    "a node id"
);

path_safe_id!(
    /// The server's id of a long-running operation, such as `op-5f1c2a`: 1 to 128 ASCII letters,
    /// digits, `-` or `_`, like [`WorkerId`].
    ///
    /// Not to be confused with lbctl's `--op-id`, the caller's own name for a request in the
    /// journal.
    OperationId,
    /// A string that is not a valid operation id.
    InvalidOperationId,
    "an operation id"
);

/// The body of `POST /v1/workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateWorker {
    /// The image to boot.
    pub image: String,
    /// CPUs.
    pub cpu: u32,
    /// Memory in GiB.
    pub memory_gb: u32,
    /// Labels; `None` leaves the field out of the body, which the server may treat differently
    /// from an empty map.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

impl CreateWorker {
    /// A request without labels.
    pub fn new(image: impl Into<String>, cpu: u32, memory_gb: u32) -> Self {
        CreateWorker { image: image.into(), cpu, memory_gb, labels: None }
    }
}

/// A worker's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum WorkerState {
    /// Its VM is starting.
    Booting,
    /// Its VM is up.
    Running,
}

/// A worker, as the server returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Worker {
    /// Its id.
    pub id: WorkerId,
    /// Its state.
    pub state: WorkerState,
    /// The image it runs.
    pub image: String,
    /// CPUs.
    pub cpu: u32,
    /// Memory in GiB.
    pub memory_gb: u32,
    /// Its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The node it was allocated on.
    pub node_id: Option<String>,
    /// Its lease.
    pub lease_id: Option<String>,
    /// Its VM at the hypervisor.
    pub vm_id: Option<String>,
    /// How many reboots it has had.
    #[serde(default)]
    pub reboot_count: u64,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// One page of `GET /v1/workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerPage {
    /// The caller's workers on this page.
    pub workers: Vec<Worker>,
    /// The cursor of the next page, `None` on the last one.
    pub next_cursor: Option<String>,
}

/// The body of `202` from `POST /v1/workers/{id}/reboot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebootResult {
    /// The worker.
    pub id: WorkerId,
    /// Its reboot count after this reboot.
    pub reboot_count: u64,
}

/// `GET /admin/v1/fleet`: the service's totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fleet {
    /// Nodes in the pool.
    pub nodes_total: u64,
    /// Nodes with a worker on them.
    pub nodes_allocated: u64,
    /// Leases not yet released.
    pub leases_active: u64,
    /// Workers not deleted.
    pub workers_active: u64,
    /// VMs running at the hypervisor.
    pub vms_running: u64,
    /// VM boots ever made.
    pub vm_boots_total: u64,
    /// Reboots ever made.
    pub reboots_total: u64,
    /// Firmware flashes ever started (0 from a server without firmware operations).
    #[serde(default)]
    pub firmware_flashes_total: u64,
    /// Nodes whose BMC is bricked (0 from a server without firmware operations).
    #[serde(default)]
    pub nodes_bricked: u64,
}

/// The body of `POST /admin/v1/nodes/{node_id}/firmware`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlashFirmware {
    /// The firmware version to write.
    pub version: String,
    /// Flash even though a worker holds the node (its VM is disrupted); without it the server
    /// answers `409 node-in-use` for a held node.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

impl FlashFirmware {
    /// A request to flash `version` (refused while a worker holds the node).
    pub fn new(version: impl Into<String>) -> Self {
        FlashFirmware { version: version.into(), force: false }
    }

    /// The same request, flashing even a node a worker holds.
    pub fn forced(self) -> Self {
        FlashFirmware { force: true, ..self }
    }
}

/// What a long-running operation does. A kind this client does not know yet is kept as
/// [`OperationKind::Other`], so a newer server's operations still parse.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum OperationKind {
    /// `firmware-flash`: a node's BMC firmware is written.
    FirmwareFlash,
    /// A kind this client does not know, as the server named it.
    Other(String),
}

impl OperationKind {
    /// The kind as the server names it.
    pub fn as_str(&self) -> &str {
        match self {
            OperationKind::FirmwareFlash => "firmware-flash",
            OperationKind::Other(kind) => kind,
        }
    }
}

impl From<String> for OperationKind {
    fn from(kind: String) -> Self {
        match kind.as_str() {
            "firmware-flash" => OperationKind::FirmwareFlash,
            _ => OperationKind::Other(kind),
        }
    }
}

impl From<OperationKind> for String {
    fn from(kind: OperationKind) -> String {
        match kind {
            OperationKind::Other(kind) => kind,
            known => known.as_str().to_owned(),
        }
    }
}

impl fmt::Display for OperationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a long-running operation is. A state this client does not know yet is kept as
/// [`OperationState::Other`] instead of failing the parse: a newer server may add states, and a
/// client that cannot read them would lose track of an operation that is still running.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum OperationState {
    /// The work goes on.
    Running,
    /// The work is done.
    Succeeded,
    /// The work ended without success; [`Operation::error`] says why.
    Failed,
    /// A state this client does not know, as the server named it.
    Other(String),
}

impl OperationState {
    /// The state as the server names it.
    pub fn as_str(&self) -> &str {
        match self {
            OperationState::Running => "running",
            OperationState::Succeeded => "succeeded",
            OperationState::Failed => "failed",
            OperationState::Other(state) => state,
        }
    }

    /// Whether this is one of the known final states (`succeeded`, `failed`). An unknown state
    /// is not known to be final: see [`Operation::is_finished`].
    pub fn is_terminal(&self) -> bool {
        matches!(self, OperationState::Succeeded | OperationState::Failed)
    }
}

impl From<String> for OperationState {
    fn from(state: String) -> Self {
        match state.as_str() {
            "running" => OperationState::Running,
            "succeeded" => OperationState::Succeeded,
            "failed" => OperationState::Failed,
            _ => OperationState::Other(state),
        }
    }
}

impl From<OperationState> for String {
    fn from(state: OperationState) -> String {
        match state {
            OperationState::Other(state) => state,
            known => known.as_str().to_owned(),
        }
    }
}

impl fmt::Display for OperationState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A long-running operation (`GET /admin/v1/operations/{op_id}`), such as a firmware flash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Operation {
    /// Its id (`op-...`).
    pub id: OperationId,
    /// What it does.
    pub kind: OperationKind,
    /// The node it works on.
    pub node_id: NodeId,
    /// The firmware version it writes.
    pub version: String,
    /// Where it is.
    pub state: OperationState,
    /// Why it failed, when it did.
    #[serde(default)]
    pub error: Option<String>,
    /// When it was accepted.
    pub created_at: DateTime<Utc>,
    /// When it ended; `None` while it runs.
    #[serde(default)]
    pub finished_at: Option<DateTime<Utc>>,
}

impl Operation {
    /// Whether the operation has ended: its state is `succeeded` or `failed`, or a state this
    /// client does not know together with a `finished_at` (a newer server's final state).
    pub fn is_finished(&self) -> bool {
        match self.state {
            OperationState::Other(_) => self.finished_at.is_some(),
            ref state => state.is_terminal(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPERATION: &str = r#"{"id":"op-5f1c2a","kind":"firmware-flash","node_id":"node-0007","version":"2.1.0",
        "state":"running","error":null,"created_at":"2026-11-30T21:00:00.5Z","finished_at":null}"#;

    fn with(field: &str, value: serde_json::Value) -> serde_json::Value {
        let mut op: serde_json::Value = serde_json::from_str(OPERATION).unwrap();
        op[field] = value;
        op
    }

    #[test]
    fn ids_accept_path_safe_text_only() {
        for good in ["op-5f1c2a", "A_9", &"x".repeat(128)] {
            assert_eq!(good.parse::<OperationId>().unwrap().as_str(), good);
            assert_eq!(good.parse::<NodeId>().unwrap().to_string(), good);
        }
        for bad in ["", "../fleet", "op/1", "op.1", "op%2F", "op 1", "op-é", &"x".repeat(129)] {
            let err = bad.parse::<OperationId>().unwrap_err();
            assert!(err.to_string().starts_with("an operation id is 1 to 128"), "{err}");
            assert!(bad.parse::<NodeId>().is_err(), "{bad:?}");
            assert!(bad.parse::<WorkerId>().is_err(), "{bad:?}");
        }
        // Serde validates too: an id that could escape its path never reaches a URL.
        assert!(serde_json::from_value::<Operation>(with("id", "../../v1/workers".into())).is_err());
        assert!(serde_json::from_value::<Operation>(with("node_id", "a/b".into())).is_err());
    }

    #[test]
    fn an_operation_parses_and_round_trips() {
        let op: Operation = serde_json::from_str(OPERATION).unwrap();
        assert_eq!(op.id.as_str(), "op-5f1c2a");
        assert_eq!(op.kind, OperationKind::FirmwareFlash);
        assert_eq!(op.node_id.as_str(), "node-0007");
        assert_eq!(op.state, OperationState::Running);
        assert_eq!((op.error.as_deref(), op.finished_at), (None, None));
        assert!(!op.is_finished());
        let again: Operation = serde_json::from_value(serde_json::to_value(&op).unwrap()).unwrap();
        assert_eq!(again, op);
        assert_eq!(serde_json::to_value(&op).unwrap()["kind"], "firmware-flash");
    }

    #[test]
    fn known_final_states_are_finished() {
        let done = with("finished_at", "2026-11-30T21:00:03Z".into());
        for (state, expected) in [("succeeded", OperationState::Succeeded), ("failed", OperationState::Failed)] {
            let mut op = done.clone();
            op["state"] = state.into();
            let op: Operation = serde_json::from_value(op).unwrap();
            assert_eq!(op.state, expected);
            assert!(op.state.is_terminal() && op.is_finished(), "{state}");
            assert_eq!(op.state.to_string(), state);
        }
        let failed: Operation =
            serde_json::from_value(with("state", "failed".into()).tap(|v| v["error"] = "BMC refused".into())).unwrap();
        assert_eq!(failed.error.as_deref(), Some("BMC refused"));
        // Finished by its state even if the server left finished_at out.
        assert!(failed.is_finished());
    }

    #[test]
    fn unknown_states_and_kinds_parse_and_are_kept() {
        let op: Operation = serde_json::from_value(with("state", "verifying".into())).unwrap();
        assert_eq!(op.state, OperationState::Other("verifying".into()));
        assert!(!op.state.is_terminal());
        assert!(!op.is_finished(), "an unknown state without finished_at is still going");
        assert_eq!(serde_json::to_value(&op).unwrap()["state"], "verifying");

        let ended = with("state", "cancelled".into()).tap(|v| v["finished_at"] = "2026-11-30T21:01:00Z".into());
        let op: Operation = serde_json::from_value(ended).unwrap();
        assert!(op.is_finished(), "an unknown state with finished_at has ended");

        let op: Operation = serde_json::from_value(with("kind", "bios-update".into())).unwrap();
        assert_eq!(op.kind, OperationKind::Other("bios-update".into()));
        assert_eq!(op.kind.to_string(), "bios-update");
    }

    #[test]
    fn malformed_operations_are_refused() {
        for (field, value) in [
            ("state", serde_json::Value::Null),
            ("state", 3.into()),
            ("created_at", "yesterday".into()),
            ("finished_at", "soon".into()),
            ("version", serde_json::Value::Null),
        ] {
            assert!(serde_json::from_value::<Operation>(with(field, value.clone())).is_err(), "{field}: {value}");
        }
        let mut missing: serde_json::Value = serde_json::from_str(OPERATION).unwrap();
        missing.as_object_mut().unwrap().remove("node_id");
        assert!(serde_json::from_value::<Operation>(missing).is_err());
    }

    #[test]
    fn flash_firmware_is_one_field() {
        assert_eq!(serde_json::to_string(&FlashFirmware::new("2.1.0")).unwrap(), r#"{"version":"2.1.0"}"#);
    }

    #[test]
    fn fleet_from_an_older_server_reads_zero_flashes() {
        let old = r#"{"nodes_total":4,"nodes_allocated":1,"leases_active":1,"workers_active":1,"vms_running":1,
            "vm_boots_total":1,"reboots_total":0}"#;
        let fleet: Fleet = serde_json::from_str(old).unwrap();
        assert_eq!((fleet.firmware_flashes_total, fleet.nodes_bricked), (0, 0));
    }

    trait Tap: Sized {
        fn tap(self, f: impl FnOnce(&mut Self)) -> Self;
    }

    impl Tap for serde_json::Value {
        fn tap(mut self, f: impl FnOnce(&mut Self)) -> Self {
            f(&mut self);
            self
        }
    }
}
