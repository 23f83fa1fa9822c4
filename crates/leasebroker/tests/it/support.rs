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

/// The binary under test: `LEASEBROKER_BIN_UNDER_TEST` (another build), else this package's.
pub(crate) fn bin() -> String {
    std::env::var("LEASEBROKER_BIN_UNDER_TEST").unwrap_or_else(|_| BIN.to_owned())
}

/// A running `leasebroker` (server or simulator): killed when dropped; its log (stderr) kept and
/// echoed, prefixed, into the test's output.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) url: String,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    logger: Option<std::thread::JoinHandle<()>>,
    stdout: std::sync::Arc<std::sync::Mutex<String>>,
}

/// The same, for tests that read what it logged.
pub(crate) type Logged = Proc;

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a test starts the real binary: its arguments and environment (`RUST_LOG=warn` unless
/// set by the test, or by `LEASEBROKER_TEST_LOG` for every server a test run starts). The one
/// place that spawns it and waits for its "listening on http://ADDR" line.
pub(crate) struct Launch {
    command: Command,
}

impl Launch {
    /// `leasebroker ARGS`.
    pub(crate) fn new(args: &[&str]) -> Self {
        let mut command = Command::new(bin());
        let log = std::env::var("LEASEBROKER_TEST_LOG").unwrap_or_else(|_| "warn".into());
        command.args(args).env("RUST_LOG", log);
        Self { command }
    }

    /// Sets an environment variable.
    pub(crate) fn env(mut self, name: &str, value: &str) -> Self {
        self.command.env(name, value);
        self
    }

    /// Starts it and waits (up to a minute) for its address; its log when it exits or stays
    /// silent instead.
    pub(crate) fn try_start(mut self) -> Result<Proc, String> {
        let mut child = self
            .command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin()));
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (stderr, sink) = (child.stderr.take().expect("stderr"), log.clone());
        let logger = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[leasebroker] {line}");
                let mut s = sink.lock().expect("log");
                s.push_str(&line);
                s.push('\n');
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let printed = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = printed.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                {
                    let mut s = sink.lock().expect("stdout");
                    s.push_str(&line);
                    s.push('\n');
                }
                if let Some(i) = line.find("listening on http://") {
                    let _ = tx.send(line[i + "listening on ".len()..].trim().to_owned());
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(url) => Ok(Proc { child, url, log, logger: Some(logger), stdout: printed }),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = logger.join();
                Err(log.lock().expect("log").clone())
            }
        }
    }

    /// [`Launch::try_start`], or the test fails with the process's log.
    pub(crate) fn start(self) -> Proc {
        self.try_start().unwrap_or_else(|log| panic!("leasebroker did not report its address; its log:\n{log}"))
    }
}

impl Proc {
    /// Kills it with SIGKILL and reaps it; its log is whole after this.
    pub(crate) fn sigkill(&mut self) {
        self.child.kill().expect("kill");
        self.child.wait().expect("wait");
        self.log_complete();
    }

    /// Waits for the log's last line (the process has exited).
    fn log_complete(&mut self) {
        if let Some(logger) = self.logger.take() {
            let _ = logger.join();
        }
    }

    /// Sends SIGTERM (a graceful shutdown), without waiting.
    pub(crate) fn sigterm(&self) {
        self.signal(rustix::process::Signal::TERM);
    }

    /// Stops it (SIGSTOP), as a frozen VM or a long pause would: it keeps its connections and
    /// answers nothing until [`Proc::sigcont`].
    pub(crate) fn sigstop(&self) {
        self.signal(rustix::process::Signal::STOP);
    }

    /// Resumes it after [`Proc::sigstop`].
    pub(crate) fn sigcont(&self) {
        self.signal(rustix::process::Signal::CONT);
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(i32::try_from(self.child.id()).expect("a pid")).expect("a pid");
        rustix::process::kill_process(pid, signal).unwrap_or_else(|e| panic!("{signal:?}: {e}"));
    }

    /// Sends SIGTERM and waits (up to two minutes) for the exit code.
    pub(crate) fn sigterm_and_wait(&mut self) -> Option<i32> {
        self.sigterm();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.log_complete();
                return status.code();
            }
            assert!(Instant::now() < deadline, "the server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts `leasebroker ARGS` with `env` (`RUST_LOG` among it).
    pub(crate) fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        env.iter().fold(Launch::new(args), |l, (k, v)| l.env(k, v)).start()
    }

    /// What it printed on stdout up to now (its address, a generated token).
    pub(crate) fn stdout(&self) -> String {
        self.stdout.lock().expect("stdout").clone()
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

/// Starts `leasebroker ARGS` and waits for its "listening on http://ADDR" line.
pub(crate) fn start(args: &[&str]) -> Proc {
    Launch::new(args).start()
}

pub(crate) fn serve(db: &str, extra: &[&str]) -> Proc {
    serve_with_env(db, extra, &[])
}

/// [`serve`] with `env` set (`RUST_LOG` among it, to read what it logs).
pub(crate) fn serve_with_env(db: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
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
    Proc::start(&args, env)
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
