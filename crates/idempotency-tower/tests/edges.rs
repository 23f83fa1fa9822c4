//! Nothing lost at the edges: aliased paths, failed completions, handlers slower than the
//! in-flight TTL, keys with commas, requests without a principal, responses too large to store.
//! An axum Router driven through `oneshot`; every handler counts its own side effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::faulty::{FaultyStore, Op};
use idempotency::{Endpoint, IdempotencyKey, MemoryStore, Principal, RecordState, Scope, Store};
use idempotency_tower::{IdempotencyLayer, IdempotencyLayerBuilder};
use tower::ServiceExt;

/// A response, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }

    fn problem_type(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json", "{self:?}");
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem body is JSON");
        assert_eq!(v["status"], self.status.as_u16(), "{v}");
        v["type"].as_str().expect("type").to_owned()
    }

    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("utf-8 body")
    }
}

async fn send(app: &Router, req: Request<Body>) -> Answer {
    let res = app.clone().oneshot(req).await.expect("infallible");
    let (parts, body) = res.into_parts();
    Answer { status: parts.status, headers: parts.headers, body: body.collect().await.expect("body").to_bytes() }
}

fn post_req(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .expect("request")
}

/// Every request runs as principal `p`.
fn layer(store: Arc<dyn Store>) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store).principal(|_| Some(Principal::new("p")))
}

fn scope(path: &str, key: &str) -> Scope {
    Scope::new(Principal::new("p"), Endpoint::new("POST", path), IdempotencyKey::try_from(key).expect("key"))
}

/// A handler that counts its calls and answers `201 call <n>` after `delay`.
fn counting(path: &str, delay: Duration, layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            path,
            post(move || async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                (StatusCode::CREATED, [("content-type", "text/plain")], format!("call {n}"))
            }),
        )
        .layer(layer);
    (app, calls)
}

/// Polls `cond` every 20 ms until it holds; panics after a generous `timeout`.
async fn wait_until(what: &str, timeout: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Issue 12 item 1: the scope's endpoint is the normalized path, so every spelling of one path
/// is one record (and one fingerprint).
mod aliased_paths {
    use super::*;

    #[tokio::test]
    async fn every_spelling_of_one_path_is_one_record() {
        let (app, calls) =
            counting("/v1/workers/{id}/reboot", Duration::ZERO, layer(Arc::new(MemoryStore::new())).build());
        let first = send(&app, post_req("/v1/workers/wkr-1/reboot", "k1")).await;
        assert_eq!((first.status, first.replayed()), (StatusCode::CREATED, false));
        for alias in [
            "/v1/workers/%77kr-1/reboot",
            "/v1/workers/wkr%2D1/reboot",
            "/v1/workers/wkr%2d1/reboot",
            "/v1/workers/wkr-1/%72eboot",
            "/v1/%77orkers/wkr-1/reboot",
        ] {
            let again = send(&app, post_req(alias, "k1")).await;
            assert_eq!(
                (again.status, again.replayed(), again.text()),
                (StatusCode::CREATED, true, "call 0"),
                "{alias}"
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one reboot per key, whatever the spelling");
        // Another worker is another record.
        let other = send(&app, post_req("/v1/workers/wkr-2/reboot", "k1")).await;
        assert_eq!((other.status, other.replayed()), (StatusCode::CREATED, false));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_changed_body_on_an_aliased_path_is_still_a_mismatch() {
        let (app, calls) =
            counting("/v1/workers/{id}/reboot", Duration::ZERO, layer(Arc::new(MemoryStore::new())).build());
        send(&app, post_req("/v1/workers/wkr-1/reboot", "k1")).await;
        let mut changed = post_req("/v1/workers/%77kr-1/reboot", "k1");
        *changed.body_mut() = Body::from("{\"force\":true}");
        let refused = send(&app, changed).await;
        assert_eq!(refused.problem_type(), "/problems/idempotency-key-reused");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// Issue 12 item 8: a bare key with a comma could be two header lines merged into one.
mod commas {
    use super::*;

    #[tokio::test]
    async fn a_bare_key_with_a_comma_is_refused_a_quoted_one_is_taken() {
        let (app, calls) = counting("/v1/things", Duration::ZERO, layer(Arc::new(MemoryStore::new())).build());
        for bare in ["a,b", "a,", ",b", "k1,k2"] {
            let r = send(&app, post_req("/v1/things", bare)).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bare}");
            assert_eq!(r.problem_type(), "/problems/idempotency-key-invalid");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        let quoted = send(&app, post_req("/v1/things", r#""a,b""#)).await;
        assert_eq!((quoted.status, quoted.replayed()), (StatusCode::CREATED, false));
        let again = send(&app, post_req("/v1/things", r#""a,b""#)).await;
        assert!(again.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// Issue 17 item 6: no principal, no record, unless the service opted in.
mod anonymous {
    use super::*;

    #[tokio::test]
    async fn a_request_without_a_principal_is_refused_by_default() {
        let (app, calls) = counting("/v1/things", Duration::ZERO, IdempotencyLayer::new(Arc::new(MemoryStore::new())));
        for _ in 0..2 {
            let r = send(&app, post_req("/v1/things", "k1")).await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED);
            assert_eq!(r.problem_type(), "/problems/principal-missing");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "never run unscoped");
    }

    #[tokio::test]
    async fn a_shared_anonymous_scope_is_an_explicit_opt_in() {
        let layer =
            IdempotencyLayer::builder(Arc::new(MemoryStore::new())).allow_anonymous(Principal::new("anyone")).build();
        let (app, calls) = counting("/v1/things", Duration::ZERO, layer);
        assert!(!send(&app, post_req("/v1/things", "k1")).await.replayed());
        assert!(send(&app, post_req("/v1/things", "k1")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// Issue 12 item 2: a store error at `complete` after the handler ran does not lose the result.
mod failed_completion {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_is_retried_until_it_is_stored_and_the_retry_replays() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        store.fail_next(Op::Complete, 3);
        let (app, calls) = counting("/v1/things", Duration::ZERO, layer(store.clone()).build());
        let first = send(&app, post_req("/v1/things", "k1")).await;
        // The client has its answer at once, though the store refused it.
        assert_eq!((first.status, first.replayed(), first.text()), (StatusCode::CREATED, false, "call 0"));
        let s = scope("/v1/things", "k1");
        wait_until("the response is stored", Duration::from_secs(60), async || {
            store.inner().get(&s).await.expect("get").is_some_and(|r| r.state == RecordState::Completed)
        })
        .await;
        assert_eq!(store.calls(Op::Complete), 4, "three failures, then stored");
        let retry = send(&app, post_req("/v1/things", "k1")).await;
        assert_eq!((retry.status, retry.replayed(), retry.text()), (StatusCode::CREATED, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_every_retry_fails_the_record_stays_in_flight_until_its_ttl() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        // The first completion and both retries fail; the next one (a later attempt's) works.
        store.fail_next(Op::Complete, 3);
        let ttl = Duration::from_secs(2);
        let built = layer(store.clone()).in_flight_ttl(ttl).completion_retries(2, Duration::from_millis(10)).build();
        let (app, calls) = counting("/v1/things", Duration::ZERO, built);
        assert_eq!(send(&app, post_req("/v1/things", "k1")).await.status, StatusCode::CREATED);
        wait_until("every retry ran", Duration::from_secs(60), async || store.calls(Op::Complete) >= 3).await;
        let s = scope("/v1/things", "k1");
        let record = store.inner().get(&s).await.expect("get").expect("record");
        assert_eq!(record.state, RecordState::InFlight, "not completed, not failed: the side effects happened");
        // Before the TTL: the key is busy, the handler does not run again.
        let busy = send(&app, post_req("/v1/things", "k1")).await;
        assert_eq!(busy.problem_type(), "/problems/request-in-progress");
        assert_eq!((calls.load(Ordering::SeqCst), store.calls(Op::Complete)), (1, 3), "bounded: no more retries");
        // After it, the next retry takes the key over and runs again (a real handler resumes
        // through its sub-keys), and this time the response is stored.
        let stale_at = record.started_at + chrono::Duration::from_std(ttl).expect("ttl");
        wait_until("the claim is stale", Duration::from_secs(60), async || idempotency::now() >= stale_at).await;
        let resumed = send(&app, post_req("/v1/things", "k1")).await;
        assert_eq!((resumed.status, resumed.replayed(), resumed.text()), (StatusCode::CREATED, false, "call 1"));
        assert!(send(&app, post_req("/v1/things", "k1")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// Issue 12 item 10: a handler that runs longer than the in-flight TTL keeps its claim.
mod slow_handlers {
    use super::*;

    /// The handler runs three times the TTL while retries arrive: it runs once, every retry
    /// meanwhile is `409 request-in-progress`, and afterwards the retry replays.
    async fn a_handler_slower_than_the_ttl_runs_once(store: Arc<dyn Store>) {
        let ttl = Duration::from_secs(1);
        let (app, calls) = counting("/v1/slow", 3 * ttl, layer(store).in_flight_ttl(ttl).build());
        let a2 = app.clone();
        let first = tokio::spawn(async move { send(&a2, post_req("/v1/slow", "k1")).await });
        wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
        let started = Instant::now();
        let mut busy = 0;
        let mut latest_busy = Duration::ZERO;
        while !first.is_finished() {
            let r = send(&app, post_req("/v1/slow", "k1")).await;
            if r.status == StatusCode::CREATED && r.replayed() {
                break; // it finished between the check and this request
            }
            assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
            assert_eq!(r.problem_type(), "/problems/request-in-progress");
            busy += 1;
            latest_busy = started.elapsed();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(busy >= 5, "only {busy} retries overlapped the handler");
        assert!(latest_busy > 2 * ttl, "no retry arrived after the TTL ({latest_busy:?}): the test proves nothing");
        let first = first.await.expect("task");
        assert_eq!((first.status, first.replayed(), first.text()), (StatusCode::CREATED, false, "call 0"));
        let replay = send(&app, post_req("/v1/slow", "k1")).await;
        assert_eq!((replay.status, replay.replayed(), replay.text()), (StatusCode::CREATED, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one execution");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        a_handler_slower_than_the_ttl_runs_once(Arc::new(MemoryStore::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = idempotency_sqlx::SqliteStore::connect(dir.path().join("idem.db").to_str().expect("path"))
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        a_handler_slower_than_the_ttl_runs_once(Arc::new(store)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some(db) = idempotency_sqlx::testing::TestDatabase::create().await else { return };
        let store = idempotency_sqlx::PostgresStore::connect(db.url()).await.expect("connect");
        store.migrate().await.expect("migrate");
        a_handler_slower_than_the_ttl_runs_once(Arc::new(store)).await;
    }

    /// A claim that nobody renews (its heartbeats fail, as a dead process's would) still goes
    /// stale and is taken over; the late completion of the old attempt is fenced off.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unrenewed_claim_goes_stale_and_its_late_completion_is_fenced() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(tokio::sync::Notify::new());
        let (c, r) = (calls.clone(), release.clone());
        let app = Router::new()
            .route(
                "/v1/op",
                post(move || async move {
                    if c.fetch_add(1, Ordering::SeqCst) == 0 {
                        r.notified().await;
                        (StatusCode::CREATED, "first attempt")
                    } else {
                        (StatusCode::CREATED, "second attempt")
                    }
                }),
            )
            .layer(layer(store.clone()).in_flight_ttl(Duration::from_millis(300)).build());
        store.fail_always(Op::Heartbeat);
        let a2 = app.clone();
        let slow = tokio::spawn(async move { send(&a2, post_req("/v1/op", "k1")).await });
        wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
        let s = scope("/v1/op", "k1");
        let started_at = store.inner().get(&s).await.expect("get").expect("record").started_at;
        wait_until("a heartbeat was tried", Duration::from_secs(60), async || store.calls(Op::Heartbeat) >= 1).await;
        wait_until("the claim is stale", Duration::from_secs(60), async || {
            idempotency::now() >= started_at + chrono::Duration::milliseconds(300)
        })
        .await;
        let second = send(&app, post_req("/v1/op", "k1")).await;
        assert_eq!((second.status, second.replayed(), second.text()), (StatusCode::CREATED, false, "second attempt"));
        release.notify_one();
        assert_eq!(slow.await.expect("task").text(), "first attempt", "the slow client still gets its own response");
        let replay = send(&app, post_req("/v1/op", "k1")).await;
        assert_eq!((replay.replayed(), replay.text()), (true, "second attempt"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// Issue 17 item 3: a stored response is bounded; a larger one still reaches its client whole,
/// and a retry gets a clear final answer instead of a second execution.
mod large_responses {
    use super::*;

    fn big_app(
        store: Arc<dyn Store>,
        status: StatusCode,
        size: usize,
        builder: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
    ) -> (Router, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/big",
                post(move || async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    // Sent in 64 KiB chunks, as a streaming handler would.
                    let chunks = (0..size.div_ceil(65536)).map(move |i| {
                        let len = 65536.min(size - i * 65536);
                        Ok::<_, std::io::Error>(Bytes::from(vec![b'a' + (i % 26) as u8; len]))
                    });
                    (
                        status,
                        [("content-type", "application/octet-stream")],
                        Body::from_stream(futures::stream::iter(chunks)),
                    )
                }),
            )
            .layer(builder(layer(store)).build());
        (app, calls)
    }

    fn expected(size: usize) -> Vec<u8> {
        (0..size).map(|i| b'a' + ((i / 65536) % 26) as u8).collect()
    }

    #[tokio::test]
    async fn a_response_above_the_limit_reaches_its_client_and_a_retry_gets_410() {
        let store = Arc::new(MemoryStore::new());
        // Above the default limit of 1 MiB.
        let size = 2 * 1024 * 1024 + 7;
        let (app, calls) = big_app(store.clone(), StatusCode::CREATED, size, |b| b);
        let first = send(&app, post_req("/v1/big", "k1")).await;
        assert_eq!((first.status, first.replayed()), (StatusCode::CREATED, false));
        assert_eq!(first.body.len(), size);
        assert!(first.body == expected(size), "the client gets the whole response, byte for byte");
        for _ in 0..2 {
            let retry = send(&app, post_req("/v1/big", "k1")).await;
            assert_eq!((retry.status, retry.replayed()), (StatusCode::GONE, true));
            assert_eq!(retry.problem_type(), "/problems/response-too-large");
            assert!(retry.body.len() < 1024, "the stored problem is short");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "never executed twice");
        let stored = store.get(&scope("/v1/big", "k1")).await.expect("get").expect("record");
        assert!(stored.response.expect("stored").body.stored_bytes().len() < 1024);
    }

    #[tokio::test]
    async fn the_limit_is_configurable_and_a_response_at_the_limit_is_stored() {
        let (app, calls) =
            big_app(Arc::new(MemoryStore::new()), StatusCode::CREATED, 100_000, |b| b.max_stored_response(100_000));
        assert_eq!(send(&app, post_req("/v1/big", "k1")).await.body.len(), 100_000);
        let replay = send(&app, post_req("/v1/big", "k1")).await;
        assert_eq!((replay.status, replay.replayed()), (StatusCode::CREATED, true));
        assert!(replay.body == expected(100_000));

        let (app, calls2) =
            big_app(Arc::new(MemoryStore::new()), StatusCode::CREATED, 100_001, |b| b.max_stored_response(100_000));
        assert!(send(&app, post_req("/v1/big", "k1")).await.body == expected(100_001));
        assert_eq!(send(&app, post_req("/v1/big", "k1")).await.status, StatusCode::GONE);
        assert_eq!((calls.load(Ordering::SeqCst), calls2.load(Ordering::SeqCst)), (1, 1));
    }

    /// A body whose size is known up front (a `Vec`; the layer refuses to store it before reading
    /// any of it) still reaches the client whole, and the retry gets the 410.
    #[tokio::test]
    async fn a_body_of_known_size_above_the_limit_still_reaches_its_client() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/big",
                post(move || async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::OK, vec![b'x'; 200_000])
                }),
            )
            .layer(layer(Arc::new(MemoryStore::new())).max_stored_response(100_000).build());
        let first = send(&app, post_req("/v1/big", "k1")).await;
        assert_eq!((first.status, first.body.len()), (StatusCode::OK, 200_000));
        assert!(first.body.iter().all(|&b| b == b'x'));
        let retry = send(&app, post_req("/v1/big", "k1")).await;
        assert_eq!((retry.status, retry.problem_type().as_str()), (StatusCode::GONE, "/problems/response-too-large"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_large_response_that_is_not_stored_passes_through_and_reruns() {
        let (app, calls) =
            big_app(Arc::new(MemoryStore::new()), StatusCode::BAD_GATEWAY, 300_000, |b| b.max_stored_response(1000));
        for n in 1..=2 {
            let r = send(&app, post_req("/v1/big", "k1")).await;
            assert_eq!((r.status, r.replayed()), (StatusCode::BAD_GATEWAY, false));
            assert!(r.body == expected(300_000));
            assert_eq!(calls.load(Ordering::SeqCst), n, "a 5xx is never stored: the retry runs again");
        }
    }
}

mod inner_service {
    use super::*;
    use tower::Layer;

    /// As with tower-http's services, the wrapped service can be read, changed and taken back.
    #[tokio::test]
    async fn the_inner_service_is_reachable() {
        let mut service = layer(Arc::new(MemoryStore::new())).build().layer(vec![1]);
        service.get_mut().push(2);
        assert_eq!(service.get_ref(), &[1, 2]);
        assert_eq!(service.into_inner(), [1, 2]);
    }
}
