//! Issues 25 and 34, the stores' side of "safe in front of tenants": the longest scope the service
//! accepts fits PostgreSQL's index, a store that runs out of space answers `503` and makes
//! `/readyz` say so, and a store that stops answering (packets dropped, a locked file) is answered
//! `503 store-unavailable` within docs/protocol.md#running-leasebroker's 5 s on every route. Each test starts the real
//! `leasebroker` binary against a real database.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};

use crate::bounds::{ALICE, delete, http, send, serve};

/// `bytes` random hex characters: text that does not compress, so a database cannot squeeze it
/// under its index limit.
fn noise(bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 32);
    while s.len() < bytes {
        s.push_str(&idempotency::RecordId::random().to_hex());
    }
    s.truncate(bytes);
    s
}

// The longest scope.

/// The longest scope the service accepts (a path of exactly 2 KiB, a key of 128 characters, and
/// a principal of 1,500 characters from `--token`) is stored in PostgreSQL and replayed, and two
/// such paths that differ only in their last character are two records. Without the store's
/// shortening of long components, the primary key's index row is over PostgreSQL's btree limit
/// (2,704 bytes) and every such request answers `503`.
#[tokio::test]
async fn the_longest_scope_is_stored_in_postgres_and_replayed_and_paths_that_differ_at_the_end_are_two() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let (token, principal) = ("tok-long-principal-25a7c9e1", format!("team-{}", noise(1_500)));
    let lb = serve(pg.url(), &["--token", &format!("{token}={principal}"), "--rate-limit", "0"]);
    let client = http();
    let base = noise(2048 - "/v1/workers/".len() - 1);
    let key = format!("long-{}", noise(123));
    for last in ['a', 'b'] {
        let id = format!("{base}{last}");
        let first = delete(&client, &lb.url, token, &id, &key).await;
        assert_eq!((first.status, first.replayed()), (StatusCode::NOT_FOUND, false), "{last}: {}", first.text());
        let again = delete(&client, &lb.url, token, &id, &key).await;
        assert_eq!((again.status, again.replayed()), (StatusCode::NOT_FOUND, true), "{last}: {}", again.text());
    }
    let db = sqlx::PgPool::connect(pg.url()).await.expect("connect");
    let (rows, widest): (i64, Option<i32>) = sqlx::query_as(
        "SELECT count(*), max(octet_length(principal) + octet_length(endpoint) + octet_length(key))::int \
         FROM idempotency_records WHERE principal LIKE 'team-%'",
    )
    .fetch_one(&db)
    .await
    .expect("count");
    assert_eq!(rows, 2, "two paths that differ at the end are two records");
    assert!(
        widest.is_some_and(|w| w as usize <= 2 * idempotency::STORED_COMPONENT_MAX + 128),
        "the stored scope is bounded: {widest:?} bytes"
    );
    // What an operator reads: the method and the start of the path, then the hash of the whole.
    let endpoints: Vec<String> =
        sqlx::query_scalar("SELECT endpoint FROM idempotency_records WHERE principal LIKE 'team-%'")
            .fetch_all(&db)
            .await
            .expect("endpoints");
    for e in &endpoints {
        assert!(e.starts_with(&format!("DELETE /v1/workers/{}", &base[..900])), "{e:.80}");
        assert!(e.contains("...sha256:"), "{e:.80}");
    }
    db.close().await;
}

// A store out of space.

/// A small tmpfs mounted on a temporary directory (SQLite on it meets a real `ENOSPC`), unmounted
/// when dropped. Mounting needs root: without it the test is SKIPPED loudly (a failure under
/// `CI=true`).
struct TinyFs {
    dir: tempfile::TempDir,
}

impl TinyFs {
    fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Self { dir }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
                    Err(e) => e.to_string(),
                };
                assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "cannot mount a tmpfs ({why}), and CI=true");
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED: the full-disk test: cannot mount a small tmpfs (needs root): {why}"
                );
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the file system with `filler` until it refuses, then frees `leave` bytes of it.
    fn fill(&self, leave: u64) -> PathBuf {
        let filler = self.path().join("filler");
        let mut f = std::fs::File::create(&filler).expect("filler");
        let chunk = vec![0xa5u8; 64 << 10];
        let mut written = 0u64;
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("filling the file system: {e}"),
            }
        }
        f.set_len(written.saturating_sub(leave)).expect("free some");
        f.sync_all().expect("sync");
        filler
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// docs/protocol.md#leasebroker-api: "A store that refuses a write for lack of space answers `503` for that request only
/// and `/readyz` reports it." SQLite on a real tmpfs that fills up (`ENOSPC`, SQLite's
/// `SQLITE_FULL`): the request whose record cannot be written answers `503 store-unavailable`
/// with `Retry-After`, `/readyz` answers `503`, reads and replays still answer, and once space is
/// freed the next write succeeds and the service is ready again.
#[tokio::test]
async fn a_full_sqlite_file_system_answers_503_for_the_write_and_readyz_says_not_ready() {
    let Some(fs) = TinyFs::mount("16m") else { return };
    let db = format!("sqlite://{}", fs.path().join("lb.db").display());
    let lb = serve(&db, &["--rate-limit", "0", "--max-records-per-principal", "0"]);
    let client = http();
    let ready = |client: reqwest::Client, base: String| async move {
        client.get(format!("{base}/readyz")).send().await.expect("readyz").status()
    };
    assert_eq!(delete(&client, &lb.url, ALICE, "wkr-none", "before-full").await.status, StatusCode::NOT_FOUND);
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::OK);

    let filler = fs.fill(256 << 10);
    let id = noise(2000);
    let mut full = None;
    for i in 0..10_000 {
        let r = delete(&client, &lb.url, ALICE, &id, &format!("full-{i}")).await;
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            full = Some(r);
            break;
        }
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text());
    }
    let full = full.expect("the file system never filled up");
    assert_eq!(full.problem_type(), "store-unavailable", "{}", full.text());
    assert!(full.retry_after().is_some(), "{:?}", full.headers);
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::SERVICE_UNAVAILABLE, "readyz while full");
    // What needs no new record still answers: a read, and the replay of a stored key.
    let list = send(&client, Method::GET, &format!("{}/v1/workers", lb.url), Some(ALICE), None, None).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text());
    let replay = delete(&client, &lb.url, ALICE, "wkr-none", "before-full").await;
    assert_eq!((replay.status, replay.replayed()), (StatusCode::NOT_FOUND, true), "{}", replay.text());

    // Space freed: the next write succeeds, and the service is ready again.
    std::fs::remove_file(&filler).expect("free the space");
    let after = delete(&client, &lb.url, ALICE, "wkr-none", "after-free").await;
    assert_eq!(after.status, StatusCode::NOT_FOUND, "{}", after.text());
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::OK, "readyz once space is back");
}

/// The same on PostgreSQL (SQLSTATE `53100 disk_full`): a private server whose database keeps its
/// tables in a tablespace on a small tmpfs (`ALTER DATABASE ... SET default_tablespace`, so the
/// catalogs and the WAL stay on the big disk and only the tables fill up). The write that finds
/// no space answers `503 store-unavailable` with `Retry-After`, `/readyz` answers `503`, a replay
/// still answers, and once space is freed the next write succeeds and the service is ready again.
#[tokio::test]
async fn a_full_postgres_tablespace_answers_503_for_the_write_and_readyz_says_not_ready() {
    use sqlx::Connection;
    let Some(fs) = TinyFs::mount("16m") else { return };
    let Some(server) = testkit::postgres::LocalServer::start() else { return };
    // The server runs as `postgres` when the test runs as root: the tablespace must be its own.
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    if let (Some(uid), Some(gid)) = (id("-u"), id("-g")) {
        std::os::unix::fs::chown(fs.path(), Some(uid), Some(gid)).expect("chown the tablespace");
    }
    let mut admin = sqlx::PgConnection::connect(&server.url("postgres")).await.expect("connect");
    for sql in [
        format!("CREATE TABLESPACE tiny LOCATION '{}'", fs.path().display()),
        "CREATE DATABASE lb".to_owned(),
        "ALTER DATABASE lb SET default_tablespace = tiny".to_owned(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    admin.close().await.expect("close");
    let lb = serve(&server.url("lb"), &["--rate-limit", "0", "--max-records-per-principal", "0"]);
    let client = http();
    let ready = |client: reqwest::Client, base: String| async move {
        client.get(format!("{base}/readyz")).send().await.expect("readyz").status()
    };
    assert_eq!(delete(&client, &lb.url, ALICE, "wkr-none", "before-full").await.status, StatusCode::NOT_FOUND);
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::OK);

    let filler = fs.fill(256 << 10);
    let id = noise(2000);
    let mut full = None;
    for i in 0..10_000 {
        let r = delete(&client, &lb.url, ALICE, &id, &format!("full-{i}")).await;
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            full = Some(r);
            break;
        }
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{}", r.text());
    }
    let full = full.expect("the tablespace never filled up");
    assert_eq!(full.problem_type(), "store-unavailable", "{}", full.text());
    assert!(full.retry_after().is_some(), "{:?}", full.headers);
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::SERVICE_UNAVAILABLE, "readyz while full");
    let replay = delete(&client, &lb.url, ALICE, "wkr-none", "before-full").await;
    assert_eq!((replay.status, replay.replayed()), (StatusCode::NOT_FOUND, true), "{}", replay.text());

    std::fs::remove_file(&filler).expect("free the space");
    let after = delete(&client, &lb.url, ALICE, "wkr-none", "after-free").await;
    assert_eq!(after.status, StatusCode::NOT_FOUND, "{}", after.text());
    assert_eq!(ready(client.clone(), lb.url.clone()).await, StatusCode::OK, "readyz once space is back");
    drop(lb);
    drop(server);
}

// Within 5 s, on every route.

/// A TCP proxy in front of PostgreSQL that can be paused: while paused it accepts connections
/// but forwards nothing in either direction and closes nothing, as a network partition that
/// drops packets does (not one that refuses them). Resumed, the bytes held back flow on, as TCP
/// retransmits them when a partition heals.
struct Partition {
    port: u16,
    paused: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Partition {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (paused, watch) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else { return };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pump(cr, sw, watch.clone()), pump(sr, cw, watch));
                });
            }
        });
        Self { port, paused, task }
    }

    fn pause(&self) {
        self.paused.send_replace(true);
    }

    fn resume(&self) {
        self.paused.send_replace(false);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, reading nothing while paused.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 << 10];
    loop {
        if paused.wait_for(|p| !p).await.is_err() {
            return;
        }
        let n = tokio::select! {
            n = from.read(&mut buf) => match n { Ok(0) | Err(_) => return, Ok(n) => n },
            // Paused while waiting for bytes: stop reading.
            _ = paused.wait_for(|p| *p) => continue,
        };
        // Bytes read just before a pause are held until it ends.
        if paused.wait_for(|p| !p).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A request: its name, method, URL, token, key and JSON body.
type Route = (String, Method, String, Option<&'static str>, Option<String>, Option<serde_json::Value>);

/// One request on every route that reads or writes the store, all at once; each answer and how
/// long it took.
async fn every_route(base: &str, worker: &str, round: &str) -> Vec<(String, crate::bounds::Reply, Duration)> {
    let client = http();
    let body = serde_json::json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    let routes: Vec<Route> = vec![
        (
            "create".into(),
            Method::POST,
            format!("{base}/v1/workers"),
            Some(ALICE),
            Some(format!("create-{round}")),
            Some(body),
        ),
        ("get".into(), Method::GET, format!("{base}/v1/workers/{worker}"), Some(ALICE), None, None),
        ("list".into(), Method::GET, format!("{base}/v1/workers"), Some(ALICE), None, None),
        (
            "reboot".into(),
            Method::POST,
            format!("{base}/v1/workers/{worker}/reboot"),
            Some(ALICE),
            Some(format!("reboot-{round}")),
            None,
        ),
        (
            "delete".into(),
            Method::DELETE,
            format!("{base}/v1/workers/wkr-none"),
            Some(ALICE),
            Some(format!("delete-{round}")),
            None,
        ),
        ("fleet".into(), Method::GET, format!("{base}/admin/v1/fleet"), Some(crate::bounds::ADMIN), None, None),
        ("readyz".into(), Method::GET, format!("{base}/readyz"), None, None, None),
    ];
    let tasks: Vec<_> = routes
        .into_iter()
        .map(|(name, method, url, token, key, body)| {
            let client = client.clone();
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let r = send(&client, method, &url, token, key.as_deref(), body.as_ref()).await;
                (name, r, started.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

/// Creates a worker with `key` and returns its id.
async fn create_worker(base: &str, key: &str) -> crate::bounds::Reply {
    let body = serde_json::json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    send(&http(), Method::POST, &format!("{base}/v1/workers"), Some(ALICE), Some(key), Some(&body)).await
}

/// Retries a create with `key` until it answers 201 (the retry of a request an outage cut),
/// for at most `within`; how long it took.
async fn retry_until_created(base: &str, key: &str, within: Duration) -> Duration {
    let started = std::time::Instant::now();
    loop {
        let r = create_worker(base, key).await;
        if r.status == StatusCode::CREATED {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "the retry of {key} still answers {} after {within:?}: {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// docs/protocol.md#running-leasebroker: "With the database unreachable, requests get `503` problems promptly (within 5 s;
/// problem `store-unavailable`, with `Retry-After`, one name for every route)". PostgreSQL behind
/// a partition that drops packets (the proxy stops forwarding, closes nothing): every route,
/// `/readyz` included, answers `503 store-unavailable` with `Retry-After` in under 5 s (the
/// protocol's bound, measured per request). When the partition heals, the create that was cut
/// resumes within seconds (not after `--in-flight-ttl`, 5 minutes), and it booted one VM.
// Multi-threaded: the proxy's tasks run while `serve` blocks this thread waiting for the binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_partition_that_drops_packets_is_answered_503_within_5_s_on_every_route() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let proxy = Partition::start("127.0.0.1:5432".parse().expect("addr")).await;
    let url = format!("postgres://postgres@127.0.0.1:{}/{}", proxy.port, pg.name());
    let lb = serve(&url, &["--rate-limit", "0"]);
    let created = create_worker(&lb.url, "before").await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let worker = serde_json::from_slice::<serde_json::Value>(&created.body).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();

    proxy.pause();
    for (name, r, took) in every_route(&lb.url, &worker, "cut").await {
        eprintln!("{name}: {} in {took:?}", r.status);
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{name} after {took:?}: {}", r.text());
        assert_eq!(r.problem_type(), "store-unavailable", "{name}: {}", r.text());
        assert!(r.retry_after().is_some(), "{name}: no Retry-After: {:?}", r.headers);
        assert!(
            took < Duration::from_secs(5),
            "{name} answered after {took:?}, docs/protocol.md#running-leasebroker says within 5 s"
        );
    }

    proxy.resume();
    let took = retry_until_created(&lb.url, "create-cut", Duration::from_secs(60)).await;
    eprintln!("the cut create was created on a retry {took:?} after the store returned");
    assert!(took < Duration::from_secs(30), "the cut create resumed after {took:?}, not within seconds");
    let fleet =
        send(&http(), Method::GET, &format!("{}/admin/v1/fleet", lb.url), Some(crate::bounds::ADMIN), None, None).await;
    let boots = serde_json::from_slice::<serde_json::Value>(&fleet.body).expect("fleet")["vm_boots_total"].as_i64();
    assert_eq!(boots, Some(2), "one VM per created worker: {}", fleet.text());
}

/// The same for SQLite, locked by another process (a writer that holds the write lock, as a
/// backup or a hand-run `sqlite3` session can): every route answers within 5 s; every write is
/// `503 store-unavailable` with `Retry-After` (a read may still be served: WAL lets readers
/// through a writer's lock). Unlocked, the cut create resumes at once, with one VM.
#[tokio::test]
async fn a_locked_sqlite_database_is_answered_503_within_5_s_on_every_route() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}", dir.path().join("lb.db").display());
    let lb = serve(&db, &["--rate-limit", "0"]);
    let created = create_worker(&lb.url, "before").await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let worker = serde_json::from_slice::<serde_json::Value>(&created.body).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();

    let mut locker = sqlx::SqliteConnection::connect(&db).await.expect("open");
    sqlx::query("BEGIN IMMEDIATE").execute(&mut locker).await.expect("take the write lock");
    for (name, r, took) in every_route(&lb.url, &worker, "cut").await {
        eprintln!("{name}: {} in {took:?}", r.status);
        assert!(
            took < Duration::from_secs(5),
            "{name} answered after {took:?}, docs/protocol.md#running-leasebroker says within 5 s"
        );
        let write = matches!(name.as_str(), "create" | "reboot" | "delete");
        if write || r.status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{name} after {took:?}: {}", r.text());
            assert_eq!(r.problem_type(), "store-unavailable", "{name}: {}", r.text());
            assert!(r.retry_after().is_some(), "{name}: no Retry-After: {:?}", r.headers);
        } else {
            assert_eq!(r.status, StatusCode::OK, "{name}: {}", r.text());
        }
    }

    sqlx::query("ROLLBACK").execute(&mut locker).await.expect("release the lock");
    locker.close().await.expect("close");
    let took = retry_until_created(&lb.url, "create-cut", Duration::from_secs(60)).await;
    eprintln!("the cut create was created on a retry {took:?} after the store returned");
    assert!(took < Duration::from_secs(30), "the cut create resumed after {took:?}, not within seconds");
    let fleet =
        send(&http(), Method::GET, &format!("{}/admin/v1/fleet", lb.url), Some(crate::bounds::ADMIN), None, None).await;
    let boots = serde_json::from_slice::<serde_json::Value>(&fleet.body).expect("fleet")["vm_boots_total"].as_i64();
    assert_eq!(boots, Some(2), "one VM per created worker: {}", fleet.text());
}
