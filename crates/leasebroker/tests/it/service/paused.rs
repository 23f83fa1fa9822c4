//! A replica stopped while it holds a database transaction (issue 45 item 3, docs/protocol.md#running-leasebroker): a frozen
//! VM or a long pause must not block every other replica. The sessions' idle-in-transaction time
//! and lock waits are bounded, so a retry on another replica resumes within 30 s while the first
//! stays stopped, and the stopped replica's statements after it resumes are fenced (its
//! transaction is gone: it commits nothing).
//!
//! The pause is placed exactly, without timing: the test holds a lock the create's first
//! transaction needs (`lb_leases`, taken after the operation's row and the node are written),
//! waits until PostgreSQL shows the replica's session waiting on it, stops the replica
//! (SIGSTOP), then lets the statement finish. The session is then idle inside its transaction,
//! holding the operation's and the node's rows, and its client answers nothing.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sqlx::Connection;

use crate::support::*;

/// A session of database `$1` waits on a lock in a statement on `lb_leases`.
const WAITING_ON_LEASES: &str = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
     AND wait_event_type = 'Lock' AND query LIKE '%lb_leases%'";
/// A session of database `$1` sits idle inside a transaction after a statement on `lb_leases`.
const IDLE_AFTER_LEASES: &str = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
     AND state = 'idle in transaction' AND query LIKE '%lb_leases%'";

/// Waits (up to a minute) until `sql` (a count over `pg_stat_activity` of database `db`) is
/// above zero.
async fn wait_for_sessions(conn: &mut sqlx::PgConnection, sql: &'static str, db: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n: i64 = sqlx::query_scalar(sql).bind(db).fetch_one(&mut *conn).await.expect("pg_stat_activity");
        if n > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_replica_stopped_inside_a_transaction_blocks_another_replicas_retry_only_briefly() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let hv = sim(&[]);
    // A short in-flight TTL, so the stopped replica's claim goes stale quickly and the retry
    // reclaims it: what is measured is the wait on the stopped replica's locks, not the TTL.
    let args = ["--hypervisor-url", hv.url.as_str(), "--in-flight-ttl", "2s", "--retention", "1h"];
    let a = serve(pg.url(), &args);
    let b = serve(pg.url(), &args);

    let mut holder = sqlx::PgConnection::connect(pg.url()).await.expect("connect");
    let mut watcher = sqlx::PgConnection::connect(pg.url()).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut holder).await.expect("begin");
    sqlx::query("LOCK TABLE lb_leases IN SHARE MODE").execute(&mut holder).await.expect("lock");

    let key = format!("paused-{}", &idempotency::RecordId::random().to_hex()[..8]);
    // The first attempt's client waits as long as it takes: its answer comes after SIGCONT.
    let first = {
        let url = format!("{}/v1/workers", a.url);
        let req =
            reqwest::Client::new().post(url).bearer_auth(TOKEN).header("Idempotency-Key", &key).json(&worker_body());
        tokio::spawn(async move {
            let resp = req.send().await.expect("the first attempt's request");
            let status = resp.status();
            (status, resp.bytes().await.expect("body").to_vec())
        })
    };
    let db = pg.url().rsplit('/').next().expect("a database name").split('?').next().expect("name").to_owned();
    wait_for_sessions(&mut watcher, WAITING_ON_LEASES, &db, "the first replica's create to wait on the lease table")
        .await;
    a.sigstop();
    sqlx::query("ROLLBACK").execute(&mut holder).await.expect("rollback");
    let what = "the stopped replica's session to sit idle inside its transaction";
    wait_for_sessions(&mut watcher, IDLE_AFTER_LEASES, &db, what).await;

    // The retry, on the other replica, while the first stays stopped.
    let stopped_at = Instant::now();
    let retried = tokio::time::timeout(
        Duration::from_secs(30),
        create_until_done(&b.url, &key, &worker_body(), Duration::from_secs(30)),
    )
    .await
    .expect("the retry on the other replica did not resume within 30 s of the first replica's stop (docs/protocol.md#running-leasebroker)");
    assert_eq!(retried.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&retried.body));
    eprintln!("the retry resumed {:?} after the stop", stopped_at.elapsed());

    // The stopped replica resumes: its transaction is gone, so it commits nothing, and what it
    // answers is not a second worker.
    a.sigcont();
    let (status, body) = tokio::time::timeout(Duration::from_secs(120), first)
        .await
        .expect("the resumed replica answers")
        .expect("task");
    let late: serde_json::Value = serde_json::from_slice(&body).expect("json");
    match status {
        StatusCode::CREATED => {
            assert_eq!(late["id"], retried.json()["id"], "the resumed replica answered another worker")
        }
        // Its transaction was ended by the server: a store outage to the client, which retries.
        _ => {
            let problem = late["type"].as_str().and_then(|t| t.rsplit('/').next());
            assert_eq!((status, problem), (StatusCode::SERVICE_UNAVAILABLE, Some("store-unavailable")), "{late}");
        }
    }
    let again = create_until_done(&b.url, &key, &worker_body(), Duration::from_secs(60)).await;
    assert_eq!(again.json()["id"], retried.json()["id"]);
    assert_one_worker_node_and_lease(&b.url).await;
    let stats = sim_stats(&hv.url).await;
    assert_eq!((stats["boots_total"].as_i64(), stats["duplicate_boot_tags"].as_i64()), (Some(1), Some(0)), "{stats}");
}
