//! Black-box tests of what keeps the service safe in front of many tenants: quotas, rate limits,
//! connection timeouts, bounded problem details, secrets, file modes, internal details, the
//! in-process simulator's reachability, and the shutdown drain of detached handlers. Each starts
//! the real `leasebroker` binary.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{BIN, Launch, Proc, sqlite_url};
use testkit::tokens::{ADMIN, ALICE, BOB};

/// Starts `leasebroker ARGS` (`RUST_LOG=info`) with `env`, and waits for its address.
fn start_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
    env.iter().fold(Launch::new(args).env("RUST_LOG", "info"), |l, (k, v)| l.env(k, v)).start()
}

/// `leasebroker serve` (`RUST_LOG=info`) with the test tokens, a pool of 40 nodes unless `extra`
/// sets `--pool-nodes`, and `extra`.
fn serve(db: &str, extra: &[&str]) -> Proc {
    Launch::serve(db, &testkit::leasebroker::with_pool_nodes("40", extra)).env("RUST_LOG", "info").start()
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client")
}

struct Reply {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned()
    }
}

async fn send(method: reqwest::Method, url: &str, token: &str, key: Option<&str>, body: Option<Vec<u8>>) -> Reply {
    let mut req = http().request(method, url).bearer_auth(token);
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let resp = req.send().await.expect("request");
    Reply { status: resp.status(), headers: resp.headers().clone(), body: resp.bytes().await.expect("body").to_vec() }
}

async fn create(base: &str, token: &str, key: &str) -> Reply {
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    send(reqwest::Method::POST, &format!("{base}/v1/workers"), token, Some(key), Some(body.to_string().into())).await
}

async fn fleet(base: &str) -> Value {
    send(reqwest::Method::GET, &format!("{base}/admin/v1/fleet"), ADMIN, None, None).await.json()
}

// Quotas and rate limits (issue 17, item 1).

#[tokio::test]
async fn quota_caps_concurrent_creates_and_a_refused_create_takes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    quota_case(&sqlite_url(&dir), 1).await;
}

#[tokio::test]
async fn quota_caps_concurrent_creates_on_postgres() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    // Two replicas on one database: the quota holds across processes.
    quota_case(pg.url(), 2).await;
}

async fn quota_case(db: &str, replicas: usize) {
    let servers: Vec<Proc> = (0..replicas).map(|_| serve(db, &["--max-workers-per-principal", "5"])).collect();
    let lb = &servers[0];
    let creates = (0..32).map(|i| {
        let base = servers[i % replicas].url.clone();
        tokio::spawn(async move { create(&base, ALICE, &format!("quota-{i}")).await })
    });
    let mut created = Vec::new();
    let mut refused = Vec::new();
    for (i, task) in creates.enumerate() {
        let r = task.await.expect("task");
        match r.status {
            StatusCode::CREATED => created.push(r.json()["id"].as_str().expect("id").to_owned()),
            StatusCode::FORBIDDEN => {
                assert_eq!(r.problem_type(), "quota-exceeded", "{}", r.text());
                refused.push(i);
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!((created.len(), refused.len()), (5, 27));
    let f = fleet(&lb.url).await;
    assert_eq!((f["nodes_allocated"].as_i64(), f["workers_active"].as_i64()), (Some(5), Some(5)), "{f}");

    // Another principal is not held back by alice's quota.
    assert_eq!(create(&lb.url, BOB, "quota-bob").await.status, StatusCode::CREATED);

    // The refusal was not stored: once alice deletes a worker, a retry of a refused key runs.
    let del =
        send(reqwest::Method::DELETE, &format!("{}/v1/workers/{}", lb.url, created[0]), ALICE, Some("quota-del"), None)
            .await;
    assert_eq!(del.status, StatusCode::NO_CONTENT);
    let retry = create(&lb.url, ALICE, &format!("quota-{}", refused[0])).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    let f = fleet(&lb.url).await;
    assert_eq!(f["nodes_allocated"].as_i64(), Some(6), "{f}");
}

#[tokio::test]
async fn the_rate_limit_answers_429_with_retry_after_per_principal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--rate-limit", "1", "--rate-limit-burst", "3"]);
    // Twenty at once: however slowly a busy machine sends them, only the burst and about one a
    // second pass.
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let base = lb.url.clone();
            tokio::spawn(async move { create(&base, ALICE, &format!("rl-{i}")).await })
        })
        .collect();
    let started = Instant::now();
    let mut statuses = Vec::new();
    for task in tasks {
        let r = task.await.expect("task");
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(r.problem_type(), "too-many-requests", "{}", r.text());
            let secs: u64 = r.headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
            assert!(secs >= 1, "{secs}");
        }
        statuses.push(r.status);
    }
    let passed = statuses.iter().filter(|s| **s == StatusCode::CREATED).count() as u64;
    assert!(passed <= 3 + started.elapsed().as_secs() + 1, "{passed} passed: {statuses:?}");
    let limited = statuses.iter().filter(|s| **s == StatusCode::TOO_MANY_REQUESTS).count();
    assert!(limited >= 1, "{statuses:?}");
    assert!(statuses.iter().filter(|s| **s == StatusCode::CREATED).count() >= 3, "the burst passes: {statuses:?}");
    // Reads are not limited, and bob has his own budget.
    let list = send(reqwest::Method::GET, &format!("{}/v1/workers", lb.url), ALICE, None, None).await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(create(&lb.url, BOB, "rl-bob").await.status, StatusCode::CREATED);
}

// Connection timeouts (item 2).

/// Reads until the server closes the socket (EOF or reset), up to `within`. Returns what it read.
async fn read_until_closed(sock: &mut tokio::net::TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, sock.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn a_connection_without_headers_or_with_a_stalled_body_is_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--header-timeout", "1s", "--idle-timeout", "2s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();

    // Connects and sends nothing at all.
    let mut silent = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    assert!(read_until_closed(&mut silent, Duration::from_secs(30)).await.is_some(), "still open after 30 s");

    // Sends half a header.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.expect("write");
    assert!(read_until_closed(&mut slow, Duration::from_secs(30)).await.is_some(), "still open after 30 s");

    // Sends headers that promise a body, then stalls: cut after the idle timeout.
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /v1/workers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\n\
         Idempotency-Key: stalled-1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"image\""
    );
    stalled.write_all(head.as_bytes()).await.expect("write");
    let answer = read_until_closed(&mut stalled, Duration::from_secs(30)).await;
    let answer =
        String::from_utf8_lossy(&answer.expect("a stalled body kept the connection open for 30 s")).into_owned();
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("body-unreadable"), "{answer}");

    // The server still serves.
    let ok = http().get(format!("{}/healthz", lb.url)).send().await.expect("healthz");
    assert_eq!(ok.status(), StatusCode::OK);
    // And the refusal was not stored (the body is read before the key is claimed): a retry runs.
    let r = create(&lb.url, ALICE, "stalled-1").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--header-timeout", "30s", "--idle-timeout", "1s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    sock.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await.expect("write");
    let mut buf = [0u8; 1024];
    let n = sock.read(&mut buf).await.expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    // Well before the 30 s header timeout, the idle timeout closes it.
    let started = Instant::now();
    assert!(read_until_closed(&mut sock, Duration::from_secs(25)).await.is_some(), "idle connection kept open");
    assert!(started.elapsed() < Duration::from_secs(25));
}

// Problem details are bounded (item 3).

#[tokio::test]
async fn problem_details_are_bounded_and_never_echo_the_body() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let big = "Z".repeat(900 * 1024);
    let canary = "Z".repeat(64);
    let url = format!("{}/v1/workers", lb.url);
    let bodies = [
        (format!(r#"{{"image": "i", "cpu": "{big}", "memory_gb": 1}}"#), StatusCode::UNPROCESSABLE_ENTITY),
        (format!(r#"{{"image": "i", "cpu": 1, "memory_gb": 1, "{big}": 1}}"#), StatusCode::UNPROCESSABLE_ENTITY),
        (
            format!(r#"{{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {{"k": "v"{big}}}}}"#),
            StatusCode::BAD_REQUEST,
        ),
        (format!(r#"{{"image": "{big}", "cpu": 1, "memory_gb": 1}}"#), StatusCode::UNPROCESSABLE_ENTITY),
        (
            format!(r#"{{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {{"k": "{big}"}}}}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            format!(r#"{{"image": "i", "cpu": 1, "memory_gb": 1, "labels": {{"{}": "v"}}}}"#, "Z".repeat(300)),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ];
    for (i, (body, want)) in bodies.into_iter().enumerate() {
        let r = send(reqwest::Method::POST, &url, ALICE, Some(&format!("big-{i}")), Some(body.into_bytes())).await;
        assert_eq!(r.status, want, "case {i}: {}", &r.text()[..r.text().len().min(500)]);
        assert!(r.body.len() <= 600, "case {i}: a {}-byte problem", r.body.len());
        let detail = r.json()["detail"].as_str().expect("detail").to_owned();
        assert!(!detail.is_empty() && detail.len() <= 300, "case {i}: {detail}");
        assert!(!r.text().contains(&canary), "case {i} echoes the body: {}", r.text());
    }
}

// Secrets (item 4).

#[test]
fn help_never_prints_secrets_from_the_environment() {
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .env("LEASEBROKER_TOKENS", "help-canary-token-0a1b2c3d=alice")
        .env("LEASEBROKER_ADMIN_TOKEN", "help-canary-admin-4e5f6a7b")
        .env("LEASEBROKER_DATABASE", "postgres://u:help-canary-pw@db.internal/lb")
        .env("LEASEBROKER_HYPERVISOR_URL", "http://hv:help-canary-hv@hv.internal/")
        .output()
        .expect("run");
    assert!(out.status.success());
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("--token"), "{text}");
    assert!(!text.contains("help-canary"), "--help shows a secret from the environment:\n{text}");
}

/// Runs `leasebroker serve ARGS` expecting it to refuse to start; returns its stderr.
fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &db])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("stderr");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve {args:?} started instead of refusing: {err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "serve {args:?} started: {err}");
    err
}

#[test]
fn bad_tokens_are_refused_in_one_line_without_echoing_them() {
    // Not TOKEN=PRINCIPAL: the value may be a bare secret; it is never echoed.
    let err = refused(&["--token", "sekrit-canary-no-principal-0123"], &[]);
    assert!(!err.contains("sekrit-canary"), "{err}");
    assert!(err.contains("TOKEN=PRINCIPAL"), "{err}");
    let err = refused(&[], &[("LEASEBROKER_TOKENS", "sekrit-canary-env-0123456789")]);
    assert!(!err.contains("sekrit-canary"), "{err}");
    // Too short.
    let err = refused(&["--token", "short-canary=alice"], &[]);
    assert!(!err.contains("short-canary"), "{err}");
    assert!(err.contains("at least 16"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let err = refused(&["--token", &format!("{ALICE}=alice"), "--admin-token", "adm-canary"], &[]);
    assert!(!err.contains("adm-canary"), "{err}");
    assert!(err.contains("at least 16"), "{err}");
    // The admin token may not also be a tenant's token.
    let err = refused(&["--token", &format!("{ALICE}=alice"), "--admin-token", ALICE], &[]);
    assert!(!err.contains(ALICE), "{err}");
    assert!(err.contains("admin"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[tokio::test]
async fn a_token_is_split_from_its_principal_at_the_last_equals_sign() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    let token = "tok-with=equals-0123456789";
    let arg = format!("{token}=carol");
    let lb = start_env(&["serve", "--listen", "127.0.0.1:0", "--database", &db, "--token", &arg], &[]);
    let r = send(reqwest::Method::GET, &format!("{}/v1/workers", lb.url), token, None, None).await;
    assert_eq!(r.status, StatusCode::OK, "the whole token before the last '=' authenticates");
    let r = send(reqwest::Method::GET, &format!("{}/v1/workers", lb.url), "tok-with", None, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "the part before the first '=' is not a token");
}

// Files (item 5).

#[cfg(unix)]
#[tokio::test]
async fn the_sqlite_database_and_its_wal_are_owner_only_in_an_owner_only_directory() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("new").join("data");
    let db = format!("sqlite://{}", data.join("lb.db").display());
    let lb = serve(&db, &[]);
    assert_eq!(create(&lb.url, ALICE, "files-1").await.status, StatusCode::CREATED);
    let mode = |p: &std::path::Path| std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
    for name in ["lb.db", "lb.db-wal", "lb.db-shm"] {
        let path = data.join(name);
        assert!(path.exists(), "{name} exists");
        assert_eq!(mode(&path), 0o600, "{name}: {:o}", mode(&path));
    }
    assert_eq!(mode(&data), 0o700, "the directory the service created");
    assert_eq!(mode(&dir.path().join("new")), 0o700, "and its parent, also created");
}

// Internal details (item 8).

/// A fake hypervisor that answers every call with `status` and a distinctive body.
async fn hostile_hypervisor(status: u16) -> String {
    use axum::http::StatusCode as S;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = axum::Router::new().fallback(move || async move {
        (S::from_u16(status).expect("status"), "hv-body-canary: internal host db7.hv.internal:5432 failed")
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://hvuser:hv-pass-canary@{addr}/")
}

#[tokio::test]
async fn hypervisor_addresses_and_error_bodies_never_reach_tenants_and_the_log_hides_credentials() {
    for status in [500, 422] {
        let hv = hostile_hypervisor(status).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &hv, "--hypervisor-timeout", "2s"]);
        let r = create(&lb.url, ALICE, "hv-1").await;
        assert!(r.status == StatusCode::BAD_GATEWAY || r.status == StatusCode::SERVICE_UNAVAILABLE, "{}", r.status);
        assert_eq!(r.problem_type(), "upstream-unavailable");
        let text = r.text();
        for leak in ["hv-body-canary", "127.0.0.1", "hv-pass-canary", "hvuser", "http://"] {
            assert!(!text.contains(leak), "{status}: a tenant sees {leak:?}: {text}");
        }
        assert!(r.json()["detail"].as_str().expect("detail").len() <= 300);
        let fleet = send(reqwest::Method::GET, &format!("{}/admin/v1/fleet", lb.url), ADMIN, None, None).await;
        assert!(!fleet.text().contains("hv-body-canary") && !fleet.text().contains("127.0.0.1"), "{}", fleet.text());
        let log = lb.log();
        assert!(log.contains("hv-body-canary"), "the log keeps the details: {log}");
        assert!(!log.contains("hv-pass-canary"), "the log shows the hypervisor's password: {log}");
    }
    // Unreachable: the connection error names the address; the tenant never sees it.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], testkit::closed_port()));
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--hypervisor-url", &format!("http://{addr}/")]);
    let r = create(&lb.url, ALICE, "hv-2").await;
    assert_eq!(r.problem_type(), "upstream-unavailable", "{}", r.text());
    assert!(!r.text().contains(&addr.port().to_string()) && !r.text().contains("127.0.0.1"), "{}", r.text());
}

#[tokio::test]
async fn database_errors_never_reach_tenants_or_readyz() {
    use sqlx::Connection;
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let admin_url = testkit::postgres::postgres_server_url().expect("the server URL");
    let mut admin = sqlx::PgConnection::connect(&admin_url).await.expect("connect");
    let name = pg.name().to_owned();
    let db = pg.url().to_owned();
    let lb = serve(&db, &[]);
    assert_eq!(create(&lb.url, ALICE, "db-1").await.status, StatusCode::CREATED);

    // Refuse new connections and end the service's current ones.
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false")))
        .execute(&mut admin)
        .await
        .expect("alter");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
    )))
    .execute(&mut admin)
    .await
    .expect("terminate");

    let deadline = Instant::now() + Duration::from_secs(60);
    let ready = loop {
        let r = http().get(format!("{}/readyz", lb.url)).send().await.expect("readyz");
        let status = r.status();
        let text = r.text().await.expect("body");
        if status == StatusCode::SERVICE_UNAVAILABLE || Instant::now() > deadline {
            break (status, text);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(ready.0, StatusCode::SERVICE_UNAVAILABLE);
    for leak in [name.as_str(), "accepting", "pool", "database \"", "error returned"] {
        assert!(!ready.1.contains(leak), "/readyz shows {leak:?}: {}", ready.1);
    }
    for (i, path) in ["/v1/workers", "/v1/workers/wkr-0000000000000000"].iter().enumerate() {
        let r = if i == 0 {
            create(&lb.url, ALICE, "db-2").await
        } else {
            send(reqwest::Method::GET, &format!("{}{path}", lb.url), ALICE, None, None).await
        };
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {}", r.text());
        for leak in [name.as_str(), "accepting", "pool timed out", "database \"", "error returned", "sqlx"] {
            assert!(!r.text().contains(leak), "{path} shows {leak:?}: {}", r.text());
        }
    }
    drop(lb);
    // Let the test database be dropped again.
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true")))
        .execute(&mut admin)
        .await
        .expect("alter");
}

// The in-process simulator (item 9).

/// The TCP ports process `pid` listens on (Linux: its socket inodes matched in /proc/net/tcp*).
#[cfg(target_os = "linux")]
fn listening_ports(pid: u32) -> Vec<u16> {
    let mut inodes = std::collections::HashSet::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds").flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let t = target.to_string_lossy();
            if let Some(inode) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address is HEX_IP:HEX_PORT, st 0A is LISTEN, inode is column 9.
            if cols.len() > 9
                && cols[3] == "0A"
                && inodes.contains(cols[9])
                && let Some(port) = cols[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok())
            {
                ports.push(port);
            }
        }
    }
    ports
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_in_process_simulator_cannot_be_used_by_other_processes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    assert_eq!(create(&lb.url, ALICE, "sim-1").await.status, StatusCode::CREATED);
    let api_port: u16 = lb.url.rsplit(':').next().expect("port").parse().expect("port");
    let ports = listening_ports(lb.child.id());
    assert!(ports.contains(&api_port), "found the API port among {ports:?}");
    for port in ports.into_iter().filter(|p| *p != api_port) {
        let base = format!("http://127.0.0.1:{port}");
        let vms = http().get(format!("{base}/v1/vms")).send().await.expect("get");
        assert!(!vms.status().is_success(), "another process lists every tenant's VMs on port {port}");
        let faults = http()
            .put(format!("{base}/v1/faults"))
            .json(&json!({"fail_before": 1.0, "fail_after": 0.0, "latency_ms": 0}))
            .send()
            .await
            .expect("put");
        assert!(!faults.status().is_success(), "another process switches faults on, on port {port}");
    }
    assert_eq!(create(&lb.url, ALICE, "sim-2").await.status, StatusCode::CREATED, "no fault was switched on");
}

#[test]
fn the_standalone_simulator_says_it_is_for_tests() {
    let out = Command::new(BIN).args(["hypervisor-sim", "--help"]).output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.to_lowercase().contains("for tests"), "{text}");
    assert!(text.contains("no authentication"), "{text}");
}

// Shutdown drains detached handlers (issue 12, item 4).

#[tokio::test]
async fn sigterm_waits_for_a_handler_whose_client_hung_up_and_a_retry_after_restart_replays() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sqlite_url(&dir);
    // Long enough for a busy machine to see the request in progress before it ends.
    let mut lb = serve(&db, &["--sim-latency-ms", "8000", "--hypervisor-timeout", "59s", "--hypervisor-settle", "60s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4}).to_string();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /v1/workers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\n\
         Idempotency-Key: drain-1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.expect("send");
    // Wait until the request is inside its handler (it has allocated a node, before the slow
    // boot), without sending the key ourselves; then a retry is answered 409 in progress.
    let deadline = Instant::now() + Duration::from_secs(60);
    while fleet(&lb.url).await["nodes_allocated"].as_i64() != Some(1) {
        assert!(Instant::now() < deadline, "the first request never reached its handler");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = create(&lb.url, ALICE, "drain-1").await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text());
    assert_eq!(r.problem_type(), "request-in-progress");
    drop(sock);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(lb.sigterm_and_wait(), Some(0));
    drop(lb);

    let lb = serve(&db, &[]);
    let r = create(&lb.url, ALICE, "drain-1").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(r.headers.get("idempotent-replayed").map(|v| v.to_str().unwrap_or("")), Some("true"));
    let f = fleet(&lb.url).await;
    assert_eq!(f["workers_active"].as_i64(), Some(1), "{f}");
}

/// The create operation `i` of alice, as the effect ledger knows it, and an attempt of it.
fn create_attempt(domain: &leasebroker::domain::Domain, i: usize) -> idempotency_effects::Attempt {
    use idempotency::{ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, Scope};
    let now = idempotency::now();
    let key = IdempotencyKey::try_from(format!("k-{i}").as_str()).expect("key");
    let scope = Scope::new(Principal::new("alice"), Endpoint::new("POST", "/v1/workers"), key);
    let fingerprint = Fingerprint::from_stored("sha256:");
    let mut record =
        ClaimRequest { scope, fingerprint, now, in_flight_ttl: std::time::Duration::ZERO, expires_at: now }
            .new_record();
    record.record_id = idempotency::RecordId::from_hex(&format!("{i:032x}")).expect("record id");
    idempotency_effects::Effects::new(domain.ledger()).attempt(&idempotency_effects::Operation::of(&record, "create"))
}

/// The boot effect of a hypervisor nobody calls (the domain steps only record intents).
fn idle_boot() -> leasebroker::service::Boot {
    let hypervisor =
        leasebroker::hypervisor::client::HypervisorClient::new("http://127.0.0.1:9", Duration::from_secs(1))
            .expect("client");
    leasebroker::service::Boot { hypervisor }
}

/// The quota check at the domain level, with no HTTP in between: 64 allocations for one principal
/// race on one database through two pools (two "replicas").
async fn concurrent_allocations_case(url: &str) {
    use leasebroker::db::Db;
    use leasebroker::domain::{Allocation, Domain};
    let first = Db::connect(url).await.expect("connect");
    first.migrate().await.expect("migrate");
    let domains = [Domain::new(first), Domain::new(Db::connect(url).await.expect("connect"))];
    domains[0].seed_nodes(200, 64, 512).await.expect("seed");
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let domain = domains[i % 2].clone();
            let attempt = create_attempt(&domain, i);
            tokio::spawn(async move {
                attempt.decide(&idle_boot()).await.expect("the attempt begins");
                let alice = idempotency::Principal::new("alice");
                domain.allocate_within(&format!("alloc-{i}"), &alice, 0, 5, attempt.operation().id()).await
            })
        })
        .collect();
    let mut nodes = 0;
    for task in tasks {
        match task.await.expect("task").expect("allocate") {
            Allocation::Node(_) => nodes += 1,
            Allocation::QuotaExceeded => {}
            Allocation::Exhausted => panic!("200 nodes cannot run out"),
        }
    }
    assert_eq!(nodes, 5);
    assert_eq!(domains[0].counts().await.expect("counts").nodes_allocated, 5);
}

#[tokio::test]
async fn concurrent_allocations_never_overshoot_the_quota_on_postgres() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    concurrent_allocations_case(pg.url()).await;
}

#[tokio::test]
async fn concurrent_allocations_never_overshoot_the_quota_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    concurrent_allocations_case(&sqlite_url(&dir)).await;
}

/// A create's first commit (attempt, intent, node, lease in one transaction) keeps the quota:
/// 64 creates of one principal race through two pools, and exactly 5 hold a node and a lease.
/// A second start of one of them finds what the first did, intent and send stamp included.
async fn concurrent_create_starts_case(url: &str) {
    use idempotency_effects::{Decided, IntentState};
    use leasebroker::db::Db;
    use leasebroker::domain::{Allocation, CreateStart, Domain, DomainError, StartCreate};
    let first = Db::connect(url).await.expect("connect");
    first.migrate().await.expect("migrate");
    let domains = [Domain::new(first), Domain::new(Db::connect(url).await.expect("connect"))];
    domains[0].seed_nodes(200, 64, 512).await.expect("seed");
    let start = |domain: Domain, i: usize| async move {
        let attempt = create_attempt(&domain, i);
        let (alloc, lease) = (format!("alloc-{i}"), format!("lse-{i}"));
        let (alice, none) = (idempotency::Principal::new("alice"), "wkr-none".parse().expect("id"));
        let s = StartCreate {
            attempt: &attempt,
            boot: &idle_boot(),
            principal: &alice,
            alloc_id: &alloc,
            lease_id: &lease,
            worker_id: &none,
            quota: 5,
            now: 10,
        };
        domain.start_create(s).await
    };
    let before = idempotency::now().timestamp_micros();
    let tasks: Vec<_> = (0..64).map(|i| tokio::spawn(start(domains[i % 2].clone(), i))).collect();
    let mut held = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        match task.await.expect("task").expect("start") {
            CreateStart::Held { node, decided: Decided::Fresh(intent) } => {
                assert_eq!(intent.state, IntentState::Pending);
                assert!(intent.sent_at > before, "the send stamp is taken ahead of the clock");
                held.push((i, node, intent.sent_at));
            }
            CreateStart::Held { decided, .. } => panic!("the first start records the intent: {decided:?}"),
            CreateStart::Refused(Allocation::QuotaExceeded) => {}
            CreateStart::Refused(other) => panic!("200 nodes cannot run out: {other:?}"),
            CreateStart::Finished => panic!("nothing finished"),
        }
    }
    assert_eq!(held.len(), 5);
    let counts = domains[0].counts().await.expect("counts");
    assert_eq!((counts.nodes_allocated, counts.leases_active), (5, 5));

    // A retry of one that holds a node: the same node, the intent as recorded (not stamped again).
    let (i, node, stamp) = held[0].clone();
    match start(domains[1].clone(), i).await.expect("again") {
        CreateStart::Held { node: again, decided: Decided::Existing(intent) } => {
            assert_eq!(again, node);
            assert_eq!(intent.sent_at, stamp);
        }
        other => panic!("{other:?}"),
    }
    // Taken for a rollback: a start commits nothing more.
    let ledger = domains[0].ledger();
    let op_id = create_attempt(&domains[0], i).operation().id().to_owned();
    let row = ledger.operation(&op_id).await.expect("read").expect("the operation's row");
    assert!(ledger.take_for_rollback(&op_id, row.last_attempt_at).await.expect("mark"));
    assert!(matches!(start(domains[0].clone(), i).await, Err(DomainError::RolledBack)));
    assert_eq!(domains[0].counts().await.expect("counts").leases_active, 5);
}

#[tokio::test]
async fn concurrent_create_starts_never_overshoot_the_quota_on_postgres() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    concurrent_create_starts_case(pg.url()).await;
}

#[tokio::test]
async fn concurrent_create_starts_never_overshoot_the_quota_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    concurrent_create_starts_case(&sqlite_url(&dir)).await;
}

/// Allocation reads the free-node index (migration 0005), not every node: the plans of the
/// statements the service runs, on a pool of 20,000 nodes.
#[tokio::test]
async fn allocation_reads_the_free_node_index_on_sqlite() {
    use leasebroker::db::Db;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = Db::connect(&sqlite_url(&dir)).await.expect("connect");
    db.migrate().await.expect("migrate");
    leasebroker::domain::Domain::new(db.clone()).seed_nodes(20_000, 1, 1).await.expect("seed");
    let Db::Sqlite(pool) = &db else { panic!("sqlite") };
    for sql in [leasebroker::domain::ALLOCATE_SQLITE, leasebroker::domain::ALLOCATE_CAPPED_SQLITE] {
        let plan = explain_sqlite(pool, sql).await;
        assert!(plan.contains("USING INDEX lb_nodes_free"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "no sort of the free nodes: {plan}");
        assert!(!plan.contains("SCAN lb_nodes\n") && !plan.ends_with("SCAN lb_nodes"), "no full scan: {plan}");
    }
}

async fn explain_sqlite(pool: &sqlx::SqlitePool, sql: &str) -> String {
    use sqlx::Row;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
        .bind("a")
        .bind("alice")
        .bind(0_i64)
        .bind(5_i64)
        .fetch_all(pool)
        .await
        .expect("explain");
    rows.iter().map(|r| r.try_get::<String, _>(3).expect("detail")).collect::<Vec<_>>().join("\n")
}

#[tokio::test]
async fn allocation_reads_the_free_node_index_on_postgres() {
    use leasebroker::db::Db;
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let db = Db::connect(pg.url()).await.expect("connect");
    db.migrate().await.expect("migrate");
    leasebroker::domain::Domain::new(db.clone()).seed_nodes(20_000, 1, 1).await.expect("seed");
    let Db::Postgres(pool) = &db else { panic!("postgres") };
    sqlx::query("ANALYZE lb_nodes").execute(pool).await.expect("analyze");
    for sql in [leasebroker::domain::ALLOCATE_PG, leasebroker::domain::ALLOCATE_CAPPED_PG] {
        let q = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}"))).bind("a").bind("alice").bind(0_i64);
        let q = if sql.contains("$4") { q.bind(5_i64) } else { q };
        let plan: Vec<String> = q.fetch_all(pool).await.expect("explain");
        let plan = plan.join("\n");
        assert!(plan.contains("Index Scan using lb_nodes_free"), "{plan}");
        assert!(!plan.contains("Seq Scan"), "{plan}");
    }
}
