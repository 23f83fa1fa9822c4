//! What the black-box tests share: starting the real binary (and the standalone simulator),
//! sending requests, and reading ground truth (the fleet, the simulator's stats).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_leasebroker");
pub(crate) const TOKEN: &str = "tok-alice-5a8d1c7e90b3";
pub(crate) const OTHER: &str = "tok-bob-3e7f0a9c2d64b1";
pub(crate) const ADMIN: &str = "tok-admin-8c1b4d7e2f9a";

/// A child process killed when dropped.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub(crate) fn sigkill(&mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
    }
}

/// Starts `leasebroker ARGS` and waits for its "listening on http://ADDR" line.
pub(crate) fn start(args: &[&str]) -> Proc {
    let mut command = Command::new(BIN);
    command.args(args).env("RUST_LOG", "warn").stderr(Stdio::inherit());
    let (child, url) = spawn_listening(command, |_| {});
    Proc { child, url }
}

/// Spawns `command` with its stdout piped, hands the child to `spawned` (to take its other pipes
/// before anything waits on them), and waits (up to a minute) for its "listening on
/// http://ADDR" line; returns the child and its URL.
fn spawn_listening(mut command: Command, spawned: impl FnOnce(&mut Child)) -> (Child, String) {
    let mut child = command.stdout(Stdio::piped()).spawn().expect("start leasebroker");
    spawned(&mut child);
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = line.find("listening on http://") {
                let _ = tx.send(line[i + "listening on ".len()..].trim().to_owned());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("the process did not report its address in time");
    (child, url)
}

/// The server with its log (stderr) kept, for tests that read what it logged.
pub(crate) struct Logged {
    pub(crate) child: Child,
    pub(crate) url: String,
    pub(crate) log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Logged {
    /// Starts `leasebroker ARGS` with `env` (`RUST_LOG` among it), keeping its log.
    pub(crate) fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(BIN);
        command.args(args).envs(env.iter().copied()).stderr(Stdio::piped());
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = log.clone();
        let (child, url) = spawn_listening(command, move |child| {
            let stderr = child.stderr.take().expect("stderr");
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut s = sink.lock().expect("log");
                    s.push_str(&line);
                    s.push('\n');
                }
            });
        });
        Logged { child, url, log }
    }

    /// The log so far.
    pub(crate) fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Waits (up to a minute) for a log line holding every one of `parts`; returns it.
    pub(crate) fn wait_for_line(&self, parts: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                return line.to_owned();
            }
            assert!(Instant::now() < deadline, "no log line with {parts:?} in:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub(crate) fn serve(db: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database",
        db,
        "--token",
        "tok-alice-5a8d1c7e90b3=alice",
        "--token",
        "tok-bob-3e7f0a9c2d64b1=bob",
        "--admin-token",
        ADMIN,
        "--pool-nodes",
        "16",
    ];
    args.extend_from_slice(extra);
    start(&args)
}

pub(crate) fn sim(extra: &[&str]) -> Proc {
    let mut args = vec!["hypervisor-sim", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    start(&args)
}

pub(crate) fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("lb.db").display())
}

pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client")
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub(crate) fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned()
    }
    pub(crate) fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
}

pub(crate) async fn send(
    method: reqwest::Method,
    url: &str,
    token: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> Reply {
    let mut req = http().request(method, url).bearer_auth(token);
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(serde_json::to_vec(b).expect("json"));
    }
    let resp = req.send().await.expect("request");
    Reply { status: resp.status(), headers: resp.headers().clone(), body: resp.bytes().await.expect("body").to_vec() }
}

pub(crate) async fn create(base: &str, token: &str, key: &str, body: &Value) -> Reply {
    send(reqwest::Method::POST, &format!("{base}/v1/workers"), token, Some(key), Some(body)).await
}

pub(crate) async fn fleet(base: &str) -> Value {
    send(reqwest::Method::GET, &format!("{base}/admin/v1/fleet"), ADMIN, None, None).await.json()
}

pub(crate) async fn sim_stats(sim: &str) -> Value {
    http().get(format!("{sim}/v1/stats")).send().await.expect("stats").json().await.expect("json")
}

pub(crate) async fn set_faults(sim: &str, fail_before: f64, fail_after: f64, latency_ms: u64) {
    let r = http()
        .put(format!("{sim}/v1/faults"))
        .json(&json!({"fail_before": fail_before, "fail_after": fail_after, "latency_ms": latency_ms}))
        .send()
        .await
        .expect("faults");
    assert!(r.status().is_success(), "setting faults: {}", r.status());
}

/// The fleet holds exactly one worker, one allocated node and one lease: nothing leaked.
pub(crate) async fn assert_one_worker_node_and_lease(base: &str) {
    let f = fleet(base).await;
    assert_eq!(
        (f["workers_active"].as_i64(), f["nodes_allocated"].as_i64(), f["leases_active"].as_i64()),
        (Some(1), Some(1), Some(1)),
        "{f}"
    );
}

pub(crate) fn worker_body() -> Value {
    json!({"image": "worker-base:2025.11", "cpu": 16, "memory_gb": 64, "labels": {"team": "ml-eval"}})
}

/// Retries `create` with one key until it is not a 409 in-progress / 503, like a client would.
pub(crate) async fn create_until_done(base: &str, key: &str, body: &Value, within: Duration) -> Reply {
    let deadline = Instant::now() + within;
    loop {
        let r = create(base, TOKEN, key, body).await;
        let retryable = r.status == StatusCode::SERVICE_UNAVAILABLE
            || r.status == StatusCode::BAD_GATEWAY
            || (r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress");
        if !retryable || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
