//! `connect` builds a working store from each form of URL: SQLite in a temporary directory, the
//! PostgreSQL server of `TEST_POSTGRES_URL` (a database of the test's own), and Redis servers
//! started through the test kit; skipped loudly without them, failing under `CI=true`.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

use std::time::Duration;

use idempotency::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, Scope, Store, now};
use idempotency_stores::{ConnectError, Options, RedisStoreOptions, StoreUrl, connect};

/// One claim, then a second with the same key: the second finds the first's record.
async fn claims_once(store: &dyn Store) {
    let key = IdempotencyKey::try_from(format!("k-{}", rand_suffix()).as_str()).expect("key");
    let scope = Scope::new(Principal::new("stores-test"), Endpoint::new("POST", "/v1/things"), key);
    let t = now();
    let req = ClaimRequest {
        scope,
        fingerprint: Fingerprint::from_stored("sha256:00"),
        now: t,
        in_flight_ttl: Duration::from_secs(60),
        expires_at: t + chrono::Duration::hours(1),
    };
    assert!(matches!(store.claim(req.clone()).await.expect("claim"), ClaimOutcome::Owned(_)));
    assert!(matches!(store.claim(req).await.expect("claim again"), ClaimOutcome::Existing(_)));
}

fn rand_suffix() -> String {
    format!("{}-{}", std::process::id(), now().timestamp_nanos_opt().unwrap_or_default())
}

/// Skips (loudly) without `redis-server`, and fails under `CI=true`.
fn have_redis() -> bool {
    if testkit::redis::have_redis_binaries() {
        return true;
    }
    assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
    eprintln!("SKIPPED: redis-server or redis-cli is not installed");
    false
}

#[tokio::test]
async fn memory_and_sqlite_stores_work() {
    let memory = connect(&"memory".parse().unwrap(), &Options::default()).await.expect("memory");
    claims_once(&*memory).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url: StoreUrl = format!("sqlite://{}", dir.path().join("records.db").display()).parse().unwrap();
    let sqlite = connect(&url, &Options::default().max_connections(2)).await.expect("sqlite");
    claims_once(&*sqlite).await;
    assert!(dir.path().join("records.db").exists());
}

/// The store is migrated by `connect`: a fresh database takes a claim at once; with
/// `migrate(false)` it has no table yet, and the claim fails.
#[tokio::test]
async fn postgres_store_works_and_is_migrated() {
    let Some(db) = testkit::postgres::TestDatabase::create().await else { return };
    let url: StoreUrl = db.url().parse().unwrap();
    let unmigrated = connect(&url, &Options::default().migrate(false)).await.expect("postgres");
    let key = IdempotencyKey::try_from("before-migrations").expect("key");
    let scope = Scope::new(Principal::new("stores-test"), Endpoint::new("POST", "/v1/things"), key);
    let t = now();
    let req = ClaimRequest {
        scope,
        fingerprint: Fingerprint::from_stored("sha256:00"),
        now: t,
        in_flight_ttl: Duration::from_secs(60),
        expires_at: t + chrono::Duration::hours(1),
    };
    assert!(unmigrated.claim(req).await.is_err(), "no table before the migrations");
    let store = connect(&url, &Options::default().max_connections(2)).await.expect("postgres");
    claims_once(&*store).await;
}

#[tokio::test]
async fn redis_store_works() {
    if !have_redis() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = testkit::redis::start_server(dir.path(), &[]);
    let url: StoreUrl = node.url().parse().unwrap();
    assert!(matches!(url, StoreUrl::Redis(_)));
    let options = Options::default().redis(RedisStoreOptions::default().prefix(format!("stores-{}:", rand_suffix())));
    let store = connect(&url, &options).await.expect("redis");
    claims_once(&*store).await;
}

#[tokio::test]
async fn redis_cluster_store_works() {
    if !have_redis() {
        return;
    }
    let cluster = tokio::task::spawn_blocking(testkit::redis::Cluster::start).await.expect("cluster");
    let url: StoreUrl = cluster.url().parse().unwrap();
    assert!(matches!(url, StoreUrl::RedisCluster(_)), "{url}");
    let store = connect(&url, &Options::default()).await.expect("redis cluster");
    claims_once(&*store).await;
}

#[tokio::test]
async fn an_unreachable_store_is_an_error_naming_its_url_redacted() {
    let url: StoreUrl = "postgres://u:secret@127.0.0.1:1/db?connect_timeout=1".parse().unwrap();
    let err = connect(&url, &Options::default()).await.err().expect("nothing listens on port 1");
    assert!(matches!(err, ConnectError::Sql { .. }), "{err:?}");
    assert_eq!(err.to_string(), "cannot open the record store at postgres://u:***@127.0.0.1:1/db?connect_timeout=1");
    let url: StoreUrl = "redis://:secret@127.0.0.1:1".parse().unwrap();
    let err = connect(&url, &Options::default()).await.err().expect("nothing listens on port 1");
    assert!(matches!(err, ConnectError::Redis { .. }) && !err.to_string().contains("secret"), "{err}");
}
