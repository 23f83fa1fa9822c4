//! lbctl end to end: the real `lbctl` binary against the real `leasebroker` binary (its hypervisor
//! simulator in process), each test with its own server, port, database and journal.
//!
//! The server binary is `$LEASEBROKER_BIN` if set, else `leasebroker` next to `lbctl` in the target
//! directory, built once per test run with `cargo build -p leasebroker --bin leasebroker`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use leasebroker_client::{Client, Fleet};

const TOKEN: &str = "tok-alice-4b9e2d7c1a";
const ADMIN: &str = "tok-admin-6f3a8c0e5d";

fn leasebroker_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("LEASEBROKER_BIN") {
            return PathBuf::from(bin);
        }
        let lbctl = Path::new(env!("CARGO_BIN_EXE_lbctl"));
        let bin = lbctl.with_file_name(format!("leasebroker{}", std::env::consts::EXE_SUFFIX));
        // Build (or bring up to date) the server: a stale binary would test yesterday's server.
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "-p", "leasebroker", "--bin", "leasebroker"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build for the leasebroker binary");
        assert!(status.success(), "cannot build the leasebroker binary (set LEASEBROKER_BIN to use a built one)");
        assert!(bin.exists(), "{} missing after the build", bin.display());
        bin
    })
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port")
}

/// A running `leasebroker serve`, killed on drop.
struct Server {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("leasebroker.db");
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log file");
        for _ in 0..3 {
            let addr = free_addr();
            let mut child = Command::new(leasebroker_bin())
                .args(["serve", "--listen", &addr.to_string(), "--database", &format!("sqlite://{}", db.display())])
                .args(["--token", &format!("{TOKEN}=alice"), "--admin-token", ADMIN])
                .args(extra)
                .stdout(Stdio::null())
                .stderr(log.try_clone().expect("log"))
                .spawn()
                .expect("spawn leasebroker");
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if healthy(addr) {
                    return Server { child, url: format!("http://{addr}"), dir };
                }
                if child.try_wait().expect("poll server").is_some() {
                    break; // exited: most likely the port was taken between probe and bind
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
        panic!("leasebroker did not become healthy; its log:\n{log}");
    }

    /// `GET /admin/v1/fleet` with the SDK and the admin token.
    fn fleet(&self) -> Fleet {
        let client = Client::new(&self.url, ADMIN).expect("client");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(client.fleet()).expect("fleet").value
    }

    fn journal(&self) -> PathBuf {
        self.dir.path().join("lbctl/journal.db")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /healthz` over a bare socket: 200 means the server is serving.
fn healthy(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// An `lbctl` command with nothing inherited from the caller's LBCTL_* environment.
fn lbctl(url: &str, journal: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lbctl"));
    for var in ["LBCTL_URL", "LBCTL_TOKEN", "LBCTL_JOURNAL"] {
        cmd.env_remove(var);
    }
    cmd.args(["--url", url, "--journal"]).arg(journal).args(args);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn run(url: &str, journal: &Path, args: &[&str]) -> Output {
    lbctl(url, journal, args).output().expect("run lbctl")
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("lbctl exited by a signal")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("stdout is not JSON ({e}): {:?}; stderr: {}", String::from_utf8_lossy(&out.stdout), stderr(out))
    })
}

fn assert_exit(out: &Output, expected: i32) {
    assert_eq!(code(out), expected, "stdout: {}\nstderr: {}", String::from_utf8_lossy(&out.stdout), stderr(out));
}

const CREATE: &[&str] =
    &["--token", TOKEN, "workers", "create", "--image", "worker-base:2025.11", "--cpu", "2", "--memory-gb", "4"];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

#[test]
fn create_prints_the_worker() {
    let server = Server::start(&[]);
    let out =
        run(&server.url, &server.journal(), &with(CREATE, &["--label", "team=ml-eval", "--label", "purpose=bench"]));
    assert_exit(&out, 0);
    let worker = json(&out);
    assert!(worker["id"].as_str().is_some_and(|id| id.starts_with("wkr-")), "{worker}");
    assert_eq!(worker["cpu"], 2);
    assert_eq!(worker["memory_gb"], 4);
    assert_eq!(worker["labels"], serde_json::json!({"team": "ml-eval", "purpose": "bench"}));
    assert_eq!(server.fleet().workers_active, 1);
    // Without --op-id nothing is journaled.
    assert!(!server.journal().exists());
}

#[test]
fn the_same_op_id_again_returns_the_same_worker() {
    let server = Server::start(&[]);
    let args = with(CREATE, &["--op-id", "op-same"]);
    let first = run(&server.url, &server.journal(), &args);
    assert_exit(&first, 0);
    let again = run(&server.url, &server.journal(), &with(&args, &["--verbose"]));
    assert_exit(&again, 0);
    assert_eq!(json(&first)["id"], json(&again)["id"]);
    assert!(stderr(&again).contains("(replayed)"), "the rerun was not a replay: {}", stderr(&again));
    let fleet = server.fleet();
    assert_eq!((fleet.workers_active, fleet.vm_boots_total), (1, 1), "{fleet:?}");
}

#[test]
fn a_changed_request_under_an_op_id_exits_4_without_sending() {
    let server = Server::start(&[]);
    let first = run(&server.url, &server.journal(), &with(CREATE, &["--op-id", "op-changed"]));
    assert_exit(&first, 0);

    // A listener that only counts connections: lbctl must decide from the journal alone.
    let sentinel = TcpListener::bind("127.0.0.1:0").unwrap();
    sentinel.set_nonblocking(true).unwrap();
    let sentinel_url = format!("http://{}", sentinel.local_addr().unwrap());
    let changed =
        ["--token", TOKEN, "workers", "create", "--image", "worker-base:2025.11", "--cpu", "8", "--memory-gb", "4"];
    let out =
        run(&sentinel_url, &server.journal(), &with(&changed, &["--op-id", "op-changed", "--max-elapsed", "30s"]));
    assert_exit(&out, 4);
    assert!(out.stdout.is_empty());
    assert!(stderr(&out).contains("op-changed"), "{}", stderr(&out));
    assert_eq!(stderr(&out).trim().lines().count(), 1, "not one line: {}", stderr(&out));
    assert!(sentinel.accept().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock), "lbctl connected anyway");

    let out = run(&server.url, &server.journal(), &with(&changed, &["--op-id", "op-changed"]));
    assert_exit(&out, 4);
    assert_eq!(server.fleet().workers_active, 1);
}

#[test]
fn unknown_worker_exits_3() {
    let server = Server::start(&[]);
    let out = run(&server.url, &server.journal(), &["--token", TOKEN, "workers", "get", "wkr-doesnotexist"]);
    assert_exit(&out, 3);
    assert!(stderr(&out).contains("404"), "{}", stderr(&out));
    let out = run(&server.url, &server.journal(), &["--token", TOKEN, "workers", "delete", "wkr-doesnotexist"]);
    assert_exit(&out, 3);
}

#[test]
fn a_bad_token_exits_6() {
    let server = Server::start(&[]);
    let out = run(&server.url, &server.journal(), &["--token", "wrong", "workers", "list"]);
    assert_exit(&out, 6);
    let out = run(
        &server.url,
        &server.journal(),
        &["--token", "wrong", "workers", "create", "--image", "i", "--cpu", "1", "--memory-gb", "1"],
    );
    assert_exit(&out, 6);
    assert_eq!(server.fleet().workers_active, 0);
}

#[test]
fn a_server_that_is_down_exits_5_within_max_elapsed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://{}", free_addr());
    let start = Instant::now();
    let out = run(&url, &dir.path().join("j.db"), &with(CREATE, &["--max-elapsed", "2s", "--op-id", "op-down", "-v"]));
    let elapsed = start.elapsed();
    assert_exit(&out, 5);
    assert!(elapsed < Duration::from_secs(6), "took {elapsed:?} with --max-elapsed 2s");
    let attempts = stderr(&out).lines().filter(|l| l.contains("attempt ")).count();
    assert!(attempts >= 2, "connection refused was not retried: {}", stderr(&out));
    assert!(stderr(&out).lines().last().is_some_and(|l| l.contains("gave up")), "{}", stderr(&out));
}

#[test]
fn killed_mid_flight_then_rerun_makes_one_worker() {
    let server = Server::start(&["--sim-latency-ms", "3000"]);
    let args = with(CREATE, &["--op-id", "op-killed"]);
    let mut victim = lbctl(&server.url, &server.journal(), &args).spawn().expect("spawn lbctl");
    std::thread::sleep(Duration::from_millis(500));
    victim.kill().expect("SIGKILL lbctl"); // Child::kill is SIGKILL on Unix
    let status = victim.wait().unwrap();
    assert!(status.code().is_none(), "lbctl finished before the kill: {status:?}");

    let rerun = run(&server.url, &server.journal(), &with(&args, &["-v"]));
    assert_exit(&rerun, 0);
    let id = json(&rerun)["id"].clone();
    let third = run(&server.url, &server.journal(), &args);
    assert_exit(&third, 0);
    assert_eq!(json(&third)["id"], id);
    let fleet = server.fleet();
    assert_eq!((fleet.workers_active, fleet.vm_boots_total), (1, 1), "{fleet:?}; rerun: {}", stderr(&rerun));
}

#[test]
fn two_processes_racing_on_one_op_id_make_one_worker() {
    let server = Server::start(&["--sim-latency-ms", "300"]);
    let args = with(CREATE, &["--op-id", "op-race"]);
    let racers: Vec<Child> =
        (0..3).map(|_| lbctl(&server.url, &server.journal(), &args).spawn().expect("spawn")).collect();
    let outs: Vec<Output> = racers.into_iter().map(|c| c.wait_with_output().expect("wait")).collect();
    for out in &outs {
        assert_exit(out, 0);
        assert_eq!(json(out)["id"], json(&outs[0])["id"]);
    }
    assert_eq!(server.fleet().workers_active, 1);
}

#[test]
fn without_op_id_one_key_covers_every_retry() {
    // Half the hypervisor calls do the work and then drop the connection; the server answers 5xx
    // and lbctl retries with the same in-memory key until the server resumes and completes.
    let server = Server::start(&["--sim-fail-after", "0.5"]);
    let out = run(&server.url, &server.journal(), &with(CREATE, &["--max-elapsed", "60s", "-v"]));
    assert_exit(&out, 0);
    let fleet = server.fleet();
    assert_eq!((fleet.workers_active, fleet.vms_running), (1, 1), "{fleet:?}; lbctl: {}", stderr(&out));
    let keys = stderr(&out).lines().filter(|l| l.starts_with("lbctl: key ")).count();
    assert_eq!(keys, 1, "{}", stderr(&out));
}

#[test]
fn reboot_and_delete_are_once_per_op_id() {
    let server = Server::start(&[]);
    let created = run(&server.url, &server.journal(), CREATE);
    assert_exit(&created, 0);
    let id = json(&created)["id"].as_str().unwrap().to_owned();
    let reboot = ["--token", TOKEN, "workers", "reboot", id.as_str(), "--op-id", "op-reboot"];
    for _ in 0..2 {
        let out = run(&server.url, &server.journal(), &reboot);
        assert_exit(&out, 0);
        assert_eq!(json(&out), serde_json::json!({"id": id, "reboot_count": 1}));
    }
    assert_eq!(server.fleet().reboots_total, 1);

    let delete = ["--token", TOKEN, "workers", "delete", id.as_str(), "--op-id", "op-delete"];
    let out = run(&server.url, &server.journal(), &delete);
    assert_exit(&out, 0);
    assert!(out.stdout.is_empty(), "204 has no body to print");
    // The retry of a done delete replays 204 instead of failing with 404.
    assert_exit(&run(&server.url, &server.journal(), &delete), 0);
    assert_exit(&run(&server.url, &server.journal(), &["--token", TOKEN, "workers", "get", id.as_str()]), 3);
    assert_eq!(server.fleet().workers_active, 0);
}

#[test]
fn the_default_journal_is_under_xdg_state_home_then_home() {
    let server = Server::start(&[]);
    let (state, home) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let bare = |env: &[(&str, &Path)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lbctl"));
        for var in ["LBCTL_URL", "LBCTL_TOKEN", "LBCTL_JOURNAL", "XDG_STATE_HOME", "HOME"] {
            cmd.env_remove(var);
        }
        cmd.envs(env.iter().copied()).env("LBCTL_URL", &server.url).env("LBCTL_TOKEN", TOKEN);
        cmd.args(&CREATE[2..]).args(["--op-id", "op-default"]).output().expect("run lbctl")
    };
    assert_exit(&bare(&[("XDG_STATE_HOME", state.path()), ("HOME", home.path())]), 0);
    assert!(state.path().join("lbctl/journal.db").exists());
    assert!(!home.path().join(".local").exists());
    assert_exit(&bare(&[("HOME", home.path())]), 0);
    assert!(home.path().join(".local/state/lbctl/journal.db").exists());
    let explicit = state.path().join("elsewhere.db");
    assert_exit(&bare(&[("HOME", home.path()), ("LBCTL_JOURNAL", &explicit)]), 0);
    assert!(explicit.exists());
    // Three journals, three keys for "op-default": three workers, each made once.
    assert_eq!(server.fleet().workers_active, 3);
}

#[test]
fn usage_errors_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("j.db");
    let url = "http://127.0.0.1:9";
    let out = run(url, &journal, &with(CREATE, &["--label", "no-equals-sign"]));
    assert_exit(&out, 2);
    assert!(stderr(&out).contains("expected K=V"), "{}", stderr(&out));
    assert_exit(&run(url, &journal, &with(CREATE, &["--label", "a=1", "--label", "a=2"])), 2);
    assert_exit(&run(url, &journal, &["--token", TOKEN, "workers", "get", "../admin"]), 2);
    assert_exit(
        &run(
            url,
            &journal,
            &["--token", TOKEN, "workers", "create", "--image", "i", "--cpu", "-1", "--memory-gb", "1"],
        ),
        2,
    );
    assert_exit(&run(url, &journal, &with(CREATE, &["--max-elapsed", "soon"])), 2);
    assert_exit(&run(url, &journal, &["workers", "list"]), 2); // no token
    assert!(!journal.exists(), "a usage error must not touch the journal");
}
