//! The `uncertain` outcome: a handler that does not know whether its request acted, stale claims
//! that become uncertain instead of running again, and what a retry of an uncertain record gets
//! (hold, resend, probe). Every handler and probe counts its own calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use futures::future::BoxFuture;
use http::StatusCode;
use idempotency::faulty::{FaultyStore, Op};
use idempotency::{MemoryStore, Record, RecordState, Store};
use idempotency_tower::{IdempotencyLayerBuilder, OnUncertain, OutcomeUncertain, Probe, Probed, StaleClaims};

use crate::fixture::{Answer, builder_for_p, post_key, scope, send, wait_until};

const PROBLEM: &str = "/problems/outcome-uncertain";

/// A route whose handler counts its calls; the first `unsure` calls lose their answer
/// ([`OutcomeUncertain`]), the later ones answer `201 call <n>`. Each call takes `delay`.
fn unsure_app(builder: IdempotencyLayerBuilder, unsure: usize, delay: Duration) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            "/v1/send",
            post(move || async move {
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(delay).await;
                if n <= unsure {
                    let mut res = StatusCode::GATEWAY_TIMEOUT.into_response();
                    res.extensions_mut().insert(OutcomeUncertain);
                    return res;
                }
                (StatusCode::CREATED, [("content-type", "text/plain")], format!("call {n}")).into_response()
            }),
        )
        .layer(builder.build());
    (app, calls)
}

fn problem(a: &Answer) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&a.body).expect("problem body");
    assert_eq!(a.problem_type(), PROBLEM, "{a:?}");
    v
}

/// `n` requests with key `key` at once.
async fn together(app: &Router, key: &'static str, n: usize) -> Vec<Answer> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, post_key("/v1/send", key)).await })
        })
        .collect();
    futures::future::join_all(tasks).await.into_iter().map(|r| r.expect("task")).collect()
}

async fn state_of(store: &dyn Store, key: &str) -> Record {
    store.get(&scope("/v1/send", key)).await.expect("get").expect("the record")
}

/// The handler's lost answer: `504 outcome-uncertain` naming the record, the record uncertain;
/// 32 concurrent retries under the default rule are all held with `409` naming the same record,
/// and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_504_and_every_retry_is_held_without_running_again() {
    let store = Arc::new(MemoryStore::new());
    let (app, calls) = unsure_app(builder_for_p(store.clone()), usize::MAX, Duration::ZERO);
    let first = send(&app, post_key("/v1/send", "k1")).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    let record = state_of(&*store, "k1").await;
    assert_eq!(record.state, RecordState::Uncertain);
    let id = record.record_id.to_hex();
    let p = problem(&first);
    assert!(p["detail"].as_str().expect("detail").contains(&id), "{p}");
    assert_eq!(p["record_id"], id.as_str());
    assert!(first.headers.contains_key("idempotency-key-expires"));

    let retries = together(&app, "k1", 32).await;
    for r in &retries {
        assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
        assert!(problem(r)["detail"].as_str().expect("detail").contains(&id));
        assert!(r.headers.contains_key("idempotency-key-expires"), "{r:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "an uncertain request never runs again on a guess");
    assert_eq!(state_of(&*store, "k1").await.state, RecordState::Uncertain);
}

/// The response of a held retry carries the outcome `uncertain` for the layers outside.
#[tokio::test]
async fn a_held_retry_is_counted_as_uncertain() {
    use tower::ServiceExt;
    let store = Arc::new(MemoryStore::new());
    let (app, _) = unsure_app(builder_for_p(store.clone()), usize::MAX, Duration::ZERO);
    for _ in 0..2 {
        let res: Response = app.clone().oneshot(post_key("/v1/send", "k1")).await.expect("infallible");
        let outcome = res.extensions().get::<idempotency_tower::Outcome>().copied();
        assert_eq!(outcome, Some(idempotency_tower::Outcome("uncertain")), "{res:?}");
    }
}

/// Under `resend`, 32 concurrent retries of an uncertain record run the handler exactly once more
/// (one take-over wins), and every later retry replays that run's response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resend_runs_an_uncertain_record_again_exactly_once() {
    let store = Arc::new(MemoryStore::new());
    let builder = builder_for_p(store.clone()).on_uncertain(OnUncertain::Resend);
    let (app, calls) = unsure_app(builder, 1, Duration::from_millis(50));
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::GATEWAY_TIMEOUT);
    let retries = together(&app, "k1", 32).await;
    let ran: Vec<_> = retries.iter().filter(|r| r.status == StatusCode::CREATED && !r.replayed()).collect();
    assert_eq!(ran.len(), 1, "exactly one retry runs it: {retries:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    for r in retries.iter().filter(|r| r.status != StatusCode::CREATED) {
        assert_eq!(r.status, StatusCode::CONFLICT, "the others wait on the run in flight: {r:?}");
    }
    let replay = send(&app, post_key("/v1/send", "k1")).await;
    assert_eq!((replay.status, replay.replayed(), replay.text()), (StatusCode::CREATED, true, "call 2"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A request's own rule (put in its extensions by a middleware before the layer) wins over the
/// layer's: the same uncertain record is held for one request and resent for another.
#[tokio::test]
async fn a_request_extension_chooses_the_rule() {
    let store = Arc::new(MemoryStore::new());
    let (app, calls) = unsure_app(builder_for_p(store.clone()), 1, Duration::ZERO);
    let app = app.layer(axum::middleware::map_request(|mut req: http::Request<axum::body::Body>| async move {
        if req.headers().contains_key("x-resend") {
            req.extensions_mut().insert(OnUncertain::Resend);
        }
        req
    }));
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::CONFLICT);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let mut resend = post_key("/v1/send", "k1");
    resend.headers_mut().insert("x-resend", http::HeaderValue::from_static("1"));
    let ran = send(&app, resend).await;
    assert_eq!((ran.status, ran.text()), (StatusCode::CREATED, "call 2"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A probe that answers as told, counting its calls.
struct Told {
    answer: fn() -> Probed,
    calls: AtomicUsize,
}

impl Probe for Told {
    fn probe<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Probed> {
        assert_eq!(record.state, RecordState::Uncertain);
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move { (self.answer)() })
    }
}

fn told(answer: fn() -> Probed) -> Arc<Told> {
    Arc::new(Told { answer, calls: AtomicUsize::new(0) })
}

/// A probe that finds the request happened: its response is stored and replayed, to this retry
/// and every later one (asked once); the handler does not run again.
#[tokio::test]
async fn a_probe_that_found_it_happened_resolves_and_replays() {
    let store = Arc::new(MemoryStore::new());
    let probe = told(|| {
        let mut res = http::Response::new(Bytes::from_static(b"{\"id\":\"order-1\"}"));
        res.headers_mut().insert("content-type", http::HeaderValue::from_static("application/json"));
        Probed::Happened(res)
    });
    let builder = builder_for_p(store.clone()).on_uncertain(OnUncertain::Probe(probe.clone()));
    let (app, calls) = unsure_app(builder, usize::MAX, Duration::ZERO);
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::GATEWAY_TIMEOUT);
    for _ in 0..2 {
        let r = send(&app, post_key("/v1/send", "k1")).await;
        assert_eq!((r.status, r.replayed(), r.text()), (StatusCode::OK, true, "{\"id\":\"order-1\"}"));
        assert_eq!(r.headers["content-type"], "application/json");
        assert!(r.headers.contains_key("idempotency-key-expires"));
    }
    assert_eq!(probe.calls.load(Ordering::SeqCst), 1, "a resolved record is replayed without asking again");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(state_of(&*store, "k1").await.state, RecordState::Completed);
}

/// A probe that finds it never happened: the handler runs again, once.
#[tokio::test]
async fn a_probe_that_found_it_never_happened_runs_it_again() {
    let store = Arc::new(MemoryStore::new());
    let probe = told(|| Probed::NeverHappened);
    let builder = builder_for_p(store.clone()).on_uncertain(OnUncertain::Probe(probe.clone()));
    let (app, calls) = unsure_app(builder, 1, Duration::ZERO);
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::GATEWAY_TIMEOUT);
    let r = send(&app, post_key("/v1/send", "k1")).await;
    assert_eq!((r.status, r.replayed(), r.text()), (StatusCode::CREATED, false, "call 2"));
    let r = send(&app, post_key("/v1/send", "k1")).await;
    assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, true));
    assert_eq!((calls.load(Ordering::SeqCst), probe.calls.load(Ordering::SeqCst)), (2, 1));
}

/// A probe that cannot tell: `503 outcome-uncertain` with `Retry-After`, nothing runs, the record
/// stays uncertain and the next retry asks again.
#[tokio::test]
async fn a_probe_that_cannot_tell_answers_503_and_asks_again_next_time() {
    let store = Arc::new(MemoryStore::new());
    let probe = told(|| Probed::Unknown);
    let builder = builder_for_p(store.clone()).on_uncertain(OnUncertain::Probe(probe.clone()));
    let (app, calls) = unsure_app(builder, usize::MAX, Duration::ZERO);
    assert_eq!(send(&app, post_key("/v1/send", "k1")).await.status, StatusCode::GATEWAY_TIMEOUT);
    for _ in 0..2 {
        let r = send(&app, post_key("/v1/send", "k1")).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        problem(&r);
        assert!(r.headers.contains_key("retry-after"), "{r:?}");
    }
    assert_eq!((calls.load(Ordering::SeqCst), probe.calls.load(Ordering::SeqCst)), (1, 2));
    assert_eq!(state_of(&*store, "k1").await.state, RecordState::Uncertain);
}

/// A hung attempt whose claim goes stale (its heartbeats fail), then 32 concurrent retries.
/// Returns the answers, the handler's calls, and the store.
async fn stale_then_retried(rule: StaleClaims) -> (Vec<Answer>, usize, Arc<FaultyStore<MemoryStore>>) {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    store.fail_always(Op::Heartbeat);
    let calls = Arc::new(AtomicUsize::new(0));
    let hang = Arc::new(tokio::sync::Notify::new());
    let (c, h) = (calls.clone(), hang.clone());
    let app = Router::new()
        .route(
            "/v1/send",
            post(move || async move {
                if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    h.notified().await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                (StatusCode::CREATED, "sent")
            }),
        )
        .layer(builder_for_p(store.clone()).in_flight_ttl(Duration::from_millis(300)).stale_claims(rule).build());
    let a2 = app.clone();
    let _hung = tokio::spawn(async move { send(&a2, post_key("/v1/send", "k1")).await });
    wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
    let started_at = state_of(store.inner(), "k1").await.started_at;
    wait_until("the claim is stale", Duration::from_secs(60), async || {
        idempotency::now() >= started_at + chrono::Duration::milliseconds(300)
    })
    .await;
    let answers = together(&app, "k1", 32).await;
    hang.notify_one();
    (answers, calls.load(Ordering::SeqCst), store)
}

/// Under `StaleClaims::Uncertain`, a dead attempt's stale claim becomes uncertain (one of 32
/// concurrent retries marks it) and nothing runs it again: every retry is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_claim_becomes_uncertain_and_never_runs_again() {
    let (answers, calls, store) = stale_then_retried(StaleClaims::Uncertain).await;
    for a in &answers {
        assert_eq!(a.status, StatusCode::CONFLICT, "{a:?}");
        problem(a);
    }
    assert_eq!(calls, 1, "the dead attempt is not run again");
    assert!(store.calls(Op::MarkStaleUncertain) >= 1);
    assert_eq!(state_of(store.inner(), "k1").await.state, RecordState::Uncertain);
}

/// The default rule is unchanged: the stale claim is taken over and the handler runs again,
/// once for 32 concurrent retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_stale_claim_is_reclaimed_and_runs_again_once() {
    let (answers, calls, store) = stale_then_retried(StaleClaims::Reclaim).await;
    assert_eq!(calls, 2, "one retry took the stale claim over: {answers:?}");
    assert!(answers.iter().any(|a| a.status == StatusCode::CREATED && !a.replayed()), "{answers:?}");
    assert_eq!(store.calls(Op::MarkStaleUncertain), 0);
}
