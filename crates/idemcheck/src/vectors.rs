//! Vectors: one JSON file per rule, naming the rule, where it comes from, and the check that
//! tests it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One vector file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Vector {
    /// Unique, the file's name without `.json`.
    pub(crate) id: String,
    /// The rule, in a sentence.
    pub(crate) rule: String,
    /// Where the rule comes from: a draft section, Stripe's documentation, SPEC section.
    pub(crate) source: String,
    /// The check that tests it (see `checks/`).
    pub(crate) check: String,
    /// The check's parameters.
    #[serde(default)]
    pub(crate) params: Value,
    /// The profiles whose rule it is; absent: every profile.
    #[serde(default)]
    pub(crate) profiles: Option<Vec<String>>,
}

/// Where the vectors are when `--vectors` is not given: `conformance/vectors` under the current
/// directory, else the workspace's that this binary was built from.
pub(crate) fn default_dir() -> PathBuf {
    let here = Path::new("conformance/vectors");
    if here.is_dir() {
        return here.to_owned();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/vectors")
}

/// Every `*.json` in `dir`, by name.
pub(crate) fn load(dir: &Path) -> Result<Vec<Vector>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("--vectors {}: {e}", dir.display()))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut vectors = Vec::with_capacity(paths.len());
    for path in paths {
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: Vector = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        if v.id != stem {
            return Err(format!("{}: id {:?} differs from the file name", path.display(), v.id));
        }
        if !crate::checks::KINDS.contains(&v.check.as_str()) {
            return Err(format!("{}: unknown check {:?}", path.display(), v.check));
        }
        if let Some(unknown) = v.profiles.iter().flatten().find(|p| !crate::profile::NAMES.contains(&p.as_str())) {
            return Err(format!("{}: unknown profile {unknown:?}", path.display()));
        }
        vectors.push(v);
    }
    if vectors.is_empty() {
        return Err(format!("--vectors {}: no *.json vector files", dir.display()));
    }
    Ok(vectors)
}

impl Vector {
    pub(crate) fn applies_to(&self, profile: &str) -> bool {
        self.profiles.as_ref().is_none_or(|ps| ps.iter().any(|p| p == profile))
    }

    pub(crate) fn param_str(&self, name: &str) -> Option<&str> {
        self.params.get(name).and_then(Value::as_str)
    }
}
