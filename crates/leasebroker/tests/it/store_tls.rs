//! TLS to the stores (issue 25, docs/protocol.md#leasebroker-api "TLS to the stores"): the real binary against a real
//! redis-server the test starts with TLS on a free port and a CA the test generates, and against
//! the PostgreSQL server of `TEST_POSTGRES_URL` (which must have `ssl = on`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::support::{Launch, Proc};
use testkit::free_port;
use testkit::tokens::ALICE;

/// A CA and a server certificate for 127.0.0.1 it issued, as PEM files in `dir`: (CA, cert, key).
fn generate_ca_and_server_cert(dir: &Path, ca_name: &str) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, ca_name);
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).expect("params");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).expect("leaf");
    let paths = (dir.join(format!("{ca_name}.pem")), dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&paths.0, ca_cert.pem()).expect("write");
    std::fs::write(&paths.1, cert.pem()).expect("write");
    std::fs::write(&paths.2, key.serialize_pem()).expect("write");
    (paths.0, paths.1, paths.2)
}

/// Starts `leasebroker serve`; its address, or its log when it would not start.
fn serve(db: &str, extra: &[&str]) -> Result<(Proc, String), String> {
    let lb = Launch::serve(db, extra).try_start()?;
    let url = lb.url.clone();
    Ok((lb, url))
}

async fn create_worker(base: &str, key: &str) -> StatusCode {
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    reqwest::Client::new()
        .post(format!("{base}/v1/workers"))
        .bearer_auth(ALICE)
        .header("Idempotency-Key", key)
        .json(&body)
        .send()
        .await
        .expect("create")
        .status()
}

#[tokio::test]
async fn records_go_to_redis_over_tls_with_a_private_ca_and_an_untrusted_one_is_refused() {
    if !testkit::redis::have_redis_binaries() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
        eprintln!("SKIPPED: the Redis TLS test: redis-server or redis-cli is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = generate_ca_and_server_cert(dir.path(), "redis-test-ca");
    let tls_port = free_port().to_string();
    let node = testkit::redis::start_server(
        dir.path(),
        &[
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            &cert.display().to_string(),
            "--tls-key-file",
            &key.display().to_string(),
            "--tls-ca-cert-file",
            &ca.display().to_string(),
            "--tls-auth-clients",
            "no",
        ],
    );
    let store = format!("rediss://127.0.0.1:{tls_port}");
    let db = format!("sqlite://{}", dir.path().join("lb.db").display());
    let ca_arg = ca.display().to_string();
    let (_lb, url) = serve(&db, &["--record-store", &store, "--redis-ca-cert", &ca_arg]).expect("serve over TLS");
    assert_eq!(create_worker(&url, "tls-1").await, StatusCode::CREATED);
    // The record is in that Redis (read back over its plain port).
    let mut conn = node.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).expect("keys");
    assert!(!keys.is_empty(), "no record in Redis");
    drop(_lb);

    // Without the CA the server's certificate is not trusted: refused at start, in one line.
    let db2 = format!("sqlite://{}", dir.path().join("lb2.db").display());
    let err = serve(&db2, &["--record-store", &store]).expect_err("started with an untrusted certificate");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("record store"), "{err}");
}

#[tokio::test]
async fn postgres_over_tls_require_and_prefer_use_tls_and_verify_full_checks_the_ca() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let with = |params: &str| {
        let sep = if pg.url().contains('?') { '&' } else { '?' };
        format!("{}{sep}{params}", pg.url())
    };
    // One connection, so that `pg_backend_pid()` excludes every session of the test's own.
    let admin = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(pg.url()).await.expect("connect");
    let ssl_on: String = sqlx::query_scalar("SHOW ssl").fetch_one(&admin).await.expect("show ssl");
    if ssl_on != "on" {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "the test PostgreSQL runs without ssl, and CI=true");
        eprintln!("SKIPPED: the PostgreSQL TLS test: the server at TEST_POSTGRES_URL has ssl = off");
        return;
    }
    // The service's sessions on this database: (with TLS, without).
    let sessions = || async {
        let rows: Vec<(bool,)> = sqlx::query_as(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()",
        )
        .fetch_all(&admin)
        .await
        .expect("pg_stat_ssl");
        (rows.iter().filter(|r| r.0).count(), rows.iter().filter(|r| !r.0).count())
    };
    for (i, mode) in ["sslmode=require", "sslmode=prefer"].into_iter().enumerate() {
        let (lb, url) = serve(&with(mode), &[]).unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert_eq!(create_worker(&url, &format!("pg-tls-{i}")).await, StatusCode::CREATED, "{mode}");
        let (tls, clear) = sessions().await;
        assert!(tls >= 1 && clear == 0, "{mode}: {tls} sessions with TLS, {clear} without");
        drop(lb);
        // Wait for the killed process's sessions to go before the next mode counts its own.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while sessions().await != (0, 0) {
            assert!(std::time::Instant::now() < deadline, "the sessions of a killed process stayed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // verify-full with a CA that did not issue the server's certificate: refused at start.
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, _, _) = generate_ca_and_server_cert(dir.path(), "not-the-pg-ca");
    let err = serve(&with(&format!("sslmode=verify-full&sslrootcert={}", ca.display())), &[])
        .expect_err("verify-full accepted a certificate its CA did not issue");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("PostgreSQL"), "{err}");
}

/// docs/protocol.md#leasebroker-api "TLS to the stores", the success path of `verify-full` with a private CA: a real
/// PostgreSQL the test starts with `ssl = on` and a server certificate its own CA (rcgen) issued.
/// `sslmode=verify-full&sslrootcert=CA` connects, serves, and its sessions use TLS; a CA that did
/// not issue the certificate is refused at start with one line.
#[tokio::test]
async fn postgres_verify_full_with_a_private_ca_connects_and_a_wrong_ca_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = generate_ca_and_server_cert(dir.path(), "pg-test-ca");
    let read = |p: &Path| std::fs::read_to_string(p).expect("read PEM");
    let Some(server) = testkit::postgres::LocalServer::start_with_tls(&read(&cert), &read(&key)) else {
        return;
    };
    let url = |ca: &Path| format!("{}?sslmode=verify-full&sslrootcert={}", server.url("postgres"), ca.display());
    let (lb, base) = serve(&url(&ca), &[]).unwrap_or_else(|e| panic!("verify-full with the issuing CA: {e}"));
    assert_eq!(create_worker(&base, "pg-verify-full").await, StatusCode::CREATED);
    // The service's sessions are TLS ones, every one of them.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&server.url("postgres"))
        .await
        .expect("connect");
    let (tls, clear): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) FROM pg_stat_ssl s \
         JOIN pg_stat_activity a USING (pid) WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&admin)
    .await
    .expect("pg_stat_ssl");
    assert!(tls >= 1 && clear == 0, "{tls} sessions with TLS, {clear} without");
    drop(lb);

    let (wrong, _, _) = generate_ca_and_server_cert(dir.path(), "not-the-pg-ca");
    let err = serve(&url(&wrong), &[]).expect_err("verify-full accepted a certificate its CA did not issue");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("PostgreSQL"), "{err}");
}
