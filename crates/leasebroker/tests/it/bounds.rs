//! Issue 25, "safe in front of tenants, round 2": black-box tests of the per-tenant bounds (path
//! length, rate limit, records per principal, a full store), the connection limits (how many,
//! HTTP/2 without streams, the whole body's deadline), file modes and flashing a held node. Each
//! starts the real `leasebroker` binary.
//!
//! `LEASEBROKER_BIN` runs them against another build of the binary (for example the
//! one before a fix, to see a test fail); by default they run the one this test build made.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{Launch, Proc, bin, sqlite_url};
pub(crate) use testkit::tokens::{ADMIN, ALICE, BOB};

/// Starts `leasebroker serve` on a free port with the test tokens, a pool of 8 nodes unless
/// `extra` sets `--pool-nodes`, and `extra`.
pub(crate) fn serve(db: &str, extra: &[&str]) -> Proc {
    Launch::serve(db, &testkit::leasebroker::with_pool_nodes("8", extra)).start()
}

/// The idempotency records in the service's SQLite file.
async fn records_in(dir: &tempfile::TempDir) -> i64 {
    let url = format!("{}?mode=ro", sqlite_url(dir));
    let pool = sqlx::SqlitePool::connect(&url).await.expect("open the database");
    let n = sqlx::query_scalar("SELECT count(*) FROM idempotency_records").fetch_one(&pool).await.expect("count");
    pool.close().await;
    n
}

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub(crate) fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned()
    }
    pub(crate) fn retry_after(&self) -> Option<u64> {
        self.headers.get("retry-after")?.to_str().ok()?.parse().ok()
    }
    pub(crate) fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }
}

pub(crate) async fn send(
    client: &reqwest::Client,
    method: Method,
    url: &str,
    token: Option<&str>,
    key: Option<&str>,
    body: Option<&Value>,
) -> Reply {
    let mut req = client.request(method, url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b.to_string());
    }
    let resp = req.send().await.expect("request");
    Reply { status: resp.status(), headers: resp.headers().clone(), body: resp.bytes().await.expect("body").to_vec() }
}

pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client")
}

/// `DELETE /v1/workers/{id}` with `key`: a 404 for an id that does not exist, stored like any
/// terminal answer. The cheapest request that creates a record.
pub(crate) async fn delete(client: &reqwest::Client, base: &str, token: &str, id: &str, key: &str) -> Reply {
    send(client, Method::DELETE, &format!("{base}/v1/workers/{id}"), Some(token), Some(key), None).await
}

// Bounded per tenant.

#[tokio::test]
async fn a_path_over_2_kib_answers_414_before_anything_else_and_stores_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let client = http();
    let long = "x".repeat(2100);
    for i in 0..5 {
        let r = delete(&client, &lb.url, ALICE, &long, &format!("long-{i}")).await;
        assert_eq!(r.status, StatusCode::URI_TOO_LONG, "{}", r.text());
        assert_eq!(r.problem_type(), "uri-too-long", "{}", r.text());
        assert!(r.body.len() < 400, "the answer is short: {}", r.text());
    }
    // Checked before any other limit: before authentication, and before the body limit.
    let r = send(&client, Method::DELETE, &format!("{}/v1/workers/{long}", lb.url), None, None, None).await;
    assert_eq!(r.status, StatusCode::URI_TOO_LONG, "{}", r.text());
    // The server answers without reading the 2 MiB body and closes the connection: read the
    // answer while the body is still being written (reqwest reads only once it has written the
    // whole body, and under load met the closed connection with a broken pipe, the answer lost).
    let (status, answer) = answer_before_the_body(&lb.url, &format!("/v1/{long}"), 2 << 20).await;
    assert_eq!(status, 414, "{answer}");
    assert!(answer.contains("uri-too-long"), "{answer}");
    // A path of exactly 2 KiB is taken: a 404 for a worker that does not exist, stored. On a
    // client of its own: the server answered the 2 MiB upload above without reading it and closes
    // that connection, which the first client's pool may otherwise hand out again (a race seen
    // under load as `IncompleteMessage`).
    let at_limit = "y".repeat(2048 - "/v1/workers/".len());
    let r = delete(&http(), &lb.url, ALICE, &at_limit, "at-limit").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text());
    assert_eq!(records_in(&dir).await, 1, "only the request within the limit left a record");
}

#[tokio::test]
async fn the_rate_limit_is_on_by_default_and_a_refused_request_stores_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Defaults: 50 mutating requests a second per principal, a burst of 100.
    let lb = serve(&sqlite_url(&dir), &[]);
    let client = http();
    // Mutating requests without a key pass the rate limit and are refused by the layer (400),
    // which stores nothing and is fast: 400 of them from 16 tasks outrun the budget whatever the
    // machine's load, since only 100 + 50 a second pass.
    let started = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (client, url) = (client.clone(), format!("{}/v1/workers/wkr-none", lb.url));
            tokio::spawn(async move {
                let mut got = Vec::new();
                for _ in 0..25 {
                    got.push(send(&client, Method::DELETE, &url, Some(ALICE), None, None).await);
                }
                got
            })
        })
        .collect();
    let mut passed = 0u64;
    let mut limited = 0u64;
    for t in tasks {
        for r in t.await.expect("task") {
            match r.status {
                StatusCode::BAD_REQUEST => passed += 1,
                StatusCode::TOO_MANY_REQUESTS => {
                    limited += 1;
                    assert_eq!(r.problem_type(), "too-many-requests", "{}", r.text());
                    assert!(r.retry_after().is_some_and(|s| s >= 1), "{:?}", r.headers);
                }
                other => panic!("unexpected {other}: {}", r.text()),
            }
        }
    }
    let secs = started.elapsed().as_secs() + 1;
    assert!(passed <= 100 + 50 * secs, "{passed} passed in about {secs} s");
    assert!(limited >= 400 - 100 - 50 * secs.min(6), "{limited} limited, {passed} passed in about {secs} s");

    // A keyed request refused by the limit is not stored: after Retry-After it runs afresh. The
    // budget is spent, so of 40 sent at once nearly all are refused.
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let (client, base) = (client.clone(), lb.url.clone());
            tokio::spawn(async move {
                let key = format!("rl-{i}");
                let r = delete(&client, &base, ALICE, "wkr-none", &key).await;
                (key, r)
            })
        })
        .collect();
    let mut refused = None;
    for t in tasks {
        let (key, r) = t.await.expect("task");
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            refused = Some((key, r.retry_after().expect("Retry-After")));
        }
    }
    let (key, wait) = refused.expect("no keyed request was refused after the budget was spent");
    // Bob has a budget of his own.
    assert_eq!(delete(&client, &lb.url, BOB, "wkr-none", "bob-1").await.status, StatusCode::NOT_FOUND);
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = loop {
        let r = delete(&client, &lb.url, ALICE, "wkr-none", &key).await;
        if r.status != StatusCode::TOO_MANY_REQUESTS || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(again.status, StatusCode::NOT_FOUND, "{}", again.text());
    assert!(!again.replayed(), "the refused request had stored an answer");
}

#[tokio::test]
async fn a_principal_at_its_record_limit_gets_429_and_its_own_keys_still_replay() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--max-records-per-principal", "5", "--rate-limit", "0"]);
    let client = http();
    // 32 new keys at once: exactly 5 are stored, every other one is refused with 429.
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (client, base) = (client.clone(), lb.url.clone());
            tokio::spawn(async move { (i, delete(&client, &base, ALICE, "wkr-none", &format!("rec-{i}")).await) })
        })
        .collect();
    let mut stored = Vec::new();
    for t in tasks {
        let (i, r) = t.await.expect("task");
        match r.status {
            StatusCode::NOT_FOUND => stored.push(i),
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(r.problem_type(), "too-many-requests", "{}", r.text());
                assert!(r.retry_after().is_some_and(|s| s >= 1), "{:?}", r.headers);
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(stored.len(), 5, "stored: {stored:?}");
    assert_eq!(records_in(&dir).await, 5, "exactly five records");
    // Its own keys still answer (a replay of the stored 404), another new key does not.
    let again = delete(&client, &lb.url, ALICE, "wkr-none", &format!("rec-{}", stored[0])).await;
    assert_eq!((again.status, again.replayed()), (StatusCode::NOT_FOUND, true), "{}", again.text());
    assert_eq!(delete(&client, &lb.url, ALICE, "wkr-none", "rec-new").await.status, StatusCode::TOO_MANY_REQUESTS);
    // Another principal is not touched by alice's limit.
    assert_eq!(delete(&client, &lb.url, BOB, "wkr-none", "bob-1").await.status, StatusCode::NOT_FOUND);
    assert_eq!(records_in(&dir).await, 6);
}

#[tokio::test]
async fn a_redis_out_of_memory_answers_503_per_request_and_readyz_says_not_ready() {
    if !testkit::redis::have_redis_binaries() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
        eprintln!("SKIPPED: the Redis out-of-memory test: redis-server or redis-cli is not installed");
        return;
    }
    let redis_dir = tempfile::tempdir().expect("tempdir");
    let node =
        testkit::redis::start_server(redis_dir.path(), &["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(
        &sqlite_url(&dir),
        &["--record-store", &node.url(), "--rate-limit", "0", "--max-records-per-principal", "0"],
    );
    let client = http();
    assert_eq!(client.get(format!("{}/readyz", lb.url)).send().await.expect("readyz").status(), StatusCode::OK);
    // Records of about 2 KiB each (the longest path allowed) until Redis refuses writes.
    let id = "z".repeat(2000);
    let mut full = None;
    for i in 0..20_000 {
        let r = delete(&client, &lb.url, ALICE, &id, &format!("oom-{i}")).await;
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            full = Some(r);
            break;
        }
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text());
    }
    let full = full.expect("Redis never filled up");
    assert_eq!(full.problem_type(), "store-unavailable", "{}", full.text());
    assert!(full.retry_after().is_some(), "{:?}", full.headers);
    assert!(!full.text().to_lowercase().contains("oom"), "no driver text reaches the client: {}", full.text());
    // Readiness says so, without the driver's text.
    let ready = client.get(format!("{}/readyz", lb.url)).send().await.expect("readyz");
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(!ready.text().await.expect("body").to_lowercase().contains("oom"));
    // The process still answers what needs no new record: reads, and a replay of a stored key.
    let list = send(&client, Method::GET, &format!("{}/v1/workers", lb.url), Some(BOB), None, None).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text());
    let replay = delete(&client, &lb.url, ALICE, &id, "oom-0").await;
    assert_eq!((replay.status, replay.replayed()), (StatusCode::NOT_FOUND, true), "{}", replay.text());
    // Space freed: the next write succeeds, and the store is ready again.
    let mut conn = node.connection();
    let _: () = redis::cmd("FLUSHALL").query(&mut conn).expect("flushall");
    assert_eq!(delete(&client, &lb.url, ALICE, "wkr-none", "after-flush").await.status, StatusCode::NOT_FOUND);
    let ready = client.get(format!("{}/readyz", lb.url)).send().await.expect("readyz");
    assert_eq!(ready.status(), StatusCode::OK);
}

// Connections.

/// Reads until the server closes the socket (EOF or reset), up to `within`. Returns what it read,
/// or `None` when it was still open.
/// POSTs a body of `len` bytes to `path` as Alice on a raw connection, writing the body in a
/// task of its own while the answer is read: the status and the raw answer, however early the
/// server answers and closes.
async fn answer_before_the_body(base: &str, path: &str, len: usize) -> (u16, String) {
    let addr = base.trim_start_matches("http://").to_owned();
    let sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let (mut read, mut write) = sock.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\nIdempotency-Key: k\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    );
    let writer = tokio::spawn(async move {
        write.write_all(head.as_bytes()).await?;
        write.write_all(&vec![b' '; len]).await
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(30), read.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
        }
    }
    writer.abort();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, answer)
}

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
async fn connections_beyond_max_connections_are_closed_at_accept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--max-connections", "4", "--header-timeout", "120s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.expect("connect");
        // A request answered on each proves the server took it (and is still holding it).
        s.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await.expect("write");
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
        held.push(s);
    }
    // The fifth is closed without an answer.
    let mut fifth = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let _ = fifth.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await;
    let got = read_until_closed(&mut fifth, Duration::from_secs(30)).await.expect("the fifth connection stayed open");
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    // One closed, and a new one is served again.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = http().get(format!("{}/healthz", lb.url)).send().await
            && r.status() == StatusCode::OK
        {
            break;
        }
        assert!(Instant::now() < deadline, "no connection was served after one was freed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// HTTP/2 frames by hand: the client preface and SETTINGS, a SETTINGS ACK, and PINGs.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
fn h2_frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("len").to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, 0];
    f.extend_from_slice(payload);
    f
}

#[tokio::test]
async fn an_http2_connection_without_streams_gets_goaway_however_often_it_pings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--header-timeout", "1s", "--idle-timeout", "120s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    sock.write_all(H2_PREFACE).await.expect("preface");
    sock.write_all(&h2_frame(0x4, 0, &[])).await.expect("settings");
    sock.write_all(&h2_frame(0x4, 0x1, &[])).await.expect("settings ack");
    // PING every 100 ms, reading what the server sends, for up to 30 s.
    let started = Instant::now();
    let mut received = Vec::new();
    let mut closed = false;
    let mut buf = [0u8; 4096];
    while started.elapsed() < Duration::from_secs(30) {
        if sock.write_all(&h2_frame(0x6, 0, b"pingpong")).await.is_err() {
            closed = true;
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), sock.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    assert!(closed, "a connection kept alive by PINGs alone was still open after 30 s");
    // Walk the frames the server sent: a GOAWAY (type 7) among them.
    let (mut at, mut goaway) = (0, false);
    while at + 9 <= received.len() {
        let len = usize::from(received[at]) << 16 | usize::from(received[at + 1]) << 8 | usize::from(received[at + 2]);
        goaway |= received[at + 3] == 0x7;
        at += 9 + len;
    }
    assert!(goaway, "closed without a GOAWAY: {received:?}");
}

#[tokio::test]
async fn a_body_that_drips_past_the_body_timeout_gets_408_and_stores_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Each byte arrives well within the idle timeout; the whole body does not arrive in 2 s.
    let lb = serve(&sqlite_url(&dir), &["--body-timeout", "2s", "--idle-timeout", "60s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let body = format!("{:<100}", json!({"image": "i", "cpu": 1, "memory_gb": 1}));
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /v1/workers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\nIdempotency-Key: drip-1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.expect("head");
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    'drip: for b in body.as_bytes() {
        if sock.write_all(&[*b]).await.is_err() {
            break;
        }
        // Every 300 ms a byte; stop at the first answer.
        match tokio::time::timeout(Duration::from_millis(300), sock.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break 'drip,
            Ok(Ok(n)) => {
                answer.extend_from_slice(&buf[..n]);
                break 'drip;
            }
            Err(_) => {}
        }
    }
    if answer.is_empty() {
        answer = read_until_closed(&mut sock, Duration::from_secs(10)).await.unwrap_or_default();
    }
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(answer.starts_with("HTTP/1.1 408"), "after {:?}: {answer:?}", started.elapsed());
    assert!(answer.contains("body-timeout"), "{answer}");
    // Not stored: the same key runs when sent whole.
    let r = send(
        &http(),
        Method::POST,
        &format!("{}/v1/workers", lb.url),
        Some(ALICE),
        Some("drip-1"),
        Some(&json!(
            {"image": "i", "cpu": 1, "memory_gb": 1}
        )),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
}

#[tokio::test]
async fn a_stalled_body_is_refused_without_the_reader_s_error_text() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--idle-timeout", "1s"]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /v1/workers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\nIdempotency-Key: stall-1\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"image\""
    );
    sock.write_all(head.as_bytes()).await.expect("head");
    let answer = read_until_closed(&mut sock, Duration::from_secs(30)).await.expect("still open after 30 s");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("body-unreadable"), "{answer}");
    let detail = answer.split("\"detail\":\"").nth(1).unwrap_or_default().split('"').next().unwrap_or_default();
    for leak in ["failed:", "error", "timed out", "hyper"] {
        assert!(!detail.to_lowercase().contains(leak), "the detail carries an error string: {detail}");
    }
}

// Files.

#[cfg(unix)]
#[test]
fn an_existing_database_readable_by_others_is_refused_in_one_line() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("lb.db");
    std::fs::write(&file, b"").expect("create");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let db = sqlite_url(&dir);
    let mut child = Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &db, "--token", &format!("{ALICE}=alice")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    // It must exit by itself; one still serving after a minute started on the exposed file.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("it started on a 0644 database and is serving");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    assert!(!status.success(), "it exited 0 on a 0644 database: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(&file.display().to_string()) && stderr.contains("chmod 600"), "{stderr}");
    // Made private, it starts.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    drop(serve(&db, &[]));
}

// Flashing a node a worker holds.

#[tokio::test]
async fn flashing_a_node_a_worker_holds_is_409_unless_forced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--sim-flash-ms", "100"]);
    let client = http();
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    let w = send(&client, Method::POST, &format!("{}/v1/workers", lb.url), Some(ALICE), Some("w-1"), Some(&body)).await;
    assert_eq!(w.status, StatusCode::CREATED, "{}", w.text());
    let node = w.json()["node_id"].as_str().expect("node_id").to_owned();
    let flash = |key: &'static str, body: Value| {
        let (client, url) = (client.clone(), format!("{}/admin/v1/nodes/{node}/firmware", lb.url));
        async move { send(&client, Method::POST, &url, Some(ADMIN), Some(key), Some(&body)).await }
    };
    let refused = flash("f-1", json!({"version": "2.4.1"})).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.text());
    assert_eq!(refused.problem_type(), "node-in-use", "{}", refused.text());
    let fleet = send(&client, Method::GET, &format!("{}/admin/v1/fleet", lb.url), Some(ADMIN), None, None).await;
    assert_eq!(fleet.json()["firmware_flashes_total"].as_i64(), Some(0), "{}", fleet.text());
    let forced = flash("f-2", json!({"version": "2.4.1", "force": true})).await;
    assert_eq!(forced.status, StatusCode::ACCEPTED, "{}", forced.text());
    // A node nobody holds flashes without force.
    let free = if node == "node-0001" { "node-0002" } else { "node-0001" };
    let url = format!("{}/admin/v1/nodes/{free}/firmware", lb.url);
    let r = send(&client, Method::POST, &url, Some(ADMIN), Some("f-3"), Some(&json!({"version": "2.4.1"}))).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", r.text());
}
