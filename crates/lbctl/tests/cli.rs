//! lbctl end to end: the real `lbctl` binary against the real `leasebroker` binary (its hypervisor
//! simulator in process), each test with its own server, port, database and journal.
//!
//! The server comes from the workspace's test kit (`testkit`): `$LEASEBROKER_BIN` if set, else
//! `leasebroker` next to `lbctl` in the target directory, which `cargo nextest run --workspace`
//! builds (the tests fail with one line saying so when it is missing).

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use leasebroker_client::{Client, Fleet};
use testkit::tokens::{ADMIN, ALICE as TOKEN};

/// A running `leasebroker serve` on a SQLite database in a directory of its own (where the
/// journal goes too), killed on drop.
struct Server {
    /// Killed when the server is dropped, before its directory goes.
    _proc: testkit::Proc,
    url: String,
    dir: tempfile::TempDir,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = format!("sqlite://{}", dir.path().join("leasebroker.db").display());
        let proc = testkit::Launch::serve(&db, extra).start();
        Server { url: proc.url.clone(), _proc: proc, dir }
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
    assert!(stderr(&again).contains("answered from the journal"), "{}", stderr(&again));
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
    let url = testkit::closed_url();
    let start = Instant::now();
    let out = run(&url, &dir.path().join("j.db"), &with(CREATE, &["--max-elapsed", "3s", "--op-id", "op-down", "-v"]));
    let elapsed = start.elapsed();
    assert_exit(&out, 5);
    // Retrying is bounded by the budget; the slack is for process start-up on a busy machine.
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?} with --max-elapsed 3s");
    let attempts = stderr(&out).lines().filter(|l| l.contains("attempt ")).count();
    assert!(attempts >= 2, "connection refused was not retried: {}", stderr(&out));
    assert!(stderr(&out).lines().last().is_some_and(|l| l.contains("gave up")), "{}", stderr(&out));
}

/// Issue 45: a server that cannot be reached is named on stderr at once, not after the whole
/// budget (10 minutes by default): one short line per retry, saying what lbctl waits for.
#[test]
fn a_server_that_cannot_be_reached_is_named_on_stderr_at_once() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let url = testkit::closed_url();
    let mut child = lbctl(&url, &dir.path().join("j.db"), CREATE).spawn().expect("start lbctl");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    let started = Instant::now();
    // Generous for a loaded machine; without the notice nothing comes for the whole 10 minutes.
    let first = rx.recv_timeout(Duration::from_secs(60));
    let mut lines = Vec::new();
    if let Ok((_, line)) = &first {
        lines.push(line.clone());
        while let Ok((at, line)) = rx.recv_timeout(Duration::from_secs(4)) {
            lines.push(line);
            if at.duration_since(started) > Duration::from_secs(8) {
                break;
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.is_ok(), "lbctl printed nothing while it could not reach {url}");
    for line in &lines {
        assert!(line.starts_with("lbctl: ") && line.len() < 300, "one short line: {line:?}");
        assert!(line.contains(&url) && line.contains("retrying"), "says what it waits for: {line:?}");
    }
    assert!(lines[0].contains("--max-elapsed"), "says how long it will keep trying: {:?}", lines[0]);
    // One line per retry: backoff spaces them out (200 ms doubling), not a line per millisecond.
    assert!(lines.len() < 25, "{} lines in a few seconds: {lines:?}", lines.len());
}

#[test]
fn killed_mid_flight_then_rerun_makes_one_worker() {
    let server = Server::start(&["--sim-latency-ms", "3000"]);
    let args = with(CREATE, &["--op-id", "op-killed"]);
    let mut victim = lbctl(&server.url, &server.journal(), &args).spawn().expect("spawn lbctl");
    // Kill it while its request is in the server (the node is allocated, the VM boot is waiting out
    // the simulator's latency): polled, since on a busy machine lbctl may take a while to start.
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.fleet().nodes_allocated == 0 {
        assert!(Instant::now() < deadline, "lbctl's request never reached the server");
        assert!(victim.try_wait().unwrap().is_none(), "lbctl exited before its request arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
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

/// A listener that only counts connections: a command that must decide from the journal alone
/// never connects to it.
struct Sentinel(TcpListener);

impl Sentinel {
    fn start() -> Sentinel {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        Sentinel(listener)
    }

    fn url(&self) -> String {
        format!("http://{}", self.0.local_addr().unwrap())
    }

    fn contacted(&self) -> bool {
        !self.0.accept().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

#[test]
fn a_rerun_of_a_finished_op_answers_from_the_journal_without_sending() {
    let server = Server::start(&[]);
    let args = with(CREATE, &["--op-id", "op-done"]);
    let first = run(&server.url, &server.journal(), &args);
    assert_exit(&first, 0);

    // The server is gone (or has forgotten the key after its retention): the journal answers.
    let sentinel = Sentinel::start();
    let again = run(&sentinel.url(), &server.journal(), &with(&args, &["--verbose", "--max-elapsed", "20s"]));
    assert_exit(&again, 0);
    assert_eq!(again.stdout, first.stdout, "the recorded response, byte for byte");
    assert!(stderr(&again).contains("op \"op-done\" answered from the journal"), "{}", stderr(&again));
    assert!(!sentinel.contacted(), "lbctl contacted the server for a finished operation");
    // Quietly without --verbose.
    let quiet = run(&sentinel.url(), &server.journal(), &with(&args, &["--max-elapsed", "20s"]));
    assert_exit(&quiet, 0);
    assert!(quiet.stderr.is_empty(), "{}", stderr(&quiet));

    // A final refusal is an outcome too: same exit code, same reason, nothing sent.
    let delete = ["--token", TOKEN, "workers", "delete", "wkr-doesnotexist", "--op-id", "op-gone"];
    let refused = run(&server.url, &server.journal(), &delete);
    assert_exit(&refused, 3);
    let again = run(&sentinel.url(), &server.journal(), &with(&delete, &["--max-elapsed", "20s"]));
    assert_exit(&again, 3);
    assert!(stderr(&again).contains("404") && stderr(&again).contains("journal"), "{}", stderr(&again));
    assert_eq!(stderr(&again).lines().count(), 1, "{}", stderr(&again));
    assert!(!sentinel.contacted(), "lbctl contacted the server for a finished operation");
    assert_eq!(server.fleet().workers_active, 1);
}

#[cfg(unix)]
#[test]
fn the_journal_is_created_private() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let server = Server::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("new/state/journal.db");
    assert_exit(&run(&server.url, &journal, &with(CREATE, &["--op-id", "op-private"])), 0);
    assert_eq!(mode(&journal), 0o600);
    for file in [journal.with_extension("db-wal"), journal.with_extension("db-shm")] {
        if file.exists() {
            assert_eq!(mode(&file), 0o600, "{}", file.display());
        }
    }
    assert_eq!((mode(&dir.path().join("new")), mode(&dir.path().join("new/state"))), (0o700, 0o700));
}

/// A server that answers every request with `status` and a problem whose detail is `detail` (a
/// JSON string body, escapes allowed), then closes the connection.
fn hostile_server(status: u16, detail: &str) -> String {
    let body = format!(r#"{{"type":"https://evil.test/p/x","title":"x","status":{status},"detail":"{detail}"}}"#);
    let response = format!(
        "HTTP/1.1 {status} Whatever\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            // Read the request head (GET: no body), then answer.
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = stream.write_all(response.as_bytes());
        }
    });
    url
}

#[test]
fn server_text_reaches_stderr_without_control_characters() {
    // ANSI: clear the screen, set the window title; BEL, CR/LF, a C1 CSI, a bidi override.
    let detail = r"\u001b[2J\u001b]0;owned\u0007evil\r\nsecond line\u009b31m\u202egnp.exe";
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("j.db");
    for (status, expected, extra) in [(404, 3, &[][..]), (503, 5, &["-v", "--max-elapsed", "3s"][..])] {
        let url = hostile_server(status, detail);
        let out = run(&url, &journal, &with(&["--token", TOKEN, "workers", "get", "wkr-1"], extra));
        assert_exit(&out, expected);
        let text = stderr(&out);
        assert!(text.contains("evil") && text.contains("second line"), "{text:?}");
        let bad: Vec<char> =
            text.chars().filter(|&c| (c.is_control() && c != '\n') || ('\u{202a}'..='\u{202e}').contains(&c)).collect();
        assert!(bad.is_empty(), "{status}: control characters {bad:?} in {text:?}");
        assert!(text.lines().all(|l| l.starts_with("lbctl: ")), "{status}: {text:?}");
        if status == 503 {
            assert!(text.lines().filter(|l| l.contains("attempt ")).count() >= 2, "{text:?}");
        } else {
            assert_eq!(text.lines().count(), 1, "{text:?}");
        }
    }
}

/// A TLS-terminating proxy on 127.0.0.1 in front of a plain-HTTP server, with a certificate for
/// 127.0.0.1 and localhost issued by a fresh private CA, counting the connections it accepts.
struct TlsProxy {
    url: String,
    ca_file: PathBuf,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _dir: tempfile::TempDir,
    _runtime: tokio::runtime::Runtime,
}

impl TlsProxy {
    fn start(upstream: &str) -> TlsProxy {
        use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "lbctl test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf_params = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();

        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca_cert.pem()).unwrap();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(leaf_key.serialize_der());
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone()], key.into())
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));

        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let upstream = upstream.trim_start_matches("http://").to_owned();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        runtime.spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
                tokio::spawn(async move {
                    // A client that does not trust the certificate ends the handshake here.
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut plain) = tokio::net::TcpStream::connect(&upstream).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        TlsProxy { url, ca_file, accepted, _dir: dir, _runtime: runtime }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[test]
fn https_with_a_private_ca_works_and_an_untrusted_certificate_fails_at_once() {
    let server = Server::start(&[]);
    let proxy = TlsProxy::start(&server.url);
    let ca = proxy.ca_file.to_str().unwrap();

    let out = run(&proxy.url, &server.journal(), &with(CREATE, &["--ca-cert", ca, "--op-id", "op-tls"]));
    assert_exit(&out, 0);
    let id = json(&out)["id"].as_str().unwrap().to_owned();
    // LBCTL_CA_CERT does the same.
    let out = lbctl(&proxy.url, &server.journal(), &["--token", TOKEN, "workers", "get", &id])
        .env("LBCTL_CA_CERT", &proxy.ca_file)
        .output()
        .unwrap();
    assert_exit(&out, 0);
    assert_eq!(json(&out)["id"], id.as_str());

    // Without the CA: one attempt and one clear line, not a budget spent on retries.
    let before = proxy.accepted();
    let start = Instant::now();
    let out = run(&proxy.url, &server.journal(), &with(CREATE, &["--op-id", "op-untrusted", "--max-elapsed", "120s"]));
    assert_exit(&out, 1);
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    let text = stderr(&out);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("TLS") && text.contains("certificate") && text.contains("--ca-cert"), "{text}");
    assert_eq!(proxy.accepted() - before, 1, "a certificate error was retried: {text}");
    // A CA file that is not one is a usage error, before anything is sent.
    let out = run(&proxy.url, &server.journal(), &with(CREATE, &["--ca-cert", "/dev/null"]));
    assert_exit(&out, 2);
    assert_eq!(server.fleet().workers_active, 1);
}

// Firmware flashes and long-running operations (docs/protocol.md#firmware-operations and #clients).

/// The simulator's flash time in these tests: long enough that a poll sees `running`, short enough
/// to keep the tests quick.
const FLASH_MS: &str = "1500";

fn flash_server() -> Server {
    Server::start(&["--sim-flash-ms", FLASH_MS])
}

fn flash(node: &str, more: &[&'static str]) -> Vec<String> {
    let mut args: Vec<String> =
        ["--token", ADMIN, "firmware", "flash", node, "--version", "2.1.0"].map(str::to_owned).to_vec();
    args.extend(more.iter().map(|s| (*s).to_owned()));
    args
}

fn run_owned(url: &str, journal: &Path, args: &[String]) -> Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(url, journal, &args)
}

/// The non-empty stderr lines, each checked to be an `lbctl: ` line.
fn stderr_lines(out: &Output) -> Vec<String> {
    let text = stderr(out);
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    assert!(lines.iter().all(|l| l.starts_with("lbctl: ")), "{text:?}");
    lines
}

#[test]
fn flash_wait_follows_the_operation_to_success_and_a_rerun_follows_the_same_one() {
    let server = flash_server();
    let out = run_owned(&server.url, &server.journal(), &flash("node-0003", &["--op-id", "fw-node-3", "--wait"]));
    assert_exit(&out, 0);
    let op = json(&out);
    assert!(op["id"].as_str().is_some_and(|id| id.starts_with("op-")), "{op}");
    assert_eq!((op["kind"].as_str(), op["node_id"].as_str()), (Some("firmware-flash"), Some("node-0003")));
    assert_eq!((op["version"].as_str(), op["state"].as_str()), (Some("2.1.0"), Some("succeeded")), "{op}");
    assert!(op["error"].is_null() && op["finished_at"].is_string(), "{op}");

    // stderr is a pipe here: plain lines, one per state change (not one per poll), each naming the
    // operation and its state.
    let lines = stderr_lines(&out);
    let id = op["id"].as_str().unwrap();
    assert!(lines.iter().all(|l| l.contains(id)), "{lines:?}");
    let states: Vec<&str> = lines
        .iter()
        .map(|l| {
            if l.contains(": running (") {
                "running"
            } else if l.contains(": succeeded (") {
                "succeeded"
            } else {
                "?"
            }
        })
        .collect();
    assert_eq!(states, ["running", "succeeded"], "{lines:?}");

    // A rerun of the op id follows the same operation: no second flash.
    let again = run_owned(&server.url, &server.journal(), &flash("node-0003", &["--op-id", "fw-node-3", "--wait"]));
    assert_exit(&again, 0);
    assert_eq!(json(&again)["id"], op["id"]);
    assert_eq!(json(&again)["state"], "succeeded");
    let fleet = server.fleet();
    assert_eq!((fleet.firmware_flashes_total, fleet.nodes_bricked), (1, 0), "{fleet:?}");

    // `operations get` and `operations wait` show the finished operation.
    let got = run(&server.url, &server.journal(), &["--token", ADMIN, "operations", "get", id]);
    assert_exit(&got, 0);
    assert_eq!(json(&got), op);
    assert!(got.stderr.is_empty(), "{}", stderr(&got));
    let waited = run(&server.url, &server.journal(), &["--token", ADMIN, "operations", "wait", id]);
    assert_exit(&waited, 0);
    assert_eq!(json(&waited), op);
    assert_eq!(stderr_lines(&waited).len(), 1, "{}", stderr(&waited));
}

#[test]
fn a_rerun_after_a_crash_resends_the_journaled_key_and_the_server_replays_the_operation() {
    use leasebroker_client::journal::Journal;
    use leasebroker_client::{FlashFirmware, Mutation, NodeId};

    let server = flash_server();
    // The first run journaled its key and reached the server, then died before recording the
    // answer: the journal holds the key and no outcome.
    let node: NodeId = "node-0005".parse().unwrap();
    let request = FlashFirmware::new("2.1.0");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let first = runtime.block_on(async {
        let journal = Journal::open(server.journal()).await.unwrap();
        let mutation = Mutation::FlashFirmware { node_id: node.clone(), request: request.clone() };
        let key = journal.begin("fw-crashed", &mutation.fingerprint()).await.unwrap();
        journal.close().await;
        let admin = Client::new(&server.url, ADMIN).unwrap();
        admin.flash_firmware(&node, &request, &key).await.unwrap().value
    });

    let rerun =
        run_owned(&server.url, &server.journal(), &flash("node-0005", &["--op-id", "fw-crashed", "--wait", "-v"]));
    assert_exit(&rerun, 0);
    let op = json(&rerun);
    assert_eq!(op["id"], first.id.as_str(), "the rerun started another operation");
    assert_eq!(op["state"], "succeeded");
    assert!(stderr(&rerun).contains("202 Accepted (replayed)"), "{}", stderr(&rerun));
    let fleet = server.fleet();
    assert_eq!((fleet.firmware_flashes_total, fleet.nodes_bricked), (1, 0), "{fleet:?}");
}

#[test]
fn a_flash_that_fails_makes_wait_exit_7_with_the_failed_operation() {
    // The simulated BMC fails every flash's verification at its end.
    let server = Server::start(&["--sim-flash-ms", FLASH_MS, "--sim-flash-fail", "1"]);
    let out = run_owned(&server.url, &server.journal(), &flash("node-0004", &["--op-id", "fw-fails", "--wait"]));
    assert_exit(&out, 7);
    let op = json(&out);
    assert_eq!(op["state"], "failed", "{op}");
    assert!(op["error"].as_str().is_some_and(|e| !e.is_empty()) && op["finished_at"].is_string(), "{op}");
    let lines = stderr_lines(&out);
    let last = lines.last().expect("a reason line");
    assert!(last.starts_with(&format!("lbctl: operation {} failed: ", op["id"].as_str().unwrap())), "{lines:?}");
    assert!(lines.iter().any(|l| l.contains(": running (")), "{lines:?}");
    // Following it again says the same.
    let again =
        run(&server.url, &server.journal(), &["--token", ADMIN, "operations", "wait", op["id"].as_str().unwrap()]);
    assert_exit(&again, 7);
    assert_eq!(json(&again), op);
}

#[test]
fn flash_without_wait_prints_the_accepted_operation() {
    let server = flash_server();
    let out = run_owned(&server.url, &server.journal(), &flash("node-0001", &[]));
    assert_exit(&out, 0);
    let op = json(&out);
    assert_eq!((op["state"].as_str(), op["node_id"].as_str()), (Some("running"), Some("node-0001")), "{op}");
    assert!(out.stderr.is_empty(), "{}", stderr(&out));
    // Follow it afterwards.
    let id = op["id"].as_str().unwrap();
    let waited = run(&server.url, &server.journal(), &["--token", ADMIN, "operations", "wait", id]);
    assert_exit(&waited, 0);
    assert_eq!(json(&waited)["state"], "succeeded");
}

#[test]
fn another_key_on_a_flashing_node_exits_3_and_names_the_running_operation() {
    let server = Server::start(&["--sim-flash-ms", "20000"]);
    let first = run_owned(&server.url, &server.journal(), &flash("node-0002", &["--op-id", "fw-a"]));
    assert_exit(&first, 0);
    let running = json(&first)["id"].as_str().unwrap().to_owned();

    let second = run_owned(&server.url, &server.journal(), &flash("node-0002", &["--op-id", "fw-b"]));
    assert_exit(&second, 3);
    assert!(second.stdout.is_empty());
    let lines = stderr_lines(&second);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("operation-conflict"), "{lines:?}");
    assert!(lines[0].contains(&format!("`lbctl operations wait {running}` follows it")), "{lines:?}");
    // The refusal is fw-b's answer (the server keeps it for that key too): a rerun answers from the
    // journal, the same way, without sending.
    let sentinel = Sentinel::start();
    let again = run_owned(&sentinel.url(), &server.journal(), &flash("node-0002", &["--op-id", "fw-b"]));
    assert_exit(&again, 3);
    assert!(stderr(&again).contains("operation-conflict") && stderr(&again).contains("journal"), "{}", stderr(&again));
    assert!(!sentinel.contacted());
    let fleet = server.fleet();
    assert_eq!((fleet.firmware_flashes_total, fleet.nodes_bricked), (1, 0), "{fleet:?}");
}

#[test]
fn an_unknown_operation_exits_3_with_one_line() {
    let server = flash_server();
    for command in ["get", "wait"] {
        let out = run(&server.url, &server.journal(), &["--token", ADMIN, "operations", command, "op-doesnotexist"]);
        assert_exit(&out, 3);
        assert!(out.stdout.is_empty());
        let lines = stderr_lines(&out);
        assert_eq!(lines.len(), 1, "{command}: {lines:?}");
        assert!(lines[0].contains("404"), "{command}: {lines:?}");
    }
    // A user token is not the admin token.
    let out = run(&server.url, &server.journal(), &["--token", TOKEN, "operations", "get", "op-doesnotexist"]);
    assert_exit(&out, 6);
    let mut as_user = flash("node-0001", &[]);
    as_user[1] = TOKEN.to_owned();
    assert_exit(&run_owned(&server.url, &server.journal(), &as_user), 6);
    assert_eq!(server.fleet().firmware_flashes_total, 0);
}

#[test]
fn operation_and_node_ids_are_checked_before_sending() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("j.db");
    let sentinel = Sentinel::start();
    for args in [
        &["--token", ADMIN, "operations", "get", "../fleet"][..],
        &["--token", ADMIN, "operations", "wait", "op/1"],
        &["--token", ADMIN, "firmware", "flash", "node%2F1", "--version", "2.1.0"],
        &["--token", ADMIN, "firmware", "flash", "node-1"], // no --version
        &["--token", ADMIN, "firmware", "flash", "--version", "2.1.0"], // no node
    ] {
        let out = run(&sentinel.url(), &journal, args);
        assert_exit(&out, 2);
    }
    assert!(!sentinel.contacted());
    assert!(!journal.exists());
}

#[test]
fn the_help_texts_name_the_firmware_and_operations_commands() {
    let help = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_lbctl")).args(args).arg("--help").output().unwrap();
        assert_exit(&out, 0);
        String::from_utf8(out.stdout).unwrap()
    };
    let top = help(&[]);
    assert!(top.contains("firmware") && top.contains("operations") && top.contains("7"), "{top}");
    let flash = help(&["firmware", "flash"]);
    for needle in ["NODE_ID", "--version", "--op-id", "--wait", "exits 0 when the flash succeeded and 7"] {
        assert!(flash.contains(needle), "{needle} missing: {flash}");
    }
    let ops = help(&["operations"]);
    assert!(ops.contains("get") && ops.contains("wait") && ops.contains("resolve"), "{ops}");
    let resolve = help(&["operations", "resolve"]);
    assert!(resolve.contains("--state") && resolve.contains("--reason") && resolve.contains("uncertain"), "{resolve}");
    assert!(help(&["operations", "wait"]).contains("OP_ID"));
}

/// A server that answers every request with the next operation state of `states` (the last one
/// repeats), as `GET /admin/v1/operations/op-scripted` would, counting the requests.
fn scripted_operation(states: &'static [&'static str]) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let state = states[n.min(states.len() - 1)];
            let (error, finished) = match state {
                "running" | "verifying" => ("null", "null"),
                "failed" => (r#""the BMC refused the image""#, r#""2026-11-30T21:00:03Z""#),
                "uncertain" => (r#""the BMC serves no firmware inventory""#, r#""2026-11-30T21:00:03Z""#),
                _ => ("null", r#""2026-11-30T21:00:03Z""#),
            };
            let body = format!(
                r#"{{"id":"op-scripted","kind":"firmware-flash","node_id":"node-0009","version":"2.1.0","state":"{state}","error":{error},"created_at":"2026-11-30T21:00:00Z","finished_at":{finished}}}"#
            );
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes());
        }
    });
    (url, count)
}

#[test]
fn wait_on_a_failed_operation_exits_7_with_its_json_and_one_line_per_state() {
    let dir = tempfile::tempdir().unwrap();
    let (url, polls) = scripted_operation(&["running", "running", "running", "failed"]);
    let out = run(&url, &dir.path().join("j.db"), &["--token", ADMIN, "operations", "wait", "op-scripted"]);
    assert_exit(&out, 7);
    let op = json(&out);
    assert_eq!((op["state"].as_str(), op["error"].as_str()), (Some("failed"), Some("the BMC refused the image")));
    assert_eq!(polls.load(std::sync::atomic::Ordering::SeqCst), 4, "polled on after the end, or too few times");
    // Three polls saw `running`: one line for it, one for `failed`, then the reason.
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].contains("op-scripted") && lines[0].contains(": running ("), "{lines:?}");
    assert!(lines[1].contains(": failed (the BMC refused the image) ("), "{lines:?}");
    assert_eq!(lines[2], "lbctl: operation op-scripted failed: the BMC refused the image");
}

#[test]
fn an_operation_state_this_lbctl_does_not_know_is_followed_until_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    // "verifying" (no finished_at) is still going; "cancelled" with finished_at has ended.
    let (url, polls) = scripted_operation(&["verifying", "cancelled"]);
    let out = run(&url, &dir.path().join("j.db"), &["--token", ADMIN, "operations", "wait", "op-scripted"]);
    assert_exit(&out, 7);
    assert_eq!(json(&out)["state"], "cancelled");
    assert_eq!(polls.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(stderr(&out).contains("ended cancelled, not succeeded"), "{}", stderr(&out));
}

#[test]
fn wait_on_an_uncertain_operation_exits_7_and_names_the_resolve_command() {
    let dir = tempfile::tempdir().unwrap();
    let (url, polls) = scripted_operation(&["running", "uncertain"]);
    let out = run(&url, &dir.path().join("j.db"), &["--token", ADMIN, "operations", "wait", "op-scripted"]);
    assert_exit(&out, 7);
    assert_eq!(json(&out)["state"], "uncertain");
    assert_eq!(polls.load(std::sync::atomic::Ordering::SeqCst), 2, "an uncertain operation ends the wait");
    let lines = stderr_lines(&out);
    let last = lines.last().expect("a reason line");
    assert!(
        last.starts_with("lbctl: operation op-scripted ended uncertain: the BMC serves no firmware inventory")
            && last.contains("lbctl operations resolve op-scripted --state succeeded|failed --reason"),
        "{lines:?}"
    );
}

/// End to end against a Redfish BMC like sushy-tools' (no task list, no payload, no inventory)
/// that loses the answer to every flash: the flash's outcome cannot be read, so `--wait` ends on
/// `uncertain` (exit 7, naming the resolve command); `operations resolve` ends it as the operator
/// found the machine, and a second resolve is refused (exit 3).
#[test]
fn an_uncertain_flash_is_resolved_with_operations_resolve() {
    let sim = testkit::sim(&[
        "--bmc",
        "redfish",
        "--redfish-systems",
        "64",
        "--redfish-terse",
        "--redfish-no-payload",
        "--redfish-no-task-list",
        "--redfish-no-inventory",
        "--fail-after",
        "1",
    ]);
    let bmc = format!("redfish+{}", sim.url);
    let server = Server::start(&[
        "--hypervisor-url",
        &sim.url,
        "--bmc-url",
        &bmc,
        "--hypervisor-timeout",
        "1s",
        "--hypervisor-settle",
        "2s",
        "--operation-poll",
        "100ms",
    ]);
    let out = run_owned(&server.url, &server.journal(), &flash("node-0006", &["--op-id", "fw-uncertain", "--wait"]));
    assert_exit(&out, 7);
    let op = json(&out);
    let id = op["id"].as_str().unwrap().to_owned();
    assert_eq!(op["state"], "uncertain", "{op}");
    let lines = stderr_lines(&out);
    let last = lines.last().expect("a reason line");
    assert!(last.contains(&format!("lbctl operations resolve {id} --state succeeded|failed")), "{lines:?}");

    let resolve = |reason: &str| {
        let args = ["--token", ADMIN, "operations", "resolve", &id, "--state", "failed", "--reason", reason];
        run(&server.url, &server.journal(), &args)
    };
    let resolved = resolve("the BMC still runs 1.0 after a power cycle");
    assert_exit(&resolved, 0);
    let resolved = json(&resolved);
    assert_eq!(resolved["state"], "failed", "{resolved}");
    assert!(resolved["error"].as_str().is_some_and(|e| e.contains("still runs 1.0")), "{resolved}");
    let got = run(&server.url, &server.journal(), &["--token", ADMIN, "operations", "get", &id]);
    assert_eq!(json(&got)["state"], "failed");

    let again = resolve("a second look");
    assert_exit(&again, 3);
    assert!(stderr(&again).contains("operation-not-uncertain"), "{}", stderr(&again));
    let bad = run(
        &server.url,
        &server.journal(),
        &["--token", ADMIN, "operations", "resolve", &id, "--state", "running", "--reason", "x"],
    );
    assert_exit(&bad, 2);
}

/// A server that answers every request with `status` and `body` as given, byte for byte.
fn raw_server(status: u16, body: Vec<u8>) -> String {
    let mut response = format!(
        "HTTP/1.1 {status} Whatever\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(&body);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let _ = stream.write_all(&response);
        }
    });
    url
}

#[test]
fn stdout_escapes_control_and_bidi_characters_and_stays_the_same_json() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("j.db");
    let unsafe_char = |c: char| {
        (c.is_control() && c != '\n' && c != '\t')
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    // Valid JSON carrying, raw inside its strings, a C1 CSI (U+009B) and a bidi override (U+202E):
    // JSON allows both unescaped, and a terminal acts on them.
    let value = serde_json::json!({"id": "wkr-1", "state": "running", "image": "a\u{9b}31m\u{202e}gnp.exe",
        "cpu": 2, "memory_gb": 4, "labels": {"k\u{2066}": "v\u{85}"}, "node_id": "node-0001",
        "lease_id": "lse-1", "vm_id": "vm-1", "reboot_count": 0, "created_at": "2026-12-02T00:00:00Z"});
    let body = serde_json::to_vec(&value).unwrap();
    assert!(String::from_utf8_lossy(&body).chars().any(unsafe_char), "the test body carries them raw");
    let out = run(&raw_server(200, body), &journal, &["--token", TOKEN, "workers", "get", "wkr-1"]);
    assert_exit(&out, 0);
    let text = String::from_utf8(out.stdout.clone()).expect("utf-8");
    let bad: Vec<char> = text.chars().filter(|&c| unsafe_char(c)).collect();
    assert!(bad.is_empty(), "{bad:?} on stdout: {text:?}");
    assert_eq!(json(&out), value, "stdout parses to the very same JSON");

    // Not JSON at all, with raw ESC sequences and a carriage return: none reaches stdout raw.
    let out = run(
        &raw_server(200, b"\x1b[2J\x1b]0;owned\x07line\rover\xc2\x9b".to_vec()),
        &journal,
        &["--token", TOKEN, "workers", "get", "wkr-1"],
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!text.chars().any(unsafe_char), "{text:?}");
}

/// Issue 30: `lbctl records list|get|forget` with the admin token; forget is a mutation with an
/// op id like the others, and its retry (a rerun of the op id) does not forget twice.
#[test]
fn records_list_get_and_forget() {
    let server = Server::start(&[]);
    let made = run(&server.url, &server.journal(), &with(CREATE, &["--op-id", "op-records-create"]));
    assert_exit(&made, 0);
    let admin = |args: &[&str]| run(&server.url, &server.journal(), &with(&["--token", ADMIN, "records"], args));

    let listed = admin(&["list", "--state", "completed", "--principal", "alice"]);
    assert_exit(&listed, 0);
    let page = json(&listed);
    let records = page["records"].as_array().expect("records");
    assert_eq!(records.len(), 1, "{page}");
    assert_eq!(records[0]["endpoint"], "POST /v1/workers");
    assert_eq!(page["next_cursor"], serde_json::Value::Null);
    let id = records[0]["id"].as_str().expect("id").to_owned();

    let got = admin(&["get", &id, "--body"]);
    assert_exit(&got, 0);
    let body: serde_json::Value =
        serde_json::from_str(json(&got)["response_body"].as_str().expect("body")).expect("the stored worker");
    assert_eq!(body["id"], json(&made)["id"]);

    // A tenant's token is refused (exit 6); a bad filter is the server's 400 (exit 3).
    let tenant = run(&server.url, &server.journal(), &["--token", TOKEN, "records", "list"]);
    assert_exit(&tenant, 6);
    assert_exit(&admin(&["list", "--older-than", "soon"]), 3);
    assert_exit(&admin(&["list", "--state", "running"]), 2);

    assert_exit(&admin(&["forget", &id, "--op-id", "op-forget-1"]), 0);
    assert_exit(&admin(&["forget", &id, "--op-id", "op-forget-1"]), 0);
    let gone = admin(&["get", &id]);
    assert_exit(&gone, 3);
    assert!(stderr(&gone).contains("404") || stderr(&gone).contains("no such record"), "{}", stderr(&gone));
    let unknown = admin(&["forget", "0123456789abcdef0123456789abcdef", "--op-id", "op-forget-2"]);
    assert_exit(&unknown, 3);
}

/// Issue 30: `-o table|json|yaml` and `--quiet` for people and scripts; a table by default on a
/// terminal (stdout a pseudo-terminal made by `script`), the server's JSON when piped.
#[test]
fn output_is_a_table_on_a_terminal_json_when_piped_and_yaml_or_ids_when_asked() {
    let server = Server::start(&[]);
    let made = run(&server.url, &server.journal(), CREATE);
    assert_exit(&made, 0);
    let id = json(&made)["id"].as_str().expect("id").to_owned();
    let list = |more: &[&str]| {
        let out = run(&server.url, &server.journal(), &with(&["--token", TOKEN, "workers", "list"], more));
        assert_exit(&out, 0);
        String::from_utf8(out.stdout).expect("utf-8")
    };

    let piped = list(&[]);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&piped).expect("json")["workers"][0]["id"], id.as_str());
    assert_eq!(list(&["-o", "json"]), piped);
    let table = list(&["-o", "table"]);
    let mut lines = table.lines();
    assert!(
        lines.next().is_some_and(|h| h.starts_with("ID") && h.contains("STATE") && h.contains("NODE_ID")),
        "{table}"
    );
    assert!(lines.next().is_some_and(|row| row.starts_with(&id)), "{table}");
    let yaml: serde_json::Value = yaml_serde::from_str(&list(&["-o", "yaml"])).expect("yaml");
    assert_eq!(yaml, serde_json::from_str::<serde_json::Value>(&piped).expect("json"));
    assert_eq!(list(&["--quiet"]), format!("{id}\n"));
    assert_eq!(list(&["-q", "-o", "yaml"]), format!("{id}\n"));

    let records = run(&server.url, &server.journal(), &["--token", ADMIN, "records", "list", "-q"]);
    assert_exit(&records, 0);
    let ids = String::from_utf8(records.stdout).expect("utf-8");
    assert!(ids.lines().count() == 1 && ids.trim().len() == 32, "{ids:?}");

    // On a terminal, a table unless told otherwise.
    let journal = server.journal();
    let command = format!(
        "{} --url {} --journal {} --token {TOKEN} workers get {id}",
        env!("CARGO_BIN_EXE_lbctl"),
        server.url,
        journal.display()
    );
    let tty = Command::new("script").args(["-qec", &command, "/dev/null"]).stdin(Stdio::null()).output();
    let tty = tty.expect("run script (util-linux), which gives lbctl a terminal");
    assert!(tty.status.success(), "{}", String::from_utf8_lossy(&tty.stdout));
    let shown = String::from_utf8_lossy(&tty.stdout);
    let header = shown.lines().next().map(|l| l.split_whitespace().collect::<Vec<_>>());
    assert_eq!(header, Some(vec!["FIELD", "VALUE"]), "{shown:?}");
    assert!(shown.lines().any(|l| l.starts_with("id") && l.trim_end().ends_with(&id)), "{shown:?}");
}
