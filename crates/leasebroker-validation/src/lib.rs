#![doc = include_str!("../README.md")]

pub mod parse;
pub mod problems;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A body field out of bounds: the service answers `422` with this message as the detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(String);

impl InvalidRequest {
    /// What is wrong, as the problem's detail says it.
    pub fn message(&self) -> &str {
        &self.0
    }
}

/// `POST /v1/workers` body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateWorker {
    /// The image to boot, 1-200 characters.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200, example = "worker-base:2025.11"))]
    pub image: String,
    /// CPUs, 1 to the node size.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, example = 16))]
    pub cpu: i64,
    /// Memory in GB, 1 to the node size.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, example = 64))]
    pub memory_gb: i64,
    /// At most 64 labels; keys 1-63 characters, values at most 255.
    #[serde(default)]
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

/// `POST /admin/v1/nodes/{node_id}/firmware` body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FlashFirmware {
    /// The firmware version to flash: 1-64 ASCII letters, digits, `.`, `-`, `_` or `+`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 64, example = "2.4.1"))]
    pub version: String,
    /// Flash even though a worker holds the node (its VM is disrupted). Without it, a flash of
    /// a held node answers `409 node-in-use`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// The longest firmware version.
pub const MAX_VERSION: usize = 64;

impl FlashFirmware {
    /// Checks the version.
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        let v = &self.version;
        if v.is_empty() || v.len() > MAX_VERSION {
            return Err(InvalidRequest(format!(
                "version must be 1 to {MAX_VERSION} characters, got {}",
                v.chars().count()
            )));
        }
        if !v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'+')) {
            return Err(InvalidRequest("version may hold only ASCII letters, digits, '.', '-', '_' and '+'".into()));
        }
        Ok(())
    }
}

/// Whether `id` can name a node or an operation in a URL path: 1-128 ASCII letters, digits, `-`
/// or `_` (so it never needs escaping and never carries a `/` or `.`).
pub fn is_path_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        let ok = |v: &str| FlashFirmware { version: v.into(), force: false }.validate().is_ok();
        assert!(ok("2.4.1") && ok("v2.4.1-rc1+build_7") && ok(&"9".repeat(64)));
        assert!(!ok("") && !ok(&"9".repeat(65)) && !ok("2.4 1") && !ok("2/4") && !ok("é") && !ok("a\nb"));
        assert!(
            is_path_id("node-0001")
                && !is_path_id("")
                && !is_path_id("a/b")
                && !is_path_id("..")
                && !is_path_id(&"a".repeat(129))
        );
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
