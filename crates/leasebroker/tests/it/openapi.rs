//! Issue 45 item 12: `/openapi.json` is a valid OpenAPI 3.1 document that says what the server
//! does. Its query parameters are query parameters (a path parameter must appear in its path),
//! the listings' `limit` has the server's bounds, a real validator (`openapi-spec-validator`)
//! accepts it, and a client generated from it (`openapi-python-client`) compiles, imports and
//! lists workers on the real binary. The two tools come from `scripts/install-test-tools openapi`
//! (a venv under target/tools); without them those two tests print SKIPPED (a failure under
//! `CI=true`).

use std::path::{Path, PathBuf};
use std::process::Command;

use reqwest::StatusCode;
use serde_json::Value;

use crate::support::{TOKEN, create, http, serve, sqlite_url, worker_body};

async fn document(base: &str) -> Value {
    http().get(format!("{base}/openapi.json")).send().await.expect("get").json().await.expect("json")
}

/// The `{name}`s of a path template.
fn template_names(path: &str) -> Vec<&str> {
    path.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).collect()
}

/// Every operation of the document: (method, path, operation).
fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            ops.push((method.clone(), path.clone(), op.clone()));
        }
    }
    ops
}

#[tokio::test]
async fn path_parameters_are_in_their_path_and_the_listings_limit_has_the_servers_bounds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let doc = document(&lb.url).await;
    assert_eq!(doc["openapi"].as_str().map(|v| v.starts_with("3.1")), Some(true), "{}", doc["openapi"]);
    for (method, path, op) in operations(&doc) {
        let params = op["parameters"].as_array().cloned().unwrap_or_default();
        let names = template_names(&path);
        for p in &params {
            let name = p["name"].as_str().expect("a parameter name");
            if p["in"] == "path" {
                assert!(names.contains(&name), "{method} {path}: path parameter {name:?} is not in the path");
                assert_eq!(p["required"], true, "{method} {path}: path parameter {name:?} must be required");
            }
        }
        for name in names {
            let declared = params.iter().any(|p| p["in"] == "path" && p["name"] == name);
            assert!(declared, "{method} {path}: {{{name}}} is not declared as a path parameter");
        }
    }
    for path in ["/v1/workers", "/admin/v1/records"] {
        let params = doc["paths"][path]["get"]["parameters"].as_array().cloned().unwrap_or_default();
        for name in ["limit", "cursor"] {
            let p = params.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("GET {path}: no {name}"));
            assert_eq!(p["in"], "query", "GET {path}: {name} is a query parameter: {p}");
            assert_ne!(p["required"], true, "GET {path}: {name} is optional: {p}");
        }
        let limit = params.iter().find(|p| p["name"] == "limit").expect("limit");
        let schema = &limit["schema"];
        assert_eq!((schema["minimum"].as_i64(), schema["maximum"].as_i64()), (Some(1), Some(500)), "{limit}");
        // The bounds are the server's: the edges pass, one past them is refused.
        for (n, status) in
            [(0, StatusCode::BAD_REQUEST), (1, StatusCode::OK), (500, StatusCode::OK), (501, StatusCode::BAD_REQUEST)]
        {
            let token = if path.starts_with("/admin") { crate::support::ADMIN } else { TOKEN };
            let r = http().get(format!("{}{path}?limit={n}", lb.url)).bearer_auth(token).send().await.expect("get");
            assert_eq!(r.status(), status, "GET {path}?limit={n}");
        }
    }
}

/// The venv `scripts/install-test-tools openapi` makes (or `$OPENAPI_TOOLS`, a directory with
/// the same `bin/`); `None` after a loud SKIPPED line (a failure under `CI=true`).
fn tools() -> Option<PathBuf> {
    let dir = std::env::var_os("OPENAPI_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/openapi"));
    let bin = dir.join("bin");
    if bin.join("openapi-spec-validator").is_file() && bin.join("openapi-python-client").is_file() {
        return Some(bin);
    }
    let message = format!(
        "openapi-spec-validator and openapi-python-client are missing under {} \
         (scripts/install-test-tools openapi installs them)",
        bin.display()
    );
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
    eprintln!("SKIPPED: {message}");
    None
}

/// Runs `program args` from `bin` (with `bin` first on PATH: the generator runs the venv's ruff)
/// in `dir`; panics with its output unless it succeeds. Returns stdout.
fn run_tool(bin: &Path, dir: &Path, program: &str, args: &[&str]) -> String {
    let path = std::env::join_paths(
        std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )
    .expect("PATH");
    let out = Command::new(bin.join(program))
        .args(args)
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{program} {args:?} failed ({}):\n{stdout}\n{stderr}", out.status);
    stdout.into_owned()
}

/// The document, as served, in a file of `dir`.
async fn document_file(base: &str, dir: &Path) -> PathBuf {
    let text = http().get(format!("{base}/openapi.json")).send().await.expect("get").text().await.expect("text");
    let file = dir.join("openapi.json");
    std::fs::write(&file, text).expect("write the document");
    file
}

#[tokio::test]
async fn openapi_spec_validator_accepts_the_document() {
    let Some(bin) = tools() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let file = document_file(&lb.url, dir.path()).await;
    let out = run_tool(&bin, dir.path(), "openapi-spec-validator", &[file.to_str().expect("utf-8 path")]);
    assert!(out.contains("OK"), "{out}");
}

/// What the generated client does on the real server: lists the caller's workers with `limit`
/// (and reads the page), and gets one worker by id.
const CLIENT_SCRIPT: &str = r#"
import sys

from leasebroker_client import AuthenticatedClient
from leasebroker_client.api.workers import get_worker, list_workers
from leasebroker_client.models import Worker, WorkerPage

base, token, worker_id = sys.argv[1:4]
client = AuthenticatedClient(base_url=base, token=token)
page = list_workers.sync(client=client, limit=1)
assert isinstance(page, WorkerPage), page
assert [w.id for w in page.workers] == [worker_id], page
worker = get_worker.sync(client=client, id=worker_id)
assert isinstance(worker, Worker), worker
print("listed", len(page.workers), "got", worker.id, worker.state)
"#;

#[tokio::test]
async fn a_python_client_generated_from_the_document_lists_and_gets_workers() {
    let Some(bin) = tools() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let created = create(&lb.url, TOKEN, "openapi-client-1", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let id = created.json()["id"].as_str().expect("id").to_owned();

    let file = document_file(&lb.url, dir.path()).await;
    let file = file.to_str().expect("utf-8 path");
    run_tool(
        &bin,
        dir.path(),
        "openapi-python-client",
        &["generate", "--path", file, "--meta", "none", "--output-path", "gen/leasebroker_client"],
    );
    run_tool(&bin, dir.path(), "python", &["-m", "compileall", "-q", "gen"]);
    std::fs::write(dir.path().join("use_client.py"), CLIENT_SCRIPT).expect("write the script");
    let pythonpath = dir.path().join("gen");
    let out = Command::new(bin.join("python"))
        .args(["use_client.py", &lb.url, TOKEN, &id])
        .current_dir(dir.path())
        .env("PYTHONPATH", &pythonpath)
        .output()
        .expect("run python");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the generated client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("listed 1 got {id} running")), "{stdout}");
}
