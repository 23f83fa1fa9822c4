//! Attempts that overlap or go away: racing duplicates, client disconnects, handlers slower than
//! the in-flight TTL, expiry, and completions the store fails to record.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use http::StatusCode;
use idempotency::faulty::{FaultyStore, Op};
use idempotency::{MemoryStore, RecordState, Store};
use idempotency_tower::{DEFAULT_RETENTION, IdempotencyLayer};

use crate::fixture::*;

mod duplicates {
    use super::*;

    fn slow_app(layer: IdempotencyLayer, delay: Duration) -> (Router, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/slow",
                post(move || async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(delay).await;
                    (StatusCode::CREATED, format!("call {n}"))
                }),
            )
            .layer(layer);
        (app, calls)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixty_four_concurrent_duplicates_run_the_handler_once() {
        let (app, calls) = slow_app(builder(&store()).build(), Duration::from_millis(200));
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (app, barrier) = (app.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    send(&app, post_req("/v1/slow", Some("dup"), "{\"n\":1}")).await
                })
            })
            .collect();
        let (mut executed, mut in_progress) = (0, 0);
        for t in tasks {
            let a = t.await.unwrap();
            match a.status {
                StatusCode::CREATED => {
                    assert_eq!(a.text(), "call 0");
                    if !a.replayed() {
                        executed += 1;
                    }
                }
                StatusCode::CONFLICT => {
                    assert_eq!(a.problem_type(), "/problems/request-in-progress");
                    let secs: u64 = a.headers["retry-after"].to_str().unwrap().parse().unwrap();
                    assert!((1..=300).contains(&secs));
                    in_progress += 1;
                }
                s => panic!("unexpected {s}: {a:?}"),
            }
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(executed, 1);
        assert!(in_progress >= 1, "the 200 ms handler must have overlapped some duplicates");
        assert!(send(&app, post_req("/v1/slow", Some("dup"), "{\"n\":1}")).await.replayed());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_wait_replays_a_response_that_completes_in_time() {
        let (app, calls) =
            slow_app(builder(&store()).wait_for_in_flight(Duration::from_secs(3)).build(), Duration::from_millis(300));
        let a2 = app.clone();
        let first = tokio::spawn(async move { send(&a2, post_req("/v1/slow", Some("k1"), "{}")).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let waited = send(&app, post_req("/v1/slow", Some("k1"), "{}")).await;
        assert_eq!((waited.status, waited.replayed(), waited.text()), (StatusCode::CREATED, true, "call 0"));
        assert!(!first.await.unwrap().replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_wait_gives_up_with_409() {
        let (app, calls) = slow_app(
            builder(&store()).wait_for_in_flight(Duration::from_millis(100)).build(),
            Duration::from_millis(600),
        );
        let a2 = app.clone();
        let first = tokio::spawn(async move { send(&a2, post_req("/v1/slow", Some("k1"), "{}")).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = std::time::Instant::now();
        let waited = send(&app, post_req("/v1/slow", Some("k1"), "{}")).await;
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert_eq!(waited.status, StatusCode::CONFLICT);
        assert_eq!(waited.problem_type(), "/problems/request-in-progress");
        first.await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_claim_is_taken_over_and_the_late_completion_is_fenced_off() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move || async move {
                    if c.fetch_add(1, Ordering::SeqCst) == 0 {
                        // Outlives its 200 ms claim.
                        tokio::time::sleep(Duration::from_millis(700)).await;
                        (StatusCode::CREATED, "first attempt")
                    } else {
                        (StatusCode::CREATED, "second attempt")
                    }
                }),
            )
            .layer(
                IdempotencyLayer::builder(unrenewed(MemoryStore::new()))
                    .allow_anonymous(idempotency::Principal::new("a"))
                    .in_flight_ttl(Duration::from_millis(200))
                    .build(),
            );
        let a2 = app.clone();
        let slow = tokio::spawn(async move { send(&a2, post_req("/v1/op", Some("k1"), "{}")).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let early = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!(early.status, StatusCode::CONFLICT, "a fresh claim is honoured");
        tokio::time::sleep(Duration::from_millis(250)).await;
        let second = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((second.status, second.replayed(), second.text()), (StatusCode::CREATED, false, "second attempt"));
        let first = slow.await.unwrap();
        assert_eq!(first.text(), "first attempt", "the slow client still gets its own response");
        let replay = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((replay.replayed(), replay.text()), (true, "second attempt"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// Over a real socket: a client that goes away must not cut the handler short.
mod disconnect {
    use super::*;
    use idempotency_tower::RoutePolicy;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::Notify;

    fn raw_post(path: &str, key: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nhost: test\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\n\
             content-length: 2\r\nconnection: close\r\n\r\n{{}}"
        )
    }

    /// Sends a request and reads the whole response; returns the status, the head and the body.
    async fn roundtrip(addr: std::net::SocketAddr, req: &str) -> (u16, String, String) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.unwrap();
        let text = String::from_utf8(buf).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_ascii_lowercase(), body.to_owned())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_disconnected_clients_handler_finishes_and_the_retry_replays() {
        let effects = Arc::new(AtomicUsize::new(0));
        let started = Arc::new(Notify::new());
        let handler = {
            let (effects, started) = (effects.clone(), started.clone());
            move || async move {
                effects.fetch_add(1, Ordering::SeqCst); // side effect one
                started.notify_one();
                tokio::time::sleep(Duration::from_millis(300)).await;
                effects.fetch_add(1, Ordering::SeqCst); // side effect two
                (StatusCode::CREATED, "both done")
            }
        };
        let layer = builder(&store())
            .policy(|_, path| if path == "/v1/unprotected" { RoutePolicy::Off } else { RoutePolicy::Required })
            .build();
        let app =
            Router::new().route("/v1/slow", post(handler.clone())).route("/v1/unprotected", post(handler)).layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });

        // Control: without the layer's protection the server drops the handler when the client
        // leaves, so the test below would catch a layer that ran the handler inline.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(raw_post("/v1/unprotected", "k0").as_bytes()).await.unwrap();
        started.notified().await;
        drop(s);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(effects.load(Ordering::SeqCst), 1, "an unprotected handler is cut between its side effects");

        effects.store(0, Ordering::SeqCst);
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(raw_post("/v1/slow", "k1").as_bytes()).await.unwrap();
        started.notified().await;
        drop(s);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(effects.load(Ordering::SeqCst), 2, "the protected handler ran to completion");

        let (status, head, body) = roundtrip(addr, &raw_post("/v1/slow", "k1")).await;
        assert_eq!(status, 201);
        assert!(head.contains("idempotent-replayed: true"), "{head}");
        assert_eq!(body, "both done");
        assert_eq!(effects.load(Ordering::SeqCst), 2);
        server.abort();
    }
}

/// What a server's shutdown waits for: the layer's detached handlers (`IdempotencyLayer::detached`).
mod shutdown {
    use super::*;

    /// A handler whose client hung up is counted until its response is stored, and closing and
    /// waiting ends only then: a retry after a restart replays instead of finding the key in
    /// flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wait_ends_once_a_hung_up_clients_response_is_stored() {
        let store = Arc::new(MemoryStore::new());
        let layer = builder_for_p(store.clone()).build();
        let detached = layer.detached();
        let (app, calls) = counting_route("/v1/slow", Duration::from_secs(1), layer);
        let a2 = app.clone();
        let client = tokio::spawn(async move { send(&a2, post_key("/v1/slow", "k1")).await });
        wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
        assert!(detached.is_empty(), "nothing is detached while the client waits");
        // The client hangs up: its response future is dropped mid-handler.
        client.abort();
        wait_until("the handler is detached", Duration::from_secs(60), async || detached.len() == 1).await;
        detached.close();
        tokio::time::timeout(Duration::from_secs(60), detached.wait()).await.expect("the detached handler ends");
        let record = store.get(&scope("/v1/slow", "k1")).await.expect("get").expect("record");
        assert_eq!(record.state, RecordState::Completed, "the wait ended before the response was stored");
        assert!(detached.is_empty());
        let retry = send(&app, post_key("/v1/slow", "k1")).await;
        assert_eq!((retry.status, retry.replayed(), retry.text()), (StatusCode::CREATED, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    /// A completion the store refused is retried in the background, counted by the layer that
    /// made it (and no other) until it is stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wait_ends_once_a_retried_completion_is_stored() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        store.fail_next(Op::Complete, 3);
        let layer = builder_for_p(store.clone()).build();
        let detached = layer.detached();
        let other = builder_for_p(store.clone()).build().detached();
        let (app, _) = counting_route("/v1/things", Duration::ZERO, layer);
        assert_eq!(send(&app, post_key("/v1/things", "k1")).await.status, StatusCode::CREATED);
        assert_eq!(detached.len(), 1, "the completion is retried in the background");
        assert!(other.is_empty(), "another layer counts only its own work");
        detached.close();
        tokio::time::timeout(Duration::from_secs(60), detached.wait()).await.expect("the retry ends");
        let record = store.inner().get(&scope("/v1/things", "k1")).await.expect("get").expect("record");
        assert_eq!(record.state, RecordState::Completed, "the wait ended before the response was stored");
        assert_eq!(store.calls(Op::Complete), 4, "three failures, then stored");
    }
}

/// Issue 12 item 10: a handler that runs longer than the in-flight TTL keeps its claim.
mod slow_handlers {
    use super::*;

    /// The handler runs three times the TTL while retries arrive: it runs once, every retry
    /// meanwhile is `409 request-in-progress`, and afterwards the retry replays. With a
    /// `retention` shorter than the handler (issue 45 item 2), the retries after it also find the
    /// record in flight: its claim's heartbeats renew its expiry.
    async fn a_handler_slower_than_the_ttl_runs_once(store: Arc<dyn Store>, retention: Duration) {
        let ttl = Duration::from_secs(1);
        let layer = builder_for_p(store).in_flight_ttl(ttl).retention(retention).build();
        let (app, calls) = counting_route("/v1/slow", 3 * ttl, layer);
        let a2 = app.clone();
        let first = tokio::spawn(async move { send(&a2, post_key("/v1/slow", "k1")).await });
        wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
        let started = Instant::now();
        let mut busy = 0;
        let mut latest_busy = Duration::ZERO;
        while !first.is_finished() {
            let r = send(&app, post_key("/v1/slow", "k1")).await;
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
        assert!(latest_busy > retention.min(2 * ttl), "no retry arrived after the retention: the test proves nothing");
        let first = first.await.expect("task");
        assert_eq!((first.status, first.replayed(), first.text()), (StatusCode::CREATED, false, "call 0"));
        let replay = send(&app, post_key("/v1/slow", "k1")).await;
        assert_eq!((replay.status, replay.replayed(), replay.text()), (StatusCode::CREATED, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one execution");
    }

    /// A retention just longer than the 1 s TTL, and shorter than the 3 s handler.
    const SHORT_RETENTION: Duration = Duration::from_millis(1500);

    async fn sqlite_store(dir: &tempfile::TempDir) -> Arc<dyn Store> {
        let store = idempotency_sqlx::SqliteStore::connect(dir.path().join("idem.db").to_str().expect("path"))
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        Arc::new(store)
    }

    async fn postgres_store(db: &testkit::postgres::TestDatabase) -> Arc<dyn Store> {
        let store = idempotency_sqlx::PostgresStore::connect(db.url()).await.expect("connect");
        store.migrate().await.expect("migrate");
        Arc::new(store)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        a_handler_slower_than_the_ttl_runs_once(Arc::new(MemoryStore::new()), DEFAULT_RETENTION).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let dir = tempfile::tempdir().expect("tempdir");
        a_handler_slower_than_the_ttl_runs_once(sqlite_store(&dir).await, DEFAULT_RETENTION).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some(db) = testkit::postgres::TestDatabase::create().await else { return };
        a_handler_slower_than_the_ttl_runs_once(postgres_store(&db).await, DEFAULT_RETENTION).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_with_a_retention_shorter_than_the_handler() {
        a_handler_slower_than_the_ttl_runs_once(Arc::new(MemoryStore::new()), SHORT_RETENTION).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_with_a_retention_shorter_than_the_handler() {
        let dir = tempfile::tempdir().expect("tempdir");
        a_handler_slower_than_the_ttl_runs_once(sqlite_store(&dir).await, SHORT_RETENTION).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_with_a_retention_shorter_than_the_handler() {
        let Some(db) = testkit::postgres::TestDatabase::create().await else { return };
        a_handler_slower_than_the_ttl_runs_once(postgres_store(&db).await, SHORT_RETENTION).await;
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
            .layer(builder_for_p(store.clone()).in_flight_ttl(Duration::from_millis(300)).build());
        store.fail_always(Op::Heartbeat);
        let a2 = app.clone();
        let slow = tokio::spawn(async move { send(&a2, post_key("/v1/op", "k1")).await });
        wait_until("the handler started", Duration::from_secs(60), async || calls.load(Ordering::SeqCst) == 1).await;
        let s = scope("/v1/op", "k1");
        let started_at = store.inner().get(&s).await.expect("get").expect("record").started_at;
        wait_until("a heartbeat was tried", Duration::from_secs(60), async || store.calls(Op::Heartbeat) >= 1).await;
        wait_until("the claim is stale", Duration::from_secs(60), async || {
            idempotency::now() >= started_at + chrono::Duration::milliseconds(300)
        })
        .await;
        let second = send(&app, post_key("/v1/op", "k1")).await;
        assert_eq!((second.status, second.replayed(), second.text()), (StatusCode::CREATED, false, "second attempt"));
        release.notify_one();
        assert_eq!(slow.await.expect("task").text(), "first attempt", "the slow client still gets its own response");
        let replay = send(&app, post_key("/v1/op", "k1")).await;
        assert_eq!((replay.replayed(), replay.text()), (true, "second attempt"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

mod expiry {
    use super::*;
    use idempotency_tower::BuildError;

    /// docs/protocol.md#records: a retention that is not longer than the in-flight TTL is refused, by a typed
    /// error naming both (a record in flight lives at least the TTL anyway, and a dead attempt's
    /// record must outlive its claim for the retry after the TTL to resume it).
    #[test]
    fn a_retention_not_longer_than_the_in_flight_ttl_is_refused() {
        for (retention, ttl) in [(2, 60), (60, 60)] {
            let (retention, in_flight_ttl) = (Duration::from_secs(retention), Duration::from_secs(ttl));
            let built = builder(&store()).retention(retention).in_flight_ttl(in_flight_ttl).try_build();
            assert_eq!(built.err(), Some(BuildError::RetentionNotLongerThanInFlightTtl { retention, in_flight_ttl }));
        }
        let refused = builder(&store()).retention(Duration::from_secs(2)).in_flight_ttl(Duration::from_secs(60));
        let message = refused.try_build().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("retention (2s)") && message.contains("in-flight TTL (60s)"), "{message}");
        let legal = builder(&store()).retention(Duration::from_secs(61)).in_flight_ttl(Duration::from_secs(60));
        assert!(legal.try_build().is_ok());
        assert!(builder(&store()).try_build().is_ok(), "the defaults: 24 h and 5 min");
    }

    #[tokio::test]
    async fn after_retention_the_sweeper_frees_the_key() {
        let store = store();
        let layer = builder(&store).in_flight_ttl(Duration::from_millis(50)).retention(Duration::from_millis(100));
        let (app, calls) = counting_app(layer.build());
        send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        assert!(send(&app, post_req("/v1/things", Some("k1"), "{}")).await.replayed());
        tokio::time::sleep(Duration::from_millis(150)).await;
        let swept = idempotency_tower::sweeper(store.clone(), Duration::from_secs(60)).run_once().await.unwrap();
        assert_eq!(swept, 1);
        assert!(store.is_empty());
        let again = send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        assert!(!again.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// Issue 12 item 2: a store error at `complete` after the handler ran does not lose the result.
mod failed_completion {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_is_retried_until_it_is_stored_and_the_retry_replays() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        store.fail_next(Op::Complete, 3);
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, builder_for_p(store.clone()).build());
        let first = send(&app, post_key("/v1/things", "k1")).await;
        // The client has its answer at once, though the store refused it.
        assert_eq!((first.status, first.replayed(), first.text()), (StatusCode::CREATED, false, "call 0"));
        let s = scope("/v1/things", "k1");
        wait_until("the response is stored", Duration::from_secs(60), async || {
            store.inner().get(&s).await.expect("get").is_some_and(|r| r.state == RecordState::Completed)
        })
        .await;
        assert_eq!(store.calls(Op::Complete), 4, "three failures, then stored");
        let retry = send(&app, post_key("/v1/things", "k1")).await;
        assert_eq!((retry.status, retry.replayed(), retry.text()), (StatusCode::CREATED, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    /// docs/protocol.md#side-effects, issue 45 item 8: when every retry of the completion fails, the record stays in
    /// flight. Its client was answered as final, so the handler must not run again at once (a
    /// lost answer's retry would then run it a second time); a retry gets `409` until the claim
    /// goes stale, and the retry after the TTL resumes (a real handler through its sub-keys).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_every_retry_fails_the_record_stays_in_flight_until_its_ttl() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        store.fail_always(Op::Complete);
        let ttl = Duration::from_secs(1);
        let built = builder_for_p(store.clone())
            .completion_retries(2, Duration::from_millis(10))
            .in_flight_ttl(ttl)
            .retention(2 * ttl)
            .build();
        let detached = built.detached();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, built);
        let first = send(&app, post_key("/v1/things", "k1")).await;
        assert_eq!((first.status, first.text()), (StatusCode::CREATED, "call 0"), "answered as final");
        detached.close();
        tokio::time::timeout(Duration::from_secs(60), detached.wait()).await.expect("the retries end");
        assert_eq!(store.calls(Op::Complete), 3, "the completion and its two retries");

        let s = scope("/v1/things", "k1");
        let record = store.inner().get(&s).await.expect("get").expect("record");
        assert_eq!((record.state, store.calls(Op::Fail)), (RecordState::InFlight, 0), "not released: in flight");
        let busy = send(&app, post_key("/v1/things", "k1")).await;
        assert_eq!(busy.problem_type(), "/problems/request-in-progress");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler does not run again while the claim is live");

        // Nobody renews the claim: after the TTL the next retry takes it over and runs again.
        store.heal(Op::Complete);
        wait_until("the claim is stale", Duration::from_secs(60), async || {
            idempotency::now() >= record.started_at + chrono::Duration::from_std(ttl).expect("ttl")
        })
        .await;
        let resumed = send(&app, post_key("/v1/things", "k1")).await;
        assert_eq!((resumed.status, resumed.replayed(), resumed.text()), (StatusCode::CREATED, false, "call 1"));
        assert!(send(&app, post_key("/v1/things", "k1")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// docs/protocol.md#running-leasebroker: an attempt whose handler was cut by a store outage (it answered 503, and the store
/// would not take the `fail`) holds its key only until the store answers again, not for the
/// in-flight TTL.
mod outage {
    use super::*;

    /// A handler that answers 503 while `down` is set (its own use of the store failed), and
    /// 201 after; it counts its calls.
    fn cut_route(layer: IdempotencyLayer, down: Arc<std::sync::atomic::AtomicBool>) -> (Router, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/things",
                post(move || async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    if down.load(Ordering::SeqCst) {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("cut {n}"))
                    } else {
                        (StatusCode::CREATED, format!("call {n}"))
                    }
                }),
            )
            .layer(layer);
        (app, calls)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cut_attempts_are_released_as_soon_as_the_store_answers() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        // Default in-flight TTL (5 minutes): a record left in flight would block these keys.
        let (app, calls) = cut_route(builder_for_p(store.clone()).build(), down.clone());
        store.fail_always(Op::Fail);
        let keys: Vec<String> = (0..16).map(|i| format!("cut-{i}")).collect();
        for key in &keys {
            let cut = send(&app, post_key("/v1/things", key)).await;
            assert_eq!(cut.status, StatusCode::SERVICE_UNAVAILABLE, "{}", cut.text());
        }
        assert_eq!(calls.load(Ordering::SeqCst), keys.len());
        wait_until("a release was retried", Duration::from_secs(60), async || {
            store.injected(Op::Fail) > keys.len() as u64
        })
        .await;
        // While the store refuses, each retry finds its key in flight.
        for key in &keys {
            let busy = send(&app, post_key("/v1/things", key)).await;
            assert_eq!(busy.problem_type(), "/problems/request-in-progress", "{key}");
        }
        // The store answers again: every record is released, and every retry runs at once.
        store.heal(Op::Fail);
        down.store(false, Ordering::SeqCst);
        for key in &keys {
            let s = scope("/v1/things", key);
            wait_until("the record is released", Duration::from_secs(60), async || {
                store.inner().get(&s).await.expect("get").is_some_and(|r| r.state == RecordState::Failed)
            })
            .await;
            let resumed = send(&app, post_key("/v1/things", key)).await;
            assert_eq!((resumed.status, resumed.replayed()), (StatusCode::CREATED, false), "{}", resumed.text());
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2 * keys.len(), "each key ran once more, no more");
        for key in &keys {
            assert!(send(&app, post_key("/v1/things", key)).await.replayed(), "{key}");
        }
    }

    /// A store that takes one call at a time, slowly (a SQLite writer queue on a loaded disk), is
    /// busy, not down: a request queued behind the others for many store timeouts waits its turn
    /// and runs, because the store goes on taking writes meanwhile. CI once answered such a
    /// queue `503 store-unavailable` (16 concurrent claims on SQLite, the 3 s timeout cutting the
    /// last ones).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_keeps_taking_writes_one_at_a_time_is_a_queue_not_an_outage() {
        const N: usize = 16;
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        // A claim and a completion each: the last request waits about 2 * N * 50 ms = 1.6 s,
        // six store timeouts.
        store.busy(Duration::from_millis(50));
        let layer = builder_for_p(store.clone()).store_timeout(Duration::from_millis(250)).build();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, layer);
        let requests: Vec<_> = (0..N)
            .map(|i| {
                let app = app.clone();
                tokio::spawn(async move { send(&app, post_key("/v1/things", &format!("queued-{i}"))).await })
            })
            .collect();
        for r in requests {
            let a = r.await.expect("request");
            assert_eq!((a.status, a.replayed()), (StatusCode::CREATED, false), "{}", a.text());
        }
        assert_eq!(calls.load(Ordering::SeqCst), N, "every request ran once");
    }

    /// The queue's bound: a call that waits while the store goes on taking other writes is given
    /// up after `store_queue_timeout`, answered `503`, and runs no handler.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_queued_past_the_queue_timeout_is_answered_503() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        store.busy(Duration::from_millis(100));
        let layer = builder_for_p(store.clone())
            .store_timeout(Duration::from_millis(250))
            .store_queue_timeout(Duration::from_millis(600))
            .build();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, layer);
        // 16 requests need 3.2 s of the store; the queue's bound is 0.6 s.
        let requests: Vec<_> = (0..16)
            .map(|i| {
                let app = app.clone();
                tokio::spawn(async move { send(&app, post_key("/v1/things", &format!("long-{i}"))).await })
            })
            .collect();
        let (mut created, mut refused) = (0, 0);
        for r in requests {
            let a = r.await.expect("request");
            match a.status {
                StatusCode::CREATED => created += 1,
                StatusCode::SERVICE_UNAVAILABLE => {
                    assert_eq!(a.problem_type(), "/problems/store-unavailable");
                    refused += 1;
                }
                s => panic!("unexpected {s}: {}", a.text()),
            }
        }
        assert!(refused > 0, "some requests waited past the queue's bound");
        assert_eq!(calls.load(Ordering::SeqCst), created, "a request given up ran no handler");
    }

    /// A store whose answers are lost while `silent` is set, as behind a partition that drops
    /// packets: each call is made (a claim lands) but its caller hears nothing until the
    /// partition heals.
    struct Silent {
        inner: Arc<MemoryStore>,
        silent: tokio::sync::watch::Sender<bool>,
        /// A claim made while silent reaches the store only this long after the silence ends
        /// (`None`: at once), as a statement on a connection whose retransmissions back off.
        late: Option<Duration>,
    }

    impl Silent {
        async fn heard<T>(&self, out: T) -> T {
            let _ = self.silent.subscribe().wait_for(|s| !s).await;
            out
        }
    }

    #[async_trait::async_trait]
    impl Store for Silent {
        async fn claim(
            &self,
            req: idempotency::ClaimRequest,
        ) -> Result<idempotency::ClaimOutcome, idempotency::StoreError> {
            if let Some(late) = self.late.filter(|_| *self.silent.borrow()) {
                // The statement is on its way whether or not its caller still waits for it.
                let (inner, mut silent) = (self.inner.clone(), self.silent.subscribe());
                let landed = tokio::spawn(async move {
                    let _ = silent.wait_for(|s| !s).await;
                    tokio::time::sleep(late).await;
                    inner.claim(req).await
                });
                let out = landed.await.expect("the late claim");
                return self.heard(out).await;
            }
            let out = self.inner.claim(req).await;
            self.heard(out).await
        }
        async fn reclaim(
            &self,
            req: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            let out = self.inner.reclaim(req).await;
            self.heard(out).await
        }
        async fn heartbeat(
            &self,
            c: &idempotency::Claim,
            renewal: idempotency::Renewal,
        ) -> Result<(), idempotency::StoreError> {
            let out = self.inner.heartbeat(c, renewal).await;
            self.heard(out).await
        }
        async fn remove(&self, c: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            let out = self.inner.remove(c).await;
            self.heard(out).await
        }
        async fn mark_uncertain(&self, c: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            let out = self.inner.mark_uncertain(c).await;
            self.heard(out).await
        }
        async fn mark_stale_uncertain(
            &self,
            req: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            let out = self.inner.mark_stale_uncertain(req).await;
            self.heard(out).await
        }
        async fn take_over_uncertain(
            &self,
            req: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            let out = self.inner.take_over_uncertain(req).await;
            self.heard(out).await
        }
        async fn resolve(
            &self,
            id: &idempotency::RecordId,
            resp: &idempotency::StoredResponse,
            exp: idempotency::Timestamp,
        ) -> Result<idempotency::Resolve, idempotency::StoreError> {
            let out = self.inner.resolve(id, resp, exp).await;
            self.heard(out).await
        }
        async fn complete(
            &self,
            c: &idempotency::Claim,
            resp: &idempotency::StoredResponse,
            exp: idempotency::Timestamp,
        ) -> Result<(), idempotency::StoreError> {
            let out = self.inner.complete(c, resp, exp).await;
            self.heard(out).await
        }
        async fn fail(&self, c: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            let out = self.inner.fail(c).await;
            self.heard(out).await
        }
        async fn get(
            &self,
            scope: &idempotency::Scope,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            let out = self.inner.get(scope).await;
            self.heard(out).await
        }
        async fn sweep_expired(&self, now: idempotency::Timestamp, batch: u32) -> Result<u64, idempotency::StoreError> {
            let out = self.inner.sweep_expired(now, batch).await;
            self.heard(out).await
        }
        async fn ping(&self) -> Result<(), idempotency::StoreError> {
            self.heard(Ok(())).await
        }
        async fn list_records(
            &self,
            q: &idempotency::RecordQuery,
        ) -> Result<idempotency::RecordPage, idempotency::StoreError> {
            let out = self.inner.list_records(q).await;
            self.heard(out).await
        }
        async fn get_by_id(
            &self,
            id: &idempotency::RecordId,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            let out = self.inner.get_by_id(id).await;
            self.heard(out).await
        }
        async fn forget(&self, id: &idempotency::RecordId) -> Result<idempotency::Forget, idempotency::StoreError> {
            let out = self.inner.forget(id).await;
            self.heard(out).await
        }
    }

    /// A store that stops answering (docs/protocol.md#running-leasebroker): each request is answered `503 store-unavailable`
    /// once its store call has waited `store_timeout`, and runs no handler. The claim that landed
    /// although its answer was lost is released as soon as the store answers again, so the
    /// retry runs the handler at once, not after the in-flight TTL (5 minutes here), and only
    /// once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_whose_answer_is_lost_is_answered_503_in_time_and_released_when_the_store_answers() {
        let (silent, _) = tokio::sync::watch::channel(true);
        let store = Arc::new(Silent { inner: Arc::new(MemoryStore::new()), silent, late: None });
        let timeout = Duration::from_millis(300);
        let layer = builder_for_p(store.clone()).store_timeout(timeout).build();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, layer);
        for attempt in 0..2 {
            let started = Instant::now();
            let cut = send(&app, post_key("/v1/things", "lost")).await;
            let took = started.elapsed();
            assert_eq!(cut.status, StatusCode::SERVICE_UNAVAILABLE, "{attempt}: {}", cut.text());
            assert_eq!(cut.problem_type(), "/problems/store-unavailable", "{attempt}");
            assert!(cut.headers.contains_key("retry-after"), "{attempt}");
            assert!(took >= timeout && took < Duration::from_secs(5), "{attempt}: answered after {took:?}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "no handler ran");
        let s = scope("/v1/things", "lost");
        let landed = store.inner.get(&s).await.expect("get").expect("the first claim landed");
        assert_eq!(landed.state, RecordState::InFlight);

        // The partition heals: the landed claim is released, and the retry runs the handler.
        store.silent.send_replace(false);
        wait_until("the landed claim is released", Duration::from_secs(30), async || {
            store.inner.get(&s).await.expect("get").is_some_and(|r| r.state == RecordState::Failed)
        })
        .await;
        let resumed = send(&app, post_key("/v1/things", "lost")).await;
        assert_eq!((resumed.status, resumed.replayed()), (StatusCode::CREATED, false), "{}", resumed.text());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
        assert!(send(&app, post_key("/v1/things", "lost")).await.replayed());
    }

    /// The same when the claim reaches the store a while after the store answers again (its
    /// connection comes back last): the layer keeps looking for it, and releases it when it lands.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_that_lands_after_the_store_answers_again_is_released_too() {
        let (silent, _) = tokio::sync::watch::channel(true);
        let late = Duration::from_secs(2);
        let store = Arc::new(Silent { inner: Arc::new(MemoryStore::new()), silent, late: Some(late) });
        let layer = builder_for_p(store.clone()).store_timeout(Duration::from_millis(300)).build();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, layer);
        let cut = send(&app, post_key("/v1/things", "late")).await;
        assert_eq!(cut.status, StatusCode::SERVICE_UNAVAILABLE, "{}", cut.text());
        store.silent.send_replace(false);
        let s = scope("/v1/things", "late");
        wait_until("the late claim lands", Duration::from_secs(30), async || {
            store.inner.get(&s).await.expect("get").is_some()
        })
        .await;
        wait_until("the late claim is released", Duration::from_secs(30), async || {
            store.inner.get(&s).await.expect("get").is_some_and(|r| r.state == RecordState::Failed)
        })
        .await;
        let resumed = send(&app, post_key("/v1/things", "late")).await;
        assert_eq!((resumed.status, resumed.replayed()), (StatusCode::CREATED, false), "{}", resumed.text());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    }
}
