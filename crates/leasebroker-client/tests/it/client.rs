//! The typed client against a scripted server: routes, headers, decoding and error mapping.

use std::collections::BTreeMap;
use std::time::Duration;

use leasebroker_client::retry::{Retrier, RetryPolicy};
use leasebroker_client::{Client, CreateWorker, Error, Mutation, OpKey, WorkerId, WorkerState};

use crate::server::{Reply, Scripted};

const WORKER: &str = r#"{"id":"wkr-7Q2K9","state":"booting","image":"worker-base:2025.11","cpu":16,"memory_gb":64,
"labels":{"team":"ml-eval"},"node_id":"node-3","lease_id":"lease-9","vm_id":"vm-1","reboot_count":0,
"created_at":"2026-11-29T22:13:07.123456Z"}"#;

fn client(server: &Scripted) -> Client {
    let policy = RetryPolicy::default()
        .with_delays(Duration::from_millis(10), Duration::from_millis(20))
        .with_max_elapsed(Duration::from_secs(10));
    Client::new(&format!("{}/", server.url), "tok-alice").expect("client").with_retrier(Retrier::new(policy))
}

fn request() -> CreateWorker {
    CreateWorker {
        image: "worker-base:2025.11".into(),
        cpu: 16,
        memory_gb: 64,
        labels: Some(BTreeMap::from([("team".to_owned(), "ml-eval".to_owned())])),
    }
}

#[tokio::test]
async fn create_sends_key_auth_and_json_and_reports_a_replay() {
    let server = Scripted::start([
        Reply::problem(503, "upstream-unavailable"),
        Reply::json(201, WORKER).header("idempotent-replayed", "true"),
    ])
    .await;
    let key = OpKey::new_v4();
    let created = client(&server).create_worker(&request(), &key).await.expect("created");
    assert_eq!(created.value.id.as_str(), "wkr-7Q2K9");
    assert_eq!(created.value.state, WorkerState::Booting);
    assert_eq!(created.value.labels["team"], "ml-eval");
    assert!(created.replayed);
    assert_eq!(created.attempts, 2);
    assert_eq!(created.status, 201);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.method, "POST");
        assert_eq!(s.path_and_query, "/v1/workers");
        assert_eq!(s.key.as_deref(), Some(key.as_str()));
        assert_eq!(s.authorization.as_deref(), Some("Bearer tok-alice"));
        assert_eq!(s.content_type.as_deref(), Some("application/json"));
        let body: serde_json::Value = serde_json::from_slice(&s.body).expect("json body");
        assert_eq!(
            body,
            serde_json::json!({"image": "worker-base:2025.11", "cpu": 16, "memory_gb": 64, "labels": {"team": "ml-eval"}})
        );
    }
}

#[tokio::test]
async fn a_fresh_create_is_not_reported_as_replayed() {
    let server = Scripted::start([Reply::json(201, WORKER)]).await;
    let created = client(&server).create_worker(&CreateWorker::new("img", 1, 1), &OpKey::new_v4()).await.unwrap();
    assert!(!created.replayed);
    assert_eq!(created.attempts, 1);
    // Absent labels stay absent on the wire: the server may tell `{}` and absent apart.
    let body: serde_json::Value = serde_json::from_slice(&server.seen()[0].body).unwrap();
    assert!(body.get("labels").is_none(), "{body}");
}

#[tokio::test]
async fn get_404_is_refused_with_its_problem() {
    let server = Scripted::start([Reply::problem(404, "not-found")]).await;
    let id: WorkerId = "wkr-missing".parse().unwrap();
    let err = client(&server).get_worker(&id).await.expect_err("404");
    assert!(
        matches!(&err, Error::Refused { status, problem: Some(p) } if *status == 404 && p.is("not-found")),
        "{err:?}"
    );
    let seen = server.seen();
    assert_eq!(
        (seen.len(), seen[0].path_and_query.as_str(), seen[0].key.as_deref()),
        (1, "/v1/workers/wkr-missing", None)
    );
}

#[tokio::test]
async fn list_reboot_delete_and_fleet_use_their_routes() {
    let server = Scripted::start([
        Reply::json(200, format!(r#"{{"workers":[{WORKER}],"next_cursor":"wkr-7Q2K9"}}"#)),
        Reply::json(202, r#"{"id":"wkr-7Q2K9","reboot_count":1}"#),
        Reply::json(204, ""),
        Reply::json(
            200,
            r#"{"nodes_total":64,"nodes_allocated":1,"leases_active":1,"workers_active":1,"vms_running":1,"vm_boots_total":1,"reboots_total":1}"#,
        ),
    ])
    .await;
    let c = client(&server);
    let id: WorkerId = "wkr-7Q2K9".parse().unwrap();
    let page = c.list_workers(Some(10), Some("a b&c")).await.unwrap().value;
    assert_eq!((page.workers.len(), page.next_cursor.as_deref()), (1, Some("wkr-7Q2K9")));
    let (reboot_key, delete_key) = (OpKey::new_v4(), OpKey::new_v4());
    assert_eq!(c.reboot_worker(&id, &reboot_key).await.unwrap().value.reboot_count, 1);
    assert_eq!(c.delete_worker(&id, &delete_key).await.unwrap().status, 204);
    assert_eq!(c.fleet().await.unwrap().value.workers_active, 1);
    let seen: Vec<(String, String, Option<String>)> =
        server.seen().into_iter().map(|s| (s.method.to_string(), s.path_and_query, s.key)).collect();
    assert_eq!(
        seen,
        [
            ("GET".into(), "/v1/workers?limit=10&cursor=a+b%26c".into(), None),
            ("POST".into(), "/v1/workers/wkr-7Q2K9/reboot".into(), Some(reboot_key.to_string())),
            ("DELETE".into(), "/v1/workers/wkr-7Q2K9".into(), Some(delete_key.to_string())),
            ("GET".into(), "/admin/v1/fleet".into(), None),
        ]
    );
}

#[tokio::test]
async fn a_success_with_an_unexpected_body_is_a_decode_error() {
    let server = Scripted::start([Reply::json(201, r#"{"id":"wkr-1"}"#)]).await;
    let err = client(&server).create_worker(&request(), &OpKey::new_v4()).await.expect_err("bad body");
    assert!(matches!(err, Error::Decode { .. }), "{err:?}");
    assert_eq!(server.count(), 1, "a decode error must not resend a mutation that succeeded");
}

#[test]
fn fingerprints_follow_method_path_and_body() {
    let id: WorkerId = "wkr-1".parse().unwrap();
    let create = Mutation::CreateWorker(request());
    assert_eq!(create.fingerprint(), Mutation::CreateWorker(request()).fingerprint());
    assert!(create.fingerprint().as_str().starts_with("sha256:"));
    assert_eq!(create.fingerprint().as_str().len(), "sha256:".len() + 64);
    let mut bigger = request();
    bigger.cpu = 128;
    assert_ne!(create.fingerprint(), Mutation::CreateWorker(bigger).fingerprint());
    let mut no_labels = request();
    no_labels.labels = Some(BTreeMap::new());
    assert_ne!(Mutation::CreateWorker(no_labels.clone()).fingerprint(), {
        no_labels.labels = None;
        Mutation::CreateWorker(no_labels).fingerprint()
    });
    assert_ne!(Mutation::DeleteWorker(id.clone()).fingerprint(), Mutation::RebootWorker(id).fingerprint());
}

#[test]
fn debug_output_never_shows_the_token() {
    let builder = Client::builder("https://leasebroker.test", "tok-secret-123");
    assert!(!format!("{builder:?}").contains("tok-secret-123"), "{builder:?}");
    let client = builder.build().expect("client");
    assert!(!format!("{client:?}").contains("tok-secret-123"), "{client:?}");
}

#[test]
fn a_ca_bundle_without_certificates_is_refused() {
    for pem in [&b""[..], b"not a certificate", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"] {
        let err = Client::builder("https://leasebroker.test", "t").ca_certificates_pem(pem).expect_err("no CA in it");
        assert!(matches!(err, Error::InvalidRequest(_)), "{err:?}");
    }
}

#[test]
fn bad_ids_and_urls_are_rejected_at_the_edge() {
    for bad in ["", "../admin", "wkr/1", "wkr 1", "wkr%2F1", "wkr.1"] {
        assert!(bad.parse::<WorkerId>().is_err(), "{bad:?} accepted");
    }
    assert!("wkr-7Q2K9_x".parse::<WorkerId>().is_ok());
    for bad in ["not a url", "ftp://host", "http://host/?q=1", "mailto:x@y"] {
        assert!(matches!(Client::new(bad, "t"), Err(Error::InvalidRequest(_))), "{bad:?} accepted");
    }
}

#[test]
fn responses_are_classified_by_problem_type_then_status() {
    use reqwest::StatusCode;
    use reqwest::header::HeaderMap;
    let problem = |name: &str| format!(r#"{{"type":"https://x.test/p/{name}","title":"t","status":0,"detail":"d"}}"#);
    let mut retry = HeaderMap::new();
    retry.insert("retry-after", "7".parse().unwrap());
    let classify = |status: u16, body: &str, headers: &HeaderMap| {
        Error::from_response(StatusCode::from_u16(status).unwrap(), headers, body.as_bytes())
    };
    let none = HeaderMap::new();
    assert!(classify(201, "", &none).is_none());
    assert!(matches!(classify(400, &problem("idempotency-key-reused"), &none), Some(Error::KeyReused { .. })));
    assert!(matches!(
        classify(409, &problem("request-in-progress"), &retry),
        Some(Error::InProgress { retry_after: Some(d), .. }) if d == Duration::from_secs(7)
    ));
    // A 409 the handler decided is final, not "in progress".
    assert!(matches!(classify(409, &problem("conflict"), &none), Some(Error::Refused { .. })));
    assert!(matches!(classify(409, "not json", &none), Some(Error::Refused { problem: None, .. })));
    assert!(matches!(classify(403, "", &none), Some(Error::Unauthorized { .. })));
    let shed = classify(429, "", &retry).unwrap();
    assert!(shed.is_retryable() && shed.retry_after() == Some(Duration::from_secs(7)));
    assert!(classify(502, &problem("upstream-unavailable"), &none).unwrap().is_retryable());
    assert!(!classify(413, "", &none).unwrap().is_retryable());
}
