//! Retention at scale: sweeping 1M expired records with the default layout's batched DELETE
//! against dropping whole days with the layout partitioned by expiry day. Per layout: the WAL
//! the sweep writes and how long it takes (alone), then claim latency while it runs against idle;
//! and the partitioned layout with its drops deferred to an off-peak window.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use chrono::{NaiveTime, TimeZone, Utc};
use idempotency::{Store, Timestamp, now};
use idempotency_sqlx::{PartitionedPostgresStore, PostgresStore};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::pg::{SweepArgs, response, sweep};

/// One layout: its store and the table the rows go into.
struct Layout {
    name: &'static str,
    store: Arc<dyn Store>,
    pool: PgPool,
    table: &'static str,
    /// The partitioned store, which must create the (past) day's partition before a load.
    partitioned: Option<PartitionedPostgresStore>,
}

/// The end of yesterday (UTC) less an hour: expired, and on a day that has ended, so both
/// layouts' sweeps remove every such row.
fn expired_at() -> Timestamp {
    Utc.from_utc_datetime(&now().date_naive().and_time(NaiveTime::MIN)) - chrono::Duration::hours(1)
}

/// Inserts `count` completed, expired records in one statement, then vacuums and checkpoints
/// so that neither autovacuum nor the first writes' full-page images of the load land in the
/// measurement.
async fn load_expired(l: &Layout, prefix: &str, count: u32) -> anyhow::Result<u64> {
    if let Some(p) = &l.partitioned {
        p.create_partition(expired_at().date_naive()).await?;
    }
    let r = response();
    let sql = format!(
        "INSERT INTO {} (principal, endpoint, key, record_id, fingerprint, state, generation, \
           response_status, response_headers, response_body, response_encoding, created_at, started_at, expires_at) \
         SELECT 'bench', 'POST /v1/workers', $1 || g, decode(lpad(to_hex(g), 32, '0'), 'hex'), 'sha256:00', \
           'completed', 1, $2, $3, $4, $5, $6 - interval '1 hour', $6 - interval '1 hour', $6 \
         FROM generate_series(0, $7 - 1) AS g",
        l.table
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(prefix)
        .bind(i32::from(r.status))
        .bind(r.headers_json())
        .bind(r.body.stored_bytes().as_ref())
        .bind(r.body.encoding().as_str())
        .bind(expired_at())
        .bind(i64::from(count))
        .execute(&l.pool)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM (ANALYZE) {}", l.table))).execute(&l.pool).await?;
    sqlx::query("CHECKPOINT").execute(&l.pool).await?;
    Ok(done.rows_affected())
}

async fn wal_lsn(pool: &PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(pool).await?)
}

async fn wal_since(pool: &PgPool, before: &str) -> anyhow::Result<f64> {
    Ok(sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8")
        .bind(before)
        .fetch_one(pool)
        .await?)
}

/// The WAL since `before` that touched this database's pages (`pg_walinspect`, when the server
/// has it): what the sweep wrote, without other databases' writes on a shared server. Records
/// that touch no page (commits) are left out, for both layouts.
async fn database_wal_since(pool: &PgPool, before: &str) -> anyhow::Result<Option<f64>> {
    if sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect").execute(pool).await.is_err() {
        return Ok(None);
    }
    let pattern: String =
        sqlx::query_scalar("SELECT '%/' || oid || '/%' FROM pg_database WHERE datname = current_database()")
            .fetch_one(pool)
            .await?;
    Ok(Some(
        sqlx::query_scalar(
            "SELECT coalesce(sum(record_length), 0)::float8 \
             FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_lsn()) WHERE block_ref LIKE $2",
        )
        .bind(before)
        .bind(pattern)
        .fetch_one(pool)
        .await?,
    ))
}

async fn measure(l: &Layout, a: &SweepArgs) -> anyhow::Result<Value> {
    let never = || Arc::new(AtomicBool::new(false));
    // Alone: WAL and duration. The WAL position is the server's, so anything else writing to
    // the same server during the sweep counts too: run on a quiet server.
    load_expired(l, &format!("{}-a-", l.name), a.rows).await?;
    let before = wal_lsn(&l.pool).await?;
    let t = Instant::now();
    let swept = sweep(&l.store).await?;
    let sweep_seconds = t.elapsed().as_secs_f64();
    let wal_bytes = wal_since(&l.pool, &before).await?;
    let database_wal_bytes = database_wal_since(&l.pool, &before).await?;

    // Under claims: idle, sweeping, idle.
    load_expired(l, &format!("{}-b-", l.name), a.rows).await?;
    let idle_before = a.claims(&l.store, format!("pt-{}-idle1", l.name), a.idle_seconds, never()).await;
    let (during, swept_loaded, loaded_seconds) =
        a.while_sweeping(&l.store, &l.store, format!("pt-{}-sweep", l.name)).await?;
    let idle_after = a.claims(&l.store, format!("pt-{}-idle2", l.name), a.idle_seconds, never()).await;
    Ok(json!({
        "swept": swept, "sweep_seconds": sweep_seconds, "wal_bytes": wal_bytes,
        "wal_bytes_per_row": wal_bytes / swept.max(1) as f64, "database_wal_bytes": database_wal_bytes,
        "swept_under_claims": swept_loaded, "sweep_seconds_under_claims": loaded_seconds,
        "idle_before": idle_before, "sweeping": during, "idle_after": idle_after,
    }))
}

/// The partitioned layout with its drops deferred to an off-peak window
/// (`PartitionedPostgresStore::with_drop_window`, here one that excludes the current hour): the
/// claims while the ended day is detached and its drop deferred, against idle; then the claims
/// during the deferred drop itself, as it runs in its window (the stall the window moves out of
/// the busy hours).
async fn measure_off_peak(store: &PartitionedPostgresStore, pool: &PgPool, a: &SweepArgs) -> anyhow::Result<Value> {
    let never = || Arc::new(AtomicBool::new(false));
    let hour = chrono::Timelike::hour(&now());
    let closed = idempotency_sqlx::DropWindow::hours((hour + 2) % 24, (hour + 3) % 24).expect("an hour's window");
    let deferring: Arc<dyn Store> = Arc::new(store.clone().with_drop_window(closed));
    let dropping: Arc<dyn Store> = Arc::new(store.clone());
    let l = Layout {
        name: "off-peak",
        store: deferring.clone(),
        pool: pool.clone(),
        table: "idempotency_records_by_day",
        partitioned: Some(store.clone()),
    };
    load_expired(&l, "off-peak-", a.rows).await?;
    let idle_before = a.claims(&deferring, "pt-off-peak-idle1".into(), a.idle_seconds, never()).await;
    let (during, detached_swept, detach_seconds) =
        a.while_sweeping(&deferring, &deferring, "pt-off-peak-sweep".into()).await?;
    let idle_after = a.claims(&deferring, "pt-off-peak-idle2".into(), a.idle_seconds, never()).await;
    let (in_window, dropped, drop_seconds) = a.while_sweeping(&deferring, &dropping, "pt-off-peak-drop".into()).await?;
    Ok(json!({
        "swept_under_claims": detached_swept, "sweep_seconds_under_claims": detach_seconds,
        "idle_before": idle_before, "sweeping": during, "idle_after": idle_after,
        "dropped_in_window": dropped, "drop_seconds": drop_seconds, "dropping": in_window,
    }))
}

/// Both layouts in one database, one after the other; prints one JSON object with a member per
/// layout.
pub(crate) async fn partition(a: SweepArgs) -> anyhow::Result<()> {
    let delete = PostgresStore::connect(&a.database).await?;
    delete.migrate().await?;
    let partitioned = PartitionedPostgresStore::connect(&a.database).await?;
    partitioned.migrate().await?;
    let layouts = [
        Layout {
            name: "delete",
            pool: delete.pool().clone(),
            store: Arc::new(delete),
            table: "idempotency_records",
            partitioned: None,
        },
        Layout {
            name: "partitioned",
            pool: partitioned.pool().clone(),
            store: Arc::new(partitioned.clone()),
            table: "idempotency_records_by_day",
            partitioned: Some(partitioned.clone()),
        },
    ];
    let mut out = serde_json::Map::new();
    for l in &layouts {
        let m = measure(l, &a).await?;
        out.insert(l.name.into(), m);
    }
    out.insert("off-peak".into(), measure_off_peak(&partitioned, partitioned.pool(), &a).await?);
    println!("{}", Value::Object(out));
    Ok(())
}
