//! Workers: the body that asks for one, the checks it must pass, and the worker as the API shows
//! it.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{InvalidRequest, WorkerId};

/// `POST /v1/workers` body.
// `cpu` and `memory_gb` are `i64` so that any JSON integer, a negative one too, reaches
// `validate` and gets its `422` message rather than a parse error.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateWorker {
    /// The image to boot, 1-200 characters, not blank, no control characters.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200, example = "worker-base:2025.11"))]
    pub image: String,
    /// CPUs, 1 to the node size.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, example = 16))]
    pub cpu: i64,
    /// Memory in GB, 1 to the node size.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, example = 64))]
    pub memory_gb: i64,
    /// At most 64 labels; keys 1-63 characters, values at most 255.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = json!({"team": "ml-eval"})))]
    pub labels: Option<BTreeMap<String, String>>,
}

/// Limits on a worker request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest `cpu`.
    pub node_cpu: i64,
    /// Largest `memory_gb`.
    pub node_memory_gb: i64,
}

/// The most labels a worker may carry.
pub const MAX_LABELS: usize = 64;
/// The longest label key.
pub const MAX_LABEL_KEY: usize = 63;
/// The longest label value.
pub const MAX_LABEL_VALUE: usize = 255;
/// The longest image name.
pub const MAX_IMAGE: usize = 200;

impl CreateWorker {
    /// A request without labels.
    pub fn new(image: impl Into<String>, cpu: u32, memory_gb: u32) -> Self {
        CreateWorker { image: image.into(), cpu: cpu.into(), memory_gb: memory_gb.into(), labels: None }
    }

    /// Checks every field; the first problem found is the error.
    pub fn validate(&self, limits: Limits) -> Result<(), InvalidRequest> {
        let invalid = |m: String| Err(InvalidRequest(m));
        let image_len = self.image.chars().count();
        if image_len == 0 || image_len > MAX_IMAGE {
            return invalid(format!("image must be 1 to {MAX_IMAGE} characters, got {image_len}"));
        }
        if self.image.chars().any(char::is_control) {
            return invalid("image must not contain control characters".into());
        }
        if self.image.trim().is_empty() {
            return invalid("image must not be blank".into());
        }
        if !(1..=limits.node_cpu).contains(&self.cpu) {
            return invalid(format!("cpu must be 1 to {}, got {}", limits.node_cpu, self.cpu));
        }
        if !(1..=limits.node_memory_gb).contains(&self.memory_gb) {
            return invalid(format!("memory_gb must be 1 to {}, got {}", limits.node_memory_gb, self.memory_gb));
        }
        if let Some(labels) = &self.labels {
            if labels.len() > MAX_LABELS {
                return invalid(format!("at most {MAX_LABELS} labels, got {}", labels.len()));
            }
            for (k, v) in labels {
                if k.is_empty() || k.chars().count() > MAX_LABEL_KEY {
                    return invalid(format!("label keys must be 1 to {MAX_LABEL_KEY} characters"));
                }
                if v.chars().count() > MAX_LABEL_VALUE {
                    return invalid(format!("label values must be at most {MAX_LABEL_VALUE} characters"));
                }
            }
        }
        Ok(())
    }
}

/// A worker's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum WorkerState {
    /// Its VM is starting.
    Booting,
    /// Its VM is up.
    Running,
}

impl WorkerState {
    /// The state as the API names it.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Booting => "booting",
            WorkerState::Running => "running",
        }
    }
}

impl fmt::Display for WorkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not a worker state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a worker state is booting or running (got {0:?})")]
pub struct InvalidWorkerState(String);

impl FromStr for WorkerState {
    type Err = InvalidWorkerState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "booting" => Ok(WorkerState::Booting),
            "running" => Ok(WorkerState::Running),
            _ => Err(InvalidWorkerState(s.to_owned())),
        }
    }
}

/// A worker as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Worker {
    /// Its id, `wkr-...`.
    pub id: WorkerId,
    /// `booting` or `running`.
    pub state: WorkerState,
    /// The image it runs.
    pub image: String,
    /// CPUs.
    pub cpu: u32,
    /// Memory in GB.
    pub memory_gb: u32,
    /// Its labels.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub labels: BTreeMap<String, String>,
    // The service always sends the next three; a client reads their absence or null as `None`.
    /// The node it runs on.
    #[cfg_attr(feature = "openapi", schema(value_type = String, required = true))]
    pub node_id: Option<String>,
    /// Its lease.
    #[cfg_attr(feature = "openapi", schema(value_type = String, required = true))]
    pub lease_id: Option<String>,
    /// Its VM at the hypervisor.
    #[cfg_attr(feature = "openapi", schema(value_type = String, required = true))]
    pub vm_id: Option<String>,
    /// Reboots done.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(required = true))]
    pub reboot_count: u64,
    /// When it was created: RFC 3339, UTC, microseconds.
    #[serde(with = "crate::time::micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: DateTime<Utc>,
}

/// One page of `GET /v1/workers`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerPage {
    /// The caller's workers on this page.
    pub workers: Vec<Worker>,
    /// Pass as `cursor` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

/// The body of `202` from `POST /v1/workers/{id}/reboot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RebootResult {
    /// The worker.
    pub id: WorkerId,
    /// Reboots done, counting this one.
    pub reboot_count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker as the service writes it (`GET /v1/workers/{id}`).
    const WORKER: &str = r#"{"id":"wkr-3f9c2a7d1e5b8c04","state":"running","image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{"team":"ml-eval"},"node_id":"node-0417","lease_id":"lease-9a1b2c3d4e5f6071","vm_id":"vm-5c0ffee","reboot_count":2,"created_at":"2026-11-30T22:14:07.123456Z"}"#;

    #[test]
    fn a_worker_round_trips_byte_for_byte() {
        let worker: Worker = serde_json::from_str(WORKER).unwrap();
        assert_eq!(worker.id.as_str(), "wkr-3f9c2a7d1e5b8c04");
        assert_eq!((worker.state, worker.cpu, worker.reboot_count), (WorkerState::Running, 16, 2));
        assert_eq!(worker.created_at.timestamp_subsec_micros(), 123_456);
        assert_eq!(serde_json::to_string(&worker).unwrap(), WORKER);
    }

    #[test]
    fn timestamps_are_written_with_microseconds_and_read_in_any_rfc3339_form() {
        let mut body: serde_json::Value = serde_json::from_str(WORKER).unwrap();
        for (sent, written) in [
            ("2026-11-30T22:14:07Z", "2026-11-30T22:14:07.000000Z"),
            ("2026-11-30T22:14:07.5Z", "2026-11-30T22:14:07.500000Z"),
            ("2026-11-30T23:14:07.123456789+01:00", "2026-11-30T22:14:07.123456Z"),
        ] {
            body["created_at"] = sent.into();
            let worker: Worker = serde_json::from_value(body.clone()).unwrap();
            assert_eq!(serde_json::to_value(&worker).unwrap()["created_at"], written, "{sent}");
        }
        body["created_at"] = "yesterday".into();
        assert!(serde_json::from_value::<Worker>(body).is_err());
    }

    #[test]
    fn a_worker_with_a_bad_id_or_state_is_refused() {
        let mut body: serde_json::Value = serde_json::from_str(WORKER).unwrap();
        body["id"] = "../../admin/v1/fleet".into();
        let err = serde_json::from_value::<Worker>(body.clone()).unwrap_err();
        assert!(err.to_string().starts_with("a worker id is 1 to 128"), "{err}");
        body["id"] = "wkr-1".into();
        body["state"] = "sleeping".into();
        assert!(serde_json::from_value::<Worker>(body).is_err());
        assert_eq!("booting".parse::<WorkerState>(), Ok(WorkerState::Booting));
        assert!("Booting".parse::<WorkerState>().is_err());
    }

    #[test]
    fn create_worker_leaves_out_absent_labels_and_refuses_unknown_fields() {
        let body = CreateWorker::new("worker-base", 2, 4);
        assert_eq!(serde_json::to_string(&body).unwrap(), r#"{"image":"worker-base","cpu":2,"memory_gb":4}"#);
        assert!(serde_json::from_str::<CreateWorker>(r#"{"image":"i","cpu":1,"memory_gb":1,"gpu":1}"#).is_err());
        let negative: CreateWorker = serde_json::from_str(r#"{"image":"i","cpu":-1,"memory_gb":1}"#).unwrap();
        let limits = Limits { node_cpu: 64, node_memory_gb: 512 };
        assert_eq!(negative.validate(limits).unwrap_err().message(), "cpu must be 1 to 64, got -1");
    }

    fn req(image: &str, cpu: i64, mem: i64, labels: usize) -> CreateWorker {
        CreateWorker {
            image: image.into(),
            cpu,
            memory_gb: mem,
            labels: Some((0..labels).map(|i| (format!("k{i}"), "v".into())).collect()),
        }
    }

    #[test]
    fn validation() {
        let l = Limits { node_cpu: 64, node_memory_gb: 512 };
        assert!(req("img", 16, 64, 2).validate(l).is_ok());
        assert!(req("", 16, 64, 0).validate(l).is_err());
        for blank in [" ", "   ", "\u{3000}\u{a0}"] {
            let e = req(blank, 16, 64, 0).validate(l).expect_err("a blank image");
            assert_eq!(e.message(), "image must not be blank");
        }
        assert!(req(" img ", 16, 64, 0).validate(l).is_ok(), "spaces around a name are the hypervisor's business");
        assert!(req(&"x".repeat(201), 16, 64, 0).validate(l).is_err());
        assert!(req("img", 0, 64, 0).validate(l).is_err());
        assert!(req("img", 65, 64, 0).validate(l).is_err());
        assert!(req("img", 1, 513, 0).validate(l).is_err());
        assert!(req("img", 1, 1, 65).validate(l).is_err());
        assert!(req("img", 1, 1, 64).validate(l).is_ok());
        let mut r = req("img", 1, 1, 0);
        r.labels = Some([("k".repeat(64), "v".into())].into());
        assert!(r.validate(l).is_err());
        r.labels = Some([("k".into(), "v".repeat(256))].into());
        assert!(r.validate(l).is_err());
    }
}
