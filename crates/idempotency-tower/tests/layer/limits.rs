//! Bounds and hostile input: size limits, and requests built to hurt.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use idempotency::MemoryStore;
use idempotency_tower::IdempotencyLayer;

use crate::fixture::*;

mod body_size {
    use super::*;

    fn streamed(path: &str, key: &str, chunks: Vec<&'static [u8]>) -> Request<Body> {
        let stream = futures::stream::iter(chunks.into_iter().map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c))));
        Request::post(path).header("idempotency-key", key).body(Body::from_stream(stream)).unwrap()
    }

    #[tokio::test]
    async fn bodies_over_the_limit_get_413_and_the_handler_never_runs() {
        let (app, calls) = counting_app(builder(&store()).body_limit(16).build());
        // Declared length over the limit.
        let a = send(&app, post_req("/v1/things", Some("k1"), "{\"x\":\"123456789\"}")).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(a.problem_type(), "/problems/body-too-large");
        // No declared length: the limit holds while reading.
        let b = send(&app, streamed("/v1/things", "k2", vec![b"0123456789", b"0123456"])).await;
        assert_eq!(b.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(b.problem_type(), "/problems/body-too-large");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        // Exactly at the limit is fine, streamed or not.
        let c = send(&app, streamed("/v1/things", "k3", vec![b"01234567", b"89abcdef"])).await;
        assert_eq!(c.status, StatusCode::CREATED);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    /// A request whose body chunks count themselves as the server reads them.
    fn counted(chunks: usize, chunk: usize, read: &Arc<AtomicUsize>) -> Request<Body> {
        let read = read.clone();
        let stream = futures::stream::iter((0..chunks).map(move |_| {
            read.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; chunk]))
        }));
        Request::post("/v1/things").header("idempotency-key", "drained").body(Body::from_stream(stream)).unwrap()
    }

    #[tokio::test]
    async fn a_refused_body_is_read_to_its_end_when_it_is_not_far_over() {
        // The client can finish its upload and read the 413 instead of hitting a closed socket.
        let (app, calls) = counting_app(builder(&store()).body_limit(16).build());
        let read = Arc::new(AtomicUsize::new(0));
        let a = send(&app, counted(10, 10, &read)).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(read.load(Ordering::SeqCst), 10, "every chunk was read");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_refused_body_far_over_is_not_read_to_its_end() {
        let (app, calls) = counting_app(builder(&store()).body_limit(16).build());
        let read = Arc::new(AtomicUsize::new(0));
        let mib = 1024 * 1024;
        let chunks = idempotency_tower::OVERSIZE_DRAIN as usize / mib + 4;
        let a = send(&app, counted(chunks, mib, &read)).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
        let n = read.load(Ordering::SeqCst);
        assert!(n < chunks, "read {n} of {chunks} chunks: the drain must stop");
        assert!(
            n * mib > idempotency_tower::OVERSIZE_DRAIN as usize,
            "read {n} chunks: the drain stops only past its budget"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}

mod hostile {
    use super::*;

    fn per_user(store: &Arc<MemoryStore>) -> IdempotencyLayer {
        builder(store)
            .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(idempotency::Principal::new))
            .build()
    }

    fn as_user(user: &str, key: &str) -> Request<Body> {
        let mut r = post_req("/v1/things", Some(key), "{}");
        r.headers_mut().insert("x-user", HeaderValue::from_str(user).expect("user"));
        r
    }

    /// One principal can fill the store with records (nothing but retention bounds how many),
    /// but never reaches another's: the same keys are distinct records, and the other's replays
    /// stay its own.
    #[tokio::test]
    async fn a_flood_of_keys_from_one_principal_does_not_touch_another() {
        let store = store();
        let (app, calls) = counting_app(per_user(&store));
        let bob = send(&app, as_user("bob", "k-0")).await;
        assert_eq!(bob.status, StatusCode::CREATED);
        const FLOOD: usize = 2000;
        for i in 0..FLOOD {
            // Every 100th key is one Bob uses too.
            let key = if i % 100 == 0 { format!("k-{}", i / 100) } else { format!("flood-{i}") };
            let r = send(&app, as_user("mallory", &key)).await;
            assert_eq!(r.status, StatusCode::CREATED);
            assert!(!r.replayed(), "{key}: Mallory got Bob's record");
        }
        assert_eq!(store.len(), FLOOD + 1);
        let again = send(&app, as_user("bob", "k-0")).await;
        assert!(again.replayed());
        assert_eq!(again.body, bob.body, "Bob's replay is Bob's response");
        let new = send(&app, as_user("bob", "k-1")).await;
        assert!(!new.replayed(), "Bob's first k-1 runs: Mallory's k-1 is another record");
        assert_eq!(calls.load(Ordering::SeqCst), FLOOD + 2);
    }

    #[tokio::test]
    async fn oversized_and_malformed_keys_are_refused_before_the_handler() {
        let (app, calls) = counting_app(per_user(&store()));
        for key in ["k".repeat(64 * 1024), "k".repeat(129), r#""bad\escape""#.to_owned()] {
            let r = send(&app, as_user("alice", &key)).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST);
            assert_eq!(r.problem_type(), "/problems/idempotency-key-invalid");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }
}

/// The per-principal record limit counts what a principal stores (docs/protocol.md#leasebroker-api): a refusal that
/// stored nothing leaves nothing that counts, and a request marked [`PassesRecordLimit`] is
/// never refused.
mod record_limit {
    use std::sync::atomic::AtomicBool;

    use axum::Router;
    use axum::routing::post;
    use idempotency_tower::PassesRecordLimit;

    use super::*;

    /// `POST /v1/things`: `503` while `refuse` is set (a failed record), else `201`. A request
    /// with `x-passes: yes` is marked [`PassesRecordLimit`], as a service marks the delete of a
    /// principal's own resource.
    fn app(limit: u64, refuse: Arc<AtomicBool>) -> Router {
        let layer = builder_for_p(store()).max_records_per_principal(Some(limit)).build();
        let handler = move || {
            let refuse = refuse.load(Ordering::SeqCst);
            async move { if refuse { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED } }
        };
        let mark = |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            if req.headers().contains_key("x-passes") {
                req.extensions_mut().insert(PassesRecordLimit);
            }
            next.run(req).await
        };
        Router::new().route("/v1/things", post(handler)).layer(layer).layer(axum::middleware::from_fn(mark))
    }

    #[tokio::test]
    async fn refusals_that_stored_nothing_leave_the_limit_untouched() {
        let refuse = Arc::new(AtomicBool::new(true));
        let app = app(2, refuse.clone());
        for i in 0..10 {
            let r = send(&app, post_key("/v1/things", &format!("refused-{i}"))).await;
            assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "refusal {i}: {}", r.text());
        }
        refuse.store(false, Ordering::SeqCst);
        for key in ["a", "b"] {
            let r = send(&app, post_key("/v1/things", key)).await;
            assert_eq!(r.status, StatusCode::CREATED, "{key}: {}", r.text());
        }
        let over = send(&app, post_key("/v1/things", "c")).await;
        assert_eq!(over.status, StatusCode::TOO_MANY_REQUESTS, "{}", over.text());
        assert_eq!(over.problem_type(), "/problems/too-many-requests");
    }

    #[tokio::test]
    async fn at_the_limit_a_failed_key_is_refused_and_a_marked_request_passes() {
        let refuse = Arc::new(AtomicBool::new(true));
        let app = app(1, refuse.clone());
        assert_eq!(send(&app, post_key("/v1/things", "failed")).await.status, StatusCode::SERVICE_UNAVAILABLE);
        refuse.store(false, Ordering::SeqCst);
        assert_eq!(send(&app, post_key("/v1/things", "stored")).await.status, StatusCode::CREATED);
        // At the limit: its stored key replays; its failed key would make one record more.
        let replay = send(&app, post_key("/v1/things", "stored")).await;
        assert_eq!((replay.status, replay.replayed()), (StatusCode::CREATED, true));
        for key in ["failed", "new"] {
            let r = send(&app, post_key("/v1/things", key)).await;
            assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{key}: {}", r.text());
        }
        let mut marked = post_key("/v1/things", "marked");
        marked.headers_mut().insert("x-passes", HeaderValue::from_static("yes"));
        let r = send(&app, marked).await;
        assert_eq!((r.status, r.replayed()), (StatusCode::CREATED, false), "{}", r.text());
    }
}
