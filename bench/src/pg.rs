//! PostgreSQL measurements: the store driven directly, the pgbench scripts it is compared
//! with, the sweeper under load, and bytes per stored record.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args, ValueEnum};
use idempotency::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordState, Scope, Store,
    StoredBody, StoredResponse, Sweeper, now,
};
use idempotency_sqlx::{ClaimStrategy, PostgresStore};
use serde_json::json;
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::load::{self, Stats};

/// Completed records `pg-prepare` creates for the replay runs.
pub(crate) const DEFAULT_KEYS: u32 = 10_000;

const PRINCIPAL: &str = "bench";
const METHOD: &str = "POST";
const PATH: &str = "/v1/workers";
const FINGERPRINT: &str = "sha256:00";
const RESPONSE_BODY: &str = r#"{"id":"wkr-1","state":"booting"}"#;

pub(crate) fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: StoredBody::encode(Bytes::from_static(RESPONSE_BODY.as_bytes()), usize::MAX),
    }
}

pub(crate) fn claim_request(key: &str) -> anyhow::Result<ClaimRequest> {
    let t = now();
    Ok(ClaimRequest {
        scope: Scope::new(Principal::new(PRINCIPAL), Endpoint::new(METHOD, PATH), IdempotencyKey::try_from(key)?),
        fingerprint: Fingerprint::from_stored(FINGERPRINT),
        now: t,
        in_flight_ttl: idempotency_tower::DEFAULT_IN_FLIGHT_TTL,
        expires_at: t + chrono::Duration::hours(24),
    })
}

/// A pool of `size` connections with the stores' settings (no ping per checkout).
async fn pool(url: &str, size: u32) -> anyhow::Result<PgPool> {
    Ok(idempotency_sqlx::postgres_pool_options(size).min_connections(size).connect(url).await?)
}

/// A pool of `size` connections with sqlx's defaults: a ping (one round trip) on every checkout.
async fn pinging_pool(url: &str, size: u32) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new().max_connections(size).min_connections(size).connect(url).await?)
}

/// Inserts `count` completed (or, with `expired`, long expired) records keyed
/// `{prefix}{0..count}` in one statement.
async fn insert_series(pool: &PgPool, prefix: &str, count: u32, expired: bool) -> anyhow::Result<u64> {
    let r = response();
    let expires = if expired { "now() - interval '1 hour'" } else { "now() + interval '1 day'" };
    let sql = format!(
        "INSERT INTO idempotency_records (principal, endpoint, key, record_id, fingerprint, state, generation, \
           response_status, response_headers, response_body, response_encoding, created_at, started_at, expires_at) \
         SELECT $1, $2, $3 || g, decode(lpad(to_hex(g), 32, '0'), 'hex'), $4, 'completed', 1, $5, $6, $7, $8, \
           now(), now(), {expires} \
         FROM generate_series(0, $9 - 1) AS g ON CONFLICT DO NOTHING"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(PRINCIPAL)
        .bind(format!("{METHOD} {PATH}"))
        .bind(prefix)
        .bind(FINGERPRINT)
        .bind(i32::from(r.status))
        .bind(r.headers_json())
        .bind(r.body.stored_bytes().as_ref())
        .bind(r.body.encoding().as_str())
        .bind(i64::from(count))
        .execute(pool)
        .await?;
    sqlx::query("ANALYZE idempotency_records").execute(pool).await?;
    Ok(done.rows_affected())
}

#[derive(Debug, Args)]
pub(crate) struct PrepareArgs {
    #[arg(long)]
    database: String,
    #[arg(long, default_value_t = DEFAULT_KEYS)]
    keys: u32,
}

pub(crate) async fn prepare(a: PrepareArgs) -> anyhow::Result<()> {
    let store = PostgresStore::from_pool(pool(&a.database, 1).await?);
    store.migrate().await?;
    let n = insert_series(store.pool(), "r-", a.keys, false).await?;
    println!("{}", json!({ "prepared": n }));
    Ok(())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Op {
    /// Claim a fresh key, then complete it: two statements.
    First,
    /// Claim a completed key: one statement.
    Replay,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Strategy {
    InsertOrRead,
    SeedUpsert,
}

#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    #[arg(long)]
    database: String,
    #[arg(long, value_enum)]
    op: Op,
    #[arg(long, value_enum, default_value = "insert-or-read")]
    strategy: Strategy,
    /// Pool size; 0 means `PostgresStore::connect`'s default pool (10).
    #[arg(long, default_value_t = 16)]
    pool: u32,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Replays pick uniformly among `r-0 .. r-{keys-1}`; 1 means a single hot key.
    #[arg(long, default_value_t = DEFAULT_KEYS)]
    keys: u32,
    /// Makes first-execution keys unique across runs.
    #[arg(long, default_value = "s")]
    nonce: String,
    /// Use sqlx's default pool settings, which ping every connection on checkout (one more
    /// round trip per statement), instead of the stores' pool.
    #[arg(long)]
    ping_on_checkout: bool,
    /// Complete without announcing the change (`PostgresStore::without_announcements`), to
    /// measure what the announcements for `Prefer: wait` cost a first execution.
    #[arg(long)]
    no_announcements: bool,
    /// Connect through a libpq multi-host URL (`--database`'s host listed twice, with
    /// `target_session_attrs=read-write`): the pool that follows the primary, whose checkouts
    /// also drop connections opened before a switch (issue 34).
    #[arg(long)]
    multi_host: bool,
}

/// `url` with its host listed twice and `target_session_attrs=read-write`: the multi-host form.
fn multi_host_url(url: &str) -> anyhow::Result<String> {
    let scheme_end = url.find("://").map(|i| i + 3).ok_or_else(|| anyhow::anyhow!("not a URL: {url}"))?;
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (userinfo, host) = match rest[..authority_end].rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..authority_end]),
        None => ("", &rest[..authority_end]),
    };
    let tail = &rest[authority_end..];
    let sep = if tail.contains('?') { '&' } else { '?' };
    Ok(format!("{}{userinfo}{host},{host}{tail}{sep}target_session_attrs=read-write", &url[..scheme_end]))
}

async fn wal_lsn(pool: &PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(pool).await?)
}

async fn wal_diff(pool: &PgPool, after: &str, before: &str) -> anyhow::Result<f64> {
    Ok(sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8")
        .bind(after)
        .bind(before)
        .fetch_one(pool)
        .await?)
}

pub(crate) async fn drive_store(a: StoreArgs) -> anyhow::Result<()> {
    let store = if a.pool == 0 {
        PostgresStore::connect(&a.database).await?
    } else if a.multi_host {
        let options = idempotency_sqlx::postgres_pool_options(a.pool).min_connections(a.pool);
        PostgresStore::from_pool(idempotency_sqlx::connect_postgres(&multi_host_url(&a.database)?, options).await?)
    } else if a.ping_on_checkout {
        PostgresStore::from_pool(pinging_pool(&a.database, a.pool).await?)
    } else {
        PostgresStore::from_pool(pool(&a.database, a.pool).await?)
    };
    let store = store.with_claim_strategy(match a.strategy {
        Strategy::InsertOrRead => ClaimStrategy::InsertOrRead,
        Strategy::SeedUpsert => ClaimStrategy::SeedUpsert,
    });
    let store = if a.no_announcements { store.without_announcements() } else { store };
    // Warm every pooled connection's statement cache before measuring.
    for _ in 0..a.concurrency.max(16) {
        let _ = store.claim(claim_request("r-0")?).await?;
    }
    let meter = pool(&a.database, 1).await?;
    let before = wal_lsn(&meter).await?;
    let (op, keys, nonce) = (a.op, a.keys.max(1), Arc::new(a.nonce.clone()));
    let s = store.clone();
    let stats = load::run(a.concurrency, Duration::from_secs_f64(a.seconds), move |task, i| {
        let (store, nonce) = (s.clone(), nonce.clone());
        async move {
            match op {
                Op::First => {
                    let ClaimOutcome::Owned(claim) =
                        store.claim(claim_request(&format!("{nonce}-{task}-{i}"))?).await?
                    else {
                        return Ok(false);
                    };
                    store.complete(&claim, &response(), now() + chrono::Duration::hours(24)).await?;
                    Ok(true)
                }
                Op::Replay => {
                    let k = if keys == 1 { 0 } else { rand::random_range(0..keys) };
                    let outcome = store.claim(claim_request(&format!("r-{k}"))?).await?;
                    Ok(matches!(outcome, ClaimOutcome::Existing(r) if r.state == RecordState::Completed))
                }
            }
        }
    })
    .await;
    let wal = wal_diff(&meter, &wal_lsn(&meter).await?, &before).await?;
    let mut out = serde_json::to_value(&stats)?;
    out["wal_bytes_per_op"] = json!(wal / stats.ops.max(1) as f64);
    out["pool"] = json!(store.pool().options().get_max_connections());
    println!("{out}");
    Ok(())
}

// The store's statements (crates/idempotency-sqlx/src/postgres.rs, INSERT_OR_READ and
// COMPLETE), with literal arguments where the store binds parameters; a test below checks
// they are still the store's.
// The claim returns the record's columns after its scope (`state_columns!` in row.rs): the
// caller knows the scope it asked about.
const COLUMNS: &str = "record_id, fingerprint, state, generation, response_status, response_headers, response_body, \
     response_encoding, created_at, started_at, expires_at";

pub(crate) fn insert_or_read(key: &str) -> String {
    format!(
        "WITH ins AS ( INSERT INTO idempotency_records \
           (principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at) \
         VALUES ('{PRINCIPAL}', '{METHOD} {PATH}', {key}, '\\x000102030405060708090a0b0c0d0e0f'::bytea, \
           '{FINGERPRINT}', 'in_flight', 1, now(), now(), now() + interval '1 day') \
         ON CONFLICT (principal, endpoint, key) DO NOTHING RETURNING {COLUMNS}, true AS inserted) \
         SELECT * FROM ins UNION ALL SELECT {COLUMNS}, false AS inserted FROM idempotency_records \
         WHERE principal = '{PRINCIPAL}' AND endpoint = '{METHOD} {PATH}' AND key = {key} \
           AND NOT EXISTS (SELECT 1 FROM ins);\n"
    )
}

pub(crate) fn complete(key: &str) -> String {
    let r = response();
    format!(
        "UPDATE idempotency_records SET state = 'completed', response_status = {}, response_headers = '{}', \
           response_body = '\\x{}'::bytea, response_encoding = '{}', expires_at = now() + interval '1 day' \
         WHERE principal = '{PRINCIPAL}' AND endpoint = '{METHOD} {PATH}' AND key = {key} \
           AND record_id = '\\x000102030405060708090a0b0c0d0e0f'::bytea AND generation = 1 AND state = 'in_flight';\n",
        r.status,
        r.headers_json(),
        r.body.stored_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>(),
        r.body.encoding().as_str(),
    )
}

/// `replay.sql`: the claim statement on a random prepared key (one statement, one round trip).
/// `first.sql`: the claim of a fresh key, then its completion (two statements, autocommit),
/// as the store runs them. pgbench passes `:k` and `:nonce` as parameters under
/// `-M prepared`.
pub(crate) fn write_pgbench_scripts(dir: &Path, keys: u32) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let replay = format!("\\set k random(0, {})\n{}", keys.max(1) - 1, insert_or_read("('r-' || :k::text)"));
    let fresh = "(:nonce::text || '-' || :k::text)";
    let first = format!("\\set k random(1, 9000000000000000000)\n{}{}", insert_or_read(fresh), complete(fresh));
    std::fs::write(dir.join("replay.sql"), replay)?;
    std::fs::write(dir.join("first.sql"), first)?;
    Ok(())
}

/// A sweep of expired rows measured with claims running beside it (parts `sweeper` and
/// `partition`).
#[derive(Debug, Args)]
pub(crate) struct SweepArgs {
    #[arg(long)]
    pub(crate) database: String,
    /// Expired rows to insert and sweep (part `partition`: per layout and phase).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) rows: u32,
    /// Claiming tasks, each pausing `--pace-ms` between claims (an open-ish load, so latency
    /// is the statement's, not a queue's).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[arg(long, default_value_t = 5)]
    pace_ms: u64,
    #[arg(long, default_value_t = 5.0)]
    pub(crate) idle_seconds: f64,
    /// Stop measuring (the sweep goes on) after this long.
    #[arg(long, default_value_t = 120.0)]
    max_sweep_seconds: f64,
}

impl SweepArgs {
    /// Claims new keys (`{prefix}-{task}-{i}`) on `store` for `max` seconds or until `stop`.
    pub(crate) async fn claims(
        &self,
        store: &Arc<dyn Store>,
        prefix: String,
        max: f64,
        stop: Arc<AtomicBool>,
    ) -> Stats {
        let store = store.clone();
        let pace = Duration::from_millis(self.pace_ms);
        load::run_until(self.concurrency, Duration::from_secs_f64(max), pace, stop, move |task, i| {
            let (store, key) = (store.clone(), format!("{prefix}-{task}-{i}"));
            async move { Ok(matches!(store.claim(claim_request(&key)?).await?, ClaimOutcome::Owned(_))) }
        })
        .await
    }

    /// Claims on `store` while `sweeper` makes one [`sweep`]: their latency, what the pass swept and how long it took.
    pub(crate) async fn while_sweeping(
        &self,
        store: &Arc<dyn Store>,
        sweeper: &Arc<dyn Store>,
        prefix: String,
    ) -> anyhow::Result<(Stats, u64, f64)> {
        let done = Arc::new(AtomicBool::new(false));
        let sweeping = {
            let (sweeper, done) = (sweeper.clone(), done.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let swept = sweep(&sweeper).await;
                done.store(true, Ordering::Relaxed);
                (swept, t.elapsed().as_secs_f64())
            })
        };
        let during = self.claims(store, prefix, self.max_sweep_seconds, done).await;
        let (swept, seconds) = sweeping.await?;
        Ok((during, swept?, seconds))
    }
}

/// One pass of the service's sweeper over everything expired.
pub(crate) async fn sweep(store: &Arc<dyn Store>) -> anyhow::Result<u64> {
    Ok(Sweeper::new(store.clone(), Duration::from_secs(3600)).run_once().await?)
}

/// Idle, sweeping, idle: claim latency in each phase, with the service's own pool (10) shared
/// by the claims and the sweeper, as in a running service.
pub(crate) async fn sweeper(a: SweepArgs) -> anyhow::Result<()> {
    let store = Arc::new(PostgresStore::connect(&a.database).await?);
    store.migrate().await?;
    let t = Instant::now();
    let inserted = insert_series(store.pool(), "x-", a.rows, true).await?;
    let insert_seconds = t.elapsed().as_secs_f64();
    sqlx::query("CHECKPOINT").execute(store.pool()).await?;
    let never = || Arc::new(AtomicBool::new(false));
    let store: Arc<dyn Store> = store;

    let idle_before = a.claims(&store, "sw-idle1".into(), a.idle_seconds, never()).await;
    let (during, swept, sweep_seconds) = a.while_sweeping(&store, &store, "sw-sweep".into()).await?;
    let idle_after = a.claims(&store, "sw-idle2".into(), a.idle_seconds, never()).await;
    println!(
        "{}",
        json!({
            "rows_inserted": inserted, "insert_seconds": insert_seconds,
            "swept": swept, "sweep_seconds": sweep_seconds, "swept_per_s": swept as f64 / sweep_seconds,
            "idle_before": idle_before, "sweeping": during, "idle_after": idle_after,
        })
    );
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct SizeArgs {
    #[arg(long)]
    database: String,
    #[arg(long, default_value_t = 5000)]
    records: u32,
}

/// A worker as a JSON body of at least 1 KiB, with the repetition of real JSON (the same keys
/// again and again) and the entropy of real ids.
fn worker_body(i: u32) -> Bytes {
    let id = || format!("{:016x}", rand::random::<u64>());
    let mut events = Vec::new();
    let mut body = String::new();
    for n in 0.. {
        let kind = ["allocated", "leased", "booting", "running"][n % 4];
        events.push(json!({
            "at": format!("2026-11-29T22:{:02}:{:02}.{:06}Z", n % 60, (n * 7) % 60, rand::random_range(0..1_000_000)),
            "kind": kind,
            "detail": format!("vm-{} on node-{:04}", id(), rand::random_range(0..5000)),
        }));
        body = json!({
            "id": format!("wkr-{}", id()), "owner": "team-a", "image": "worker-base-2026.11", "cpu": 16,
            "memory_gb": 64, "state": "running", "node": format!("node-{:04}", i % 5000),
            "labels": {"team": "infra", "env": "prod", "pool": "general"},
            "events": events,
        })
        .to_string();
        if body.len() >= 1024 {
            break;
        }
    }
    Bytes::from(body)
}

async fn size_of(store: &PostgresStore, records: u32, threshold: usize) -> anyhow::Result<serde_json::Value> {
    sqlx::query("TRUNCATE idempotency_records").execute(store.pool()).await?;
    let (mut body_len, mut stored_len) = (0usize, 0usize);
    for i in 0..records {
        let ClaimOutcome::Owned(claim) = store.claim(claim_request(&format!("sz-{i}"))?).await? else {
            anyhow::bail!("size key sz-{i} already existed");
        };
        let body = worker_body(i);
        body_len += body.len();
        let stored = StoredBody::encode(body, threshold);
        stored_len += stored.stored_bytes().len();
        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: stored,
        };
        store.complete(&claim, &response, now() + chrono::Duration::hours(24)).await?;
    }
    // Compact away the claim's dead row versions so the sizes are of the live records alone.
    sqlx::query("VACUUM FULL idempotency_records").execute(store.pool()).await?;
    let (row, heap, index): (f64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT avg(pg_column_size(t.*))::float8 FROM idempotency_records t), \
                pg_table_size('idempotency_records'), pg_indexes_size('idempotency_records')",
    )
    .fetch_one(store.pool())
    .await?;
    let n = f64::from(records);
    Ok(json!({
        "records": records, "json_bytes": body_len as f64 / n, "stored_body_bytes": stored_len as f64 / n,
        "row_bytes": row, "table_bytes_per_record": heap as f64 / n, "index_bytes_per_record": index as f64 / n,
        "total_bytes_per_record": (heap + index) as f64 / n,
    }))
}

pub(crate) async fn record_size(a: SizeArgs) -> anyhow::Result<()> {
    let store = PostgresStore::from_pool(pool(&a.database, 2).await?);
    store.migrate().await?;
    let raw = size_of(&store, a.records, usize::MAX).await?;
    let compressed = size_of(&store, a.records, idempotency_tower::DEFAULT_COMPRESSION_THRESHOLD).await?;
    sqlx::query("TRUNCATE idempotency_records").execute(store.pool()).await?;
    println!("{}", json!({ "raw": raw, "compressed": compressed }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn squash(s: &str) -> String {
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The pgbench scripts must run the store's statements: every clause of them, parameters
    /// aside, appears in the store's source.
    #[test]
    fn the_multi_host_url_lists_the_host_twice() {
        assert_eq!(
            multi_host_url("postgres://postgres@127.0.0.1:5432/db").unwrap(),
            "postgres://postgres@127.0.0.1:5432,127.0.0.1:5432/db?target_session_attrs=read-write"
        );
        assert_eq!(
            multi_host_url("postgres://h:1/db?sslmode=disable").unwrap(),
            "postgres://h:1,h:1/db?sslmode=disable&target_session_attrs=read-write"
        );
    }

    #[test]
    fn pgbench_statements_are_the_stores() {
        // The fenced statements are generated for the store's table in fenced.rs.
        let source = squash(
            &[
                include_str!("../../crates/idempotency-sqlx/src/postgres.rs"),
                include_str!("../../crates/idempotency-sqlx/src/fenced.rs"),
            ]
            .concat()
            .replace("\\\n", " "),
        );
        assert!(source.contains("fenced_sql!(\"idempotency_records\", state_columns)"), "the store's table changed");
        for clause in [
            "ON CONFLICT (principal, endpoint, key) DO NOTHING",
            "SELECT * FROM ins UNION ALL SELECT",
            "AND NOT EXISTS (SELECT 1 FROM ins)",
            "(principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at)",
            "SET state = 'completed', response_status = $6,",
            "AND generation = $5 AND state = 'in_flight'",
        ] {
            assert!(source.contains(clause), "the store no longer says {clause:?}");
            let script = squash(&(insert_or_read("k") + &complete("k")));
            let clause = clause.replace(" = $6,", " = 201,").replace("$5", "1");
            assert!(script.contains(&clause), "the pgbench script does not say {clause:?}");
        }
        let columns = squash(&include_str!("../../crates/idempotency-sqlx/src/row.rs").replace("\\\n", " "));
        assert!(columns.contains(&squash(COLUMNS)), "the store's column list changed");
    }

    #[test]
    fn worker_bodies_are_at_least_a_kibibyte_and_compress() {
        let b = worker_body(7);
        assert!(b.len() >= 1024 && b.len() < 1400, "{}", b.len());
        let z = StoredBody::encode(b.clone(), 1024);
        assert!(z.stored_bytes().len() < b.len());
    }
}
