//! Firmware flashes and long-running operations against a scripted server: the route, the key,
//! the operation-conflict refusal, and `wait_operation`'s polling.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasebroker_client::retry::{Retrier, RetryPolicy};
use leasebroker_client::{
    Client, Error, FlashFirmware, Mutation, NodeId, OPERATION_CONFLICT, OpKey, OperationId, OperationState,
};

use crate::server::{Reply, Scripted};

fn operation(state: &str) -> String {
    let finished = if state == "running" { "null".to_owned() } else { r#""2026-11-30T21:00:03Z""#.to_owned() };
    let error = if state == "failed" { r#""the BMC refused the image""# } else { "null" };
    format!(
        r#"{{"id":"op-5f1c2a","kind":"firmware-flash","node_id":"node-0007","version":"2.1.0","state":"{state}",
        "error":{error},"created_at":"2026-11-30T21:00:00Z","finished_at":{finished}}}"#
    )
}

fn client(server: &Scripted) -> Client {
    let policy = RetryPolicy::default()
        .with_delays(Duration::from_millis(10), Duration::from_millis(20))
        .with_max_elapsed(Duration::from_secs(10));
    Client::new(&server.url, "tok-admin")
        .expect("client")
        .with_retrier(Retrier::new(policy))
        .with_poll_interval(Duration::from_millis(10))
}

fn node() -> NodeId {
    "node-0007".parse().unwrap()
}

fn op_id() -> OperationId {
    "op-5f1c2a".parse().unwrap()
}

#[tokio::test]
async fn flash_posts_the_version_with_the_key_on_every_attempt() {
    let server = Scripted::start([
        Reply::problem(503, "upstream-unavailable"),
        Reply::json(202, operation("running"))
            .header("location", "/admin/v1/operations/op-5f1c2a")
            .header("idempotent-replayed", "true"),
    ])
    .await;
    let key = OpKey::new_v4();
    let accepted = client(&server).flash_firmware(&node(), &FlashFirmware::new("2.1.0"), &key).await.unwrap();
    assert_eq!((accepted.status.as_u16(), accepted.attempts, accepted.replayed), (202, 2, true));
    assert_eq!(accepted.value.id, op_id());
    assert_eq!(accepted.value.state, OperationState::Running);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!((s.method.as_str(), s.path_and_query.as_str()), ("POST", "/admin/v1/nodes/node-0007/firmware"));
        assert_eq!(s.key.as_deref(), Some(key.as_str()));
        assert_eq!(s.authorization.as_deref(), Some("Bearer tok-admin"));
        assert_eq!(s.content_type.as_deref(), Some("application/json"));
        assert_eq!(&s.body[..], br#"{"version":"2.1.0"}"#);
    }
}

#[tokio::test]
async fn another_flash_on_the_node_is_refused_once_and_named() {
    let conflict = serde_json::json!({
        "type": "/problems/operation-conflict", "title": "Operation conflict", "status": 409,
        "detail": "node node-0007 is being flashed", "operation_id": "op-other1",
    });
    let server = Scripted::start([Reply::json(409, conflict.to_string())]).await;
    let err = client(&server).flash_firmware(&node(), &FlashFirmware::new("2.1.0"), &OpKey::new_v4()).await;
    let err = err.expect_err("409");
    let Error::Refused { status, problem: Some(problem) } = &err else { panic!("{err:?}") };
    assert_eq!(status.as_u16(), 409);
    assert!(problem.is(OPERATION_CONFLICT));
    assert_eq!(problem.operation_id.as_ref().map(OperationId::as_str), Some("op-other1"));
    assert!(err.to_string().contains("(operation op-other1)"), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(server.count(), 1, "an operation conflict was retried");
}

#[tokio::test]
async fn a_problem_with_a_bad_operation_id_keeps_the_rest() {
    let conflict = serde_json::json!({
        "type": "/problems/operation-conflict", "status": 409, "detail": "busy", "operation_id": "../../x",
    });
    let server = Scripted::start([Reply::json(409, conflict.to_string())]).await;
    let err = client(&server).get_operation(&op_id()).await.expect_err("409");
    let problem = err.problem().expect("the problem still parses");
    assert!(problem.is(OPERATION_CONFLICT) && problem.operation_id.is_none(), "{problem:?}");
}

#[tokio::test]
async fn wait_polls_until_the_operation_ends_and_reports_each_state() {
    let server = Scripted::start([
        Reply::json(200, operation("running")),
        Reply::problem(503, "unavailable"), // a transient error while polling: retried
        Reply::json(200, operation("running")),
        Reply::json(200, operation("succeeded")),
        Reply::json(200, operation("running")), // never reached
    ])
    .await;
    let mut states = Vec::new();
    let done = client(&server).wait_operation(&op_id(), |op| states.push(op.state.clone())).await.unwrap();
    assert_eq!(done.value.state, OperationState::Succeeded);
    assert!(done.value.is_finished());
    assert_eq!(states, [OperationState::Running, OperationState::Running, OperationState::Succeeded]);
    let seen = server.seen();
    assert_eq!(seen.len(), 4);
    assert!(seen.iter().all(|s| s.method == "GET" && s.path_and_query == "/admin/v1/operations/op-5f1c2a"));
    assert!(seen.iter().all(|s| s.key.is_none()), "a read carries no key");
}

#[tokio::test]
async fn a_failed_operation_is_an_answer_not_an_error() {
    let server = Scripted::start([Reply::json(200, operation("failed"))]).await;
    let done = client(&server).wait_operation(&op_id(), |_| {}).await.unwrap();
    assert_eq!(done.value.state, OperationState::Failed);
    assert_eq!(done.value.error.as_deref(), Some("the BMC refused the image"));
    assert_eq!(server.count(), 1, "a finished operation is not polled again");
}

#[tokio::test]
async fn wait_honours_retry_after_between_polls() {
    let server = Scripted::start([
        Reply::json(200, operation("running")).header("retry-after", "1"),
        Reply::json(200, operation("succeeded")),
    ])
    .await;
    let start = Instant::now();
    client(&server).wait_operation(&op_id(), |_| {}).await.unwrap();
    // The client polls every 10 ms; the server asked for 1 s.
    assert!(start.elapsed() >= Duration::from_secs(1), "polled again after {:?}", start.elapsed());
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn wait_on_an_unknown_operation_is_refused_at_once() {
    let server = Scripted::start([Reply::problem(404, "not-found")]).await;
    let mut polls = 0;
    let err = client(&server).wait_operation(&op_id(), |_| polls += 1).await.expect_err("404");
    assert!(matches!(&err, Error::Refused { status, .. } if status.as_u16() == 404), "{err:?}");
    assert_eq!((polls, server.count()), (0, 1));
}

#[tokio::test]
async fn wait_gives_up_when_one_poll_spends_the_budget() {
    let server = Scripted::start([Reply::json(200, operation("running")), Reply::problem(503, "unavailable")]).await;
    let policy = RetryPolicy::default()
        .with_delays(Duration::from_millis(10), Duration::from_millis(50))
        .with_max_elapsed(Duration::from_millis(500));
    let client = client(&server).with_retrier(Retrier::new(policy));
    let seen = Arc::new(Mutex::new(0));
    let counter = seen.clone();
    let err = client.wait_operation(&op_id(), move |_| *counter.lock().unwrap() += 1).await.expect_err("gave up");
    assert!(matches!(err, Error::GaveUp { .. }), "{err:?}");
    assert_eq!(*seen.lock().unwrap(), 1);
    assert!(server.count() >= 3, "the 503s were not retried: {}", server.count());
}

#[tokio::test]
async fn an_unexpected_body_ends_the_wait() {
    let server = Scripted::start([Reply::json(200, r#"{"id":"op-5f1c2a"}"#)]).await;
    let err = client(&server).wait_operation(&op_id(), |_| {}).await.expect_err("bad body");
    assert!(matches!(err, Error::Decode { .. }), "{err:?}");
}

#[test]
fn a_flash_fingerprint_follows_node_and_version() {
    let flash = |node: &str, version: &str| Mutation::FlashFirmware {
        node_id: node.parse().unwrap(),
        request: FlashFirmware::new(version),
    };
    assert_eq!(flash("node-1", "2.1.0").fingerprint(), flash("node-1", "2.1.0").fingerprint());
    assert_ne!(flash("node-1", "2.1.0").fingerprint(), flash("node-2", "2.1.0").fingerprint());
    assert_ne!(flash("node-1", "2.1.0").fingerprint(), flash("node-1", "2.2.0").fingerprint());
}
