//! `connect` builds a working store from each form of URL: the real PostgreSQL and Redis
//! (`TEST_POSTGRES_URL`, `TEST_REDIS_URL`; skipped loudly without, failing under `CI=true`).

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

fn env_or_skip(name: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(url) => Some(url),
        Err(_) if std::env::var("CI").as_deref() == Ok("true") => panic!("{name} is required under CI"),
        Err(_) => {
            eprintln!("SKIPPED: {name} is not set");
            None
        }
    }
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

#[tokio::test]
async fn postgres_store_works() {
    let Some(url) = env_or_skip("TEST_POSTGRES_URL") else { return };
    let store = connect(&url.parse().unwrap(), &Options::default()).await.expect("postgres");
    claims_once(&*store).await;
}

#[tokio::test]
async fn redis_store_works() {
    let Some(url) = env_or_skip("TEST_REDIS_URL") else { return };
    let options = Options::default().redis(RedisStoreOptions::default().prefix(&format!("stores-{}:", rand_suffix())));
    let store = connect(&url.parse().unwrap(), &options).await.expect("redis");
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
