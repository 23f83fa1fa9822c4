//! The workspace's binaries, found without running cargo: `$<NAME>_BIN` when set, else the file
//! beside the test's own executable (`target/<profile>/`, where `cargo build --workspace`,
//! `cargo test --workspace` and `cargo nextest run --workspace` put every binary).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// How to build what is missing, in every message about a missing file.
const HOW_TO_BUILD: &str = "cargo build --workspace";

/// One of the workspace's binaries: its name and the environment variable that points at
/// another build of it. Usable wherever a program is (`Command::new(LEASEBROKER)`); the path is
/// looked up on first use, and a binary that is not there fails the test with one line saying
/// how to build it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary {
    name: &'static str,
    env: &'static str,
}

/// The service and its simulators (`leasebroker serve`, `leasebroker hypervisor-sim`).
pub const LEASEBROKER: Binary = Binary::new("leasebroker", "LEASEBROKER_BIN");
/// The command-line client.
pub const LBCTL: Binary = Binary::new("lbctl", "LBCTL_BIN");
/// The conformance kit.
pub const IDEMCHECK: Binary = Binary::new("idemcheck", "IDEMCHECK_BIN");
/// The fault harness.
pub const FAULTLINE: Binary = Binary::new("faultline", "FAULTLINE_BIN");
/// The reverse proxy that gives any HTTP service the layer's promise.
pub const GATEWAY: Binary = Binary::new("idempotency-gateway", "IDEMPOTENCY_GATEWAY_BIN");

impl Binary {
    /// The binary `name`, which `env` may point at instead.
    pub const fn new(name: &'static str, env: &'static str) -> Self {
        Self { name, env }
    }

    /// Its name (the file's, without the platform's suffix).
    pub fn name(self) -> &'static str {
        self.name
    }

    /// The environment variable that points at another build of it.
    pub fn env(self) -> &'static str {
        self.env
    }

    /// Its path; the test fails with one line saying how to build it when it is not there.
    pub fn path(self) -> &'static Path {
        static FOUND: OnceLock<Mutex<HashMap<&'static str, &'static Path>>> = OnceLock::new();
        let mut found = FOUND.get_or_init(Mutex::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(path) = found.get(self.name) {
            return path;
        }
        let path: &'static Path = Box::leak(self.find().unwrap_or_else(|e| panic!("{e}")).into_boxed_path());
        found.insert(self.name, path);
        path
    }

    /// Its path, or the one line that says why it is missing and how to build it.
    pub fn find(self) -> Result<PathBuf, String> {
        locate(self, std::env::var_os(self.env).map(PathBuf::from), &target_dir())
    }

    /// A `Command` for it.
    pub fn command(self) -> std::process::Command {
        std::process::Command::new(self.path())
    }
}

impl AsRef<OsStr> for Binary {
    fn as_ref(&self) -> &OsStr {
        self.path().as_os_str()
    }
}

impl AsRef<Path> for Binary {
    fn as_ref(&self) -> &Path {
        self.path()
    }
}

impl fmt::Display for Binary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.path().display().fmt(f)
    }
}

/// `binary` as `$ENV` (`explicit`) names it, else in `dir`.
fn locate(binary: Binary, explicit: Option<PathBuf>, dir: &Path) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("{}={} is not a file: point it at a built {}", binary.env, path.display(), binary.name))
        };
    }
    let path = dir.join(format!("{}{}", binary.name, std::env::consts::EXE_SUFFIX));
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the {} binary is not built (no {}): build it with `{HOW_TO_BUILD}` (cargo nextest run --workspace \
             builds it too), or set {} to one",
            binary.name,
            path.display(),
            binary.env
        ))
    }
}

/// The example `name` of the package under test (`target/<profile>/examples/NAME`): cargo builds
/// a package's examples with its tests. The test fails with one line when it is not there.
pub fn example(name: &str) -> PathBuf {
    let path = target_dir().join("examples").join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "the example {name} is not built (no {}): build it with `{HOW_TO_BUILD} --examples` (cargo test and cargo \
         nextest run build a package's examples with its tests)",
        path.display()
    );
    path
}

/// `target/<profile>/`: the directory of the running executable, or its parent when that is
/// `deps` (where cargo puts test executables).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own executable");
    target_dir_of(&exe)
}

fn target_dir_of(exe: &Path) -> PathBuf {
    let dir = exe.parent().unwrap_or(Path::new("."));
    match dir.file_name() {
        Some(n) if n == "deps" || n == "examples" => dir.parent().unwrap_or(dir).to_path_buf(),
        _ => dir.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_executable_finds_the_binaries_one_directory_up() {
        let dir = Path::new("/w/target/debug");
        assert_eq!(target_dir_of(&dir.join("deps/it-0123abcd")), dir);
        assert_eq!(target_dir_of(&dir.join("examples/fake_dns")), dir);
        assert_eq!(target_dir_of(&dir.join("leasebroker")), dir);
    }

    #[test]
    fn the_environment_wins_and_a_missing_binary_says_how_to_build_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let other = dir.path().join("other-build");
        std::fs::write(&other, "").expect("write");
        let found = locate(LBCTL, Some(other.clone()), Path::new("/nonexistent")).expect("the explicit one");
        assert_eq!(found, other);

        let missing = locate(LBCTL, None, dir.path()).expect_err("nothing built");
        assert!(missing.contains("cargo build --workspace") && missing.contains("LBCTL_BIN"), "{missing}");
        assert!(!missing.contains('\n'), "one line: {missing}");
        let wrong = locate(LBCTL, Some(dir.path().join("nope")), dir.path()).expect_err("not a file");
        assert!(wrong.starts_with("LBCTL_BIN=") && !wrong.contains('\n'), "{wrong}");

        let built = dir.path().join(format!("lbctl{}", std::env::consts::EXE_SUFFIX));
        std::fs::write(&built, "").expect("write");
        assert_eq!(locate(LBCTL, None, dir.path()).expect("built"), built);
    }
}
