//! Issue 34 (docs/protocol.md#running-leasebroker): through a database outage and a failover, on PostgreSQL servers of the
//! test's own ([`LocalServer`]: initdb, pg_ctl and pg_basebackup on free ports, removed after).
//!
//! - creates cut by the outage are released as soon as the database is back, with the default
//!   in-flight TTL (5 minutes): every retry resumes within seconds, one VM per key; the same with
//!   the records on a Redis server (append-only file) that is killed and started again;
//! - every `503` the outage causes is `store-unavailable` with `Retry-After`, on every route;
//! - a libpq multi-host URL follows the primary across a failover, in the same process;
//! - the service's sessions keep the database's `synchronous_commit`.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;
use sqlx::Connection;
use testkit::postgres::LocalServer;

use super::database::readyz;
use crate::support::*;

/// A `503` of a store outage: the one problem type, with `Retry-After`.
fn assert_store_unavailable(what: &str, r: &Reply) {
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem_type(), "store-unavailable", "{what}: {}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["content-type"], "application/problem+json", "{what}");
    let secs: u64 =
        r.headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(secs >= 1, "{what}: a 503 says when to retry");
}

/// How many records of `keys` are in flight, read from the database itself.
async fn in_flight(url: &str, keys: &[String]) -> i64 {
    let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
    let n = sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE state = 'in_flight' AND key = ANY($1)")
        .bind(keys)
        .fetch_one(&mut conn)
        .await
        .expect("count");
    let _ = conn.close().await;
    n
}

/// Retries a create until it is answered with something other than `409 request-in-progress` or
/// `503`; returns the answer and whether a `409` came first.
async fn retry_create(base: &str, key: &str, within: Duration) -> (Reply, bool) {
    let deadline = Instant::now() + within;
    let mut busy = false;
    loop {
        let r = create(base, TOKEN, key, &worker_body()).await;
        let in_progress = r.status == StatusCode::CONFLICT && r.problem_type() == "request-in-progress";
        busy |= in_progress;
        if !(in_progress || r.status == StatusCode::SERVICE_UNAVAILABLE) || Instant::now() > deadline {
            return (r, busy);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn creates_cut_by_an_outage_resume_when_the_database_returns_not_after_the_ttl() {
    let Some(mut pg) = LocalServer::start() else { return };
    let db = pg.url("postgres");
    let hv = sim(&["--latency-ms", "1500"]);
    // The default --in-flight-ttl (5 minutes): a cut claim left in flight would block its key.
    let lb = serve(&db, &["--hypervisor-url", &hv.url, "--hypervisor-timeout", "10s"]);
    let base = lb.url.clone();
    let warm = create(&base, TOKEN, "cut-warm", &worker_body()).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&warm.body));

    let keys: Vec<String> = (0..8).map(|i| format!("cut-{i}")).collect();
    let first: Vec<_> = keys
        .iter()
        .map(|key| {
            let (base, key) = (base.clone(), key.clone());
            tokio::spawn(async move { create(&base, TOKEN, &key, &worker_body()).await })
        })
        .collect();
    // Every create holds its claim and waits on the hypervisor: now the database goes.
    let deadline = Instant::now() + Duration::from_secs(60);
    while in_flight(&db, &keys).await < keys.len() as i64 {
        assert!(Instant::now() < deadline, "the creates did not all start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pg.stop();

    let mut cut = 0;
    for (key, t) in keys.iter().zip(first) {
        let r = t.await.expect("task");
        if r.status != StatusCode::CREATED {
            assert_store_unavailable(key, &r);
            cut += 1;
        }
    }
    assert!(cut > 0, "no create was cut by the outage");
    // While it is down, a retry is told the same, and /readyz too.
    assert_store_unavailable("a retry while down", &create(&base, TOKEN, &keys[0], &worker_body()).await);
    assert_eq!(readyz(&base).await, StatusCode::SERVICE_UNAVAILABLE);

    pg.start_again();
    let back = Instant::now();
    let mut ids = std::collections::HashSet::new();
    for key in &keys {
        // Far less than the 5-minute TTL: a claim kept until its TTL fails here.
        let (r, busy) = retry_create(&base, key, Duration::from_secs(120)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&r.body));
        ids.insert(r.json()["id"].as_str().expect("id").to_owned());
        eprintln!("{key}: created {:?} after the database came back (a 409 first: {busy})", back.elapsed());
    }
    assert_eq!(ids.len(), keys.len(), "one worker per key");
    for key in &keys {
        let again = create(&base, TOKEN, key, &worker_body()).await;
        assert!(again.replayed() && again.status == StatusCode::CREATED, "{key} is stored");
    }
    let stats = sim_stats(&hv.url).await;
    let n = keys.len() as i64 + 1;
    assert_eq!(stats["duplicate_boot_tags"], 0, "{stats}");
    assert_eq!(
        (stats["boots_total"].as_i64(), stats["running"].as_i64()),
        (Some(n), Some(n)),
        "one VM per key: {stats}"
    );
}

/// What one request sends: its name, method, URL, token, key and body.
type Route<'a> = (&'a str, Method, String, &'a str, Option<&'a str>, Option<&'a serde_json::Value>);

#[tokio::test]
async fn every_route_answers_store_unavailable_while_the_database_is_down() {
    let Some(mut pg) = LocalServer::start() else { return };
    let lb = serve(&pg.url("postgres"), &[]);
    let base = lb.url.clone();
    let created = create(&base, TOKEN, "routes-1", &worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let id = created.json()["id"].as_str().expect("id").to_owned();
    let (flash, body) = (json!({"version": "2.4.1"}), worker_body());
    pg.stop();

    let worker = format!("{base}/v1/workers/{id}");
    let routes: Vec<Route<'_>> = vec![
        ("create", Method::POST, format!("{base}/v1/workers"), TOKEN, Some("routes-2"), Some(&body)),
        ("get", Method::GET, worker.clone(), TOKEN, None, None),
        ("list", Method::GET, format!("{base}/v1/workers"), TOKEN, None, None),
        ("delete", Method::DELETE, worker.clone(), TOKEN, Some("routes-3"), None),
        ("reboot", Method::POST, format!("{worker}/reboot"), TOKEN, Some("routes-4"), None),
        (
            "flash",
            Method::POST,
            format!("{base}/admin/v1/nodes/node-0002/firmware"),
            ADMIN,
            Some("routes-5"),
            Some(&flash),
        ),
        ("operation", Method::GET, format!("{base}/admin/v1/operations/op-0123456789abcdef"), ADMIN, None, None),
        ("fleet", Method::GET, format!("{base}/admin/v1/fleet"), ADMIN, None, None),
    ];
    for (what, method, url, token, key, body) in routes {
        let asked = Instant::now();
        let r = send(method, &url, token, key, body).await;
        eprintln!("{what}: {} after {:?}", r.status, asked.elapsed());
        assert_store_unavailable(what, &r);
    }
    let r = http().get(format!("{base}/readyz")).send().await.expect("readyz");
    let ready =
        Reply { status: r.status(), headers: r.headers().clone(), body: r.bytes().await.expect("body").to_vec() };
    assert_store_unavailable("readyz", &ready);

    pg.start_again();
    let deadline = Instant::now() + Duration::from_secs(60);
    while readyz(&base).await != StatusCode::OK {
        assert!(Instant::now() < deadline, "not ready 60 s after the database came back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let got = send(Method::GET, &worker, TOKEN, None, None).await;
    assert_eq!(got.status, StatusCode::OK, "{}", String::from_utf8_lossy(&got.body));
}

/// The standby's replay has reached everything the primary wrote so far.
async fn wait_for_replay(primary: &str, standby: &str) {
    let mut p = sqlx::PgConnection::connect(primary).await.expect("primary");
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut p).await.expect("lsn");
    let mut s = sqlx::PgConnection::connect(standby).await.expect("standby");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let caught_up: bool = sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
            .bind(&lsn)
            .fetch_one(&mut s)
            .await
            .expect("replay lsn");
        if caught_up {
            return;
        }
        assert!(Instant::now() < deadline, "the standby did not catch up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_multi_host_url_follows_the_primary_across_a_failover_without_a_restart() {
    let Some(mut primary) = LocalServer::start() else { return };
    let Some(standby) = LocalServer::standby_of(&primary) else { return };
    // The standby first: with target_session_attrs=read-write the service passes it over.
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port(),
        primary.port()
    );
    let hv = sim(&[]);
    let mut lb = serve(&url, &["--hypervisor-url", &hv.url]);
    let base = lb.url.clone();
    let first = create(&base, TOKEN, "ha-1", &worker_body()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&first.body));
    let id = first.json()["id"].as_str().expect("id").to_owned();

    wait_for_replay(&primary.url("postgres"), &standby.url("postgres")).await;
    primary.stop();
    let stopped = Instant::now();
    standby.promote();
    let promoted = stopped.elapsed();

    let (second, _) = retry_create(&base, "ha-2", Duration::from_secs(120)).await;
    eprintln!("failover: promoted {promoted:?} after the stop, a create answered {:?} after it", stopped.elapsed());
    assert_eq!(second.status, StatusCode::CREATED, "{}: {}", String::from_utf8_lossy(&second.body), standby.log());
    assert!(lb.child.try_wait().expect("wait").is_none(), "the same process carries on");
    let replay = create(&base, TOKEN, "ha-1", &worker_body()).await;
    assert!(replay.replayed() && replay.json()["id"] == id.as_str(), "the first create is kept: {:?}", replay.json());
    let got = send(Method::GET, &format!("{base}/v1/workers/{id}"), TOKEN, None, None).await;
    assert_eq!(got.status, StatusCode::OK, "{}", String::from_utf8_lossy(&got.body));
    assert_eq!(readyz(&base).await, StatusCode::OK);
    let stats = sim_stats(&hv.url).await;
    assert_eq!((stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64()), (Some(2), Some(0)), "{stats}");
}

#[tokio::test]
async fn the_service_never_lowers_synchronous_commit() {
    use clap::Parser;
    use leasebroker::config::{Cli, Command};
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    // The database's own setting, the strongest: a session that lowered it would show less.
    let mut admin = sqlx::PgConnection::connect(pg.url()).await.expect("connect");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        r#"ALTER DATABASE "{}" SET synchronous_commit = 'remote_apply'"#,
        pg.name()
    )))
    .execute(&mut admin)
    .await
    .expect("alter");
    let _ = admin.close().await;
    let cli = Cli::parse_from([
        "leasebroker",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--database",
        pg.url(),
        "--token",
        &format!("{TOKEN}=alice"),
        "--pool-nodes",
        "4",
    ]);
    let Command::Serve(args) = cli.command else { panic!("serve") };
    let app = leasebroker::app::Application::build(*args).await.expect("build");
    let leasebroker::db::Db::Postgres(pool) = app.database().clone() else { panic!("postgres") };
    let url = format!("http://{}", app.local_addr());
    let server = tokio::spawn(app.run_until_stopped(std::future::pending()));
    let r = create(&url, TOKEN, "sync-1", &worker_body()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&r.body));
    // Several live sessions of the service's pool at once, each asked.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut conn = pool.acquire().await.expect("acquire");
        let level: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *conn).await.expect("show");
        assert_eq!(level, "remote_apply", "a session of the service's pool lowered synchronous_commit");
        held.push(conn);
    }
    drop(held);
    server.abort();
}

/// A `redis-server` with its records in an append-only file written at every command, on a
/// port and directory that outlive it, so it can be killed and started again with its data.
struct DurableRedis {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<std::process::Child>,
    /// Its port while it is killed, so that no other test's listener takes it meanwhile.
    held: Option<testkit::HeldPort>,
}

impl DurableRedis {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = testkit::free_port();
        let mut redis = DurableRedis { dir, port, child: None, held: None };
        redis.start_again();
        redis
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn start_again(&mut self) {
        self.held = None;
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction"])
            .args(["--dir", &self.dir.path().display().to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let pong = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if pong.is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as when its machine dies.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            self.held = testkit::HeldPort::hold(self.port);
        }
    }

    /// How many records are in flight.
    fn in_flight(&self) -> usize {
        let mut conn = redis::Client::open(self.url()).expect("url").get_connection().expect("connect");
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).expect("keys");
        keys.iter()
            .filter(|k| {
                let kind: String = redis::cmd("TYPE").arg(k.as_str()).query(&mut conn).unwrap_or_default();
                kind == "hash"
                    && redis::cmd("HGET").arg(k.as_str()).arg("st").query::<Option<String>>(&mut conn).ok().flatten()
                        == Some("in_flight".to_owned())
            })
            .count()
    }
}

impl Drop for DurableRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `_count` of a histogram series in Prometheus text, e.g.
/// `idempotency_store_duration_seconds_count{op="complete"}`.
async fn metric_count(base: &str, series: &str) -> u64 {
    let text = http().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse::<f64>().ok()))
        .map_or(0, |v| v as u64)
}

/// The records on Redis: it dies while creates run and stays down past every retry of their
/// completions, then comes back with its data. The records stay in flight (their clients were
/// answered as final, docs/protocol.md#side-effects), and nobody renews their claims once the retries end: every
/// retry after the in-flight TTL (5 s here, shorter than the retries) resumes the same worker,
/// one VM per key.
#[tokio::test]
async fn creates_whose_records_redis_lost_for_a_while_resume_when_it_returns() {
    if !testkit::redis::have_redis_binaries() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "redis-server is not installed and CI=true");
        eprintln!("SKIPPED: redis-server is not installed");
        return;
    }
    let mut redis = DurableRedis::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let hv = sim(&["--latency-ms", "1500"]);
    let lb = serve(
        &sqlite_url(&dir),
        &["--record-store", &redis.url(), "--hypervisor-url", &hv.url, "--in-flight-ttl", "5s"],
    );
    let base = lb.url.clone();
    let warm = create(&base, TOKEN, "rd-warm", &worker_body()).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&warm.body));

    let keys: Vec<String> = (0..8).map(|i| format!("rd-{i}")).collect();
    let first: Vec<_> = keys
        .iter()
        .map(|key| {
            let (base, key) = (base.clone(), key.clone());
            tokio::spawn(async move { create(&base, TOKEN, &key, &worker_body()).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while redis.in_flight() < keys.len() {
        assert!(Instant::now() < deadline, "the creates did not all start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.kill();
    // The handlers' own work is in SQLite: each client gets its worker, and its record's
    // completion fails, is retried, and fails every time.
    let mut first_ids = Vec::new();
    for (key, t) in keys.iter().zip(first) {
        let r = t.await.expect("task");
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&r.body));
        first_ids.push(r.json()["id"].as_str().expect("id").to_owned());
    }
    let completions = 1 + (1 + idempotency_tower::DEFAULT_COMPLETION_RETRIES as u64) * keys.len() as u64;
    let series = "idempotency_store_duration_seconds_count{op=\"complete\"}";
    let deadline = Instant::now() + Duration::from_secs(180);
    while metric_count(&base, series).await < completions {
        assert!(Instant::now() < deadline, "the completion retries did not all run");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    redis.start_again();
    let back = Instant::now();
    for (key, id) in keys.iter().zip(&first_ids) {
        let (r, _) = retry_create(&base, key, Duration::from_secs(120)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["id"].as_str(), Some(id.as_str()), "{key}: the retry resumed the same worker");
        eprintln!("{key}: answered {:?} after Redis came back", back.elapsed());
    }
    let stats = sim_stats(&hv.url).await;
    let n = keys.len() as i64 + 1;
    assert_eq!(stats["duplicate_boot_tags"], 0, "{stats}");
    assert_eq!((stats["boots_total"].as_i64(), stats["running"].as_i64()), (Some(n), Some(n)), "{stats}");
}
