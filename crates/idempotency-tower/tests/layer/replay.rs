//! What a retry gets back: replays of every outcome, and responses too large to store.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use idempotency::{MemoryStore, Store};
use idempotency_tower::{IdempotencyLayer, IdempotencyLayerBuilder};

use crate::fixture::*;

mod stored {
    use super::*;

    #[tokio::test]
    async fn replay_is_byte_for_byte_with_allowlisted_headers_only() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let handler = move || async move {
            c.fetch_add(1, Ordering::SeqCst);
            let mut res = (StatusCode::CREATED, "{\"id\":\"wkr-1\",\"note\":\"caf\u{e9}\"}").into_response();
            let h = res.headers_mut();
            h.insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
            h.insert("location", HeaderValue::from_static("/v1/workers/wkr-1"));
            h.append("set-cookie", HeaderValue::from_static("session=secret"));
            h.append("x-trace", HeaderValue::from_static("one"));
            h.append("x-trace", HeaderValue::from_static("two"));
            h.append("x-trace", HeaderValue::from_bytes(b"thr\xe9e").unwrap());
            h.insert("x-not-allowed", HeaderValue::from_static("nope"));
            h.insert("date", HeaderValue::from_static("Sun, 29 Nov 2026 22:00:00 GMT"));
            res
        };
        let layer = builder(&store())
            .replay_header(http::HeaderName::from_static("x-trace"))
            // Configured or not, Set-Cookie and Date are never replayed.
            .replay_header(http::HeaderName::from_static("set-cookie"))
            .replay_header(http::HeaderName::from_static("date"))
            .build();
        let app = Router::new().route("/v1/workers", post(handler)).layer(layer);

        let first = send(&app, post_req("/v1/workers", Some("k1"), "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(first.headers["set-cookie"], "session=secret", "the owner's client gets its whole response");
        let again = send(&app, post_req("/v1/workers", Some("k1"), "{}")).await;
        assert!(again.replayed());
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, first.body);
        assert_eq!(again.headers["content-type"], "application/json; charset=utf-8");
        assert_eq!(again.headers["location"], "/v1/workers/wkr-1");
        let traces: Vec<&[u8]> = again.headers.get_all("x-trace").iter().map(|v| v.as_bytes()).collect();
        assert_eq!(traces, vec![&b"one"[..], b"two", b"thr\xe9e"]);
        assert!(again.headers.get("set-cookie").is_none());
        assert!(again.headers.get("date").is_none());
        assert!(again.headers.get("x-not-allowed").is_none());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn large_bodies_are_stored_compressed_and_replayed_exactly() {
        let body: String = (0..2000).map(|i| format!("{{\"n\":{i},\"label\":\"abc\"}},")).collect();
        let expected = body.clone();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/big",
                post(move || async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    body
                }),
            )
            .layer(builder(&store()).compression_threshold(64).build());
        let first = send(&app, post_req("/v1/big", Some("k1"), "{}")).await;
        let again = send(&app, post_req("/v1/big", Some("k1"), "{}")).await;
        assert!(again.replayed());
        assert_eq!(first.body, expected.as_bytes());
        assert_eq!(again.body, expected.as_bytes());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn canonical_json_mode_matches_reordered_bodies() {
        let (app, calls) =
            counting_app(builder(&store()).fingerprint_mode(idempotency::FingerprintMode::CanonicalJson).build());
        send(&app, post_req("/v1/things", Some("k1"), "{\"a\":1,\"b\":2}")).await;
        let again = send(&app, post_req("/v1/things", Some("k1"), "{ \"b\": 2, \"a\": 1 }")).await;
        assert!(again.replayed());
        let other = send(&app, post_req("/v1/things", Some("k1"), "{\"a\":1,\"b\":3}")).await;
        assert_eq!(other.status, StatusCode::CONFLICT);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

mod outcomes {
    use super::*;

    /// A handler that answers `statuses[n]` on its n-th call (the last one from then on).
    fn scripted(statuses: &'static [u16], layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move || async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    let status = statuses[n.min(statuses.len() - 1)];
                    (StatusCode::from_u16(status).unwrap(), format!("call {n}"))
                }),
            )
            .layer(layer);
        (app, calls)
    }

    #[tokio::test]
    async fn a_5xx_is_not_stored_and_the_retry_runs_again() {
        let (app, calls) = scripted(&[503, 201], builder(&store()).build());
        let a = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        let b = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((b.status, b.replayed(), b.text()), (StatusCode::CREATED, false, "call 1"));
        let c = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((c.status, c.replayed(), c.text()), (StatusCode::CREATED, true, "call 1"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn terminal_4xx_are_stored_and_others_are_not() {
        let (app, calls) = scripted(&[422, 201], builder(&store()).build());
        send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        let again = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((again.status, again.replayed(), again.text()), (StatusCode::UNPROCESSABLE_ENTITY, true, "call 0"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let (app, calls) = scripted(&[429, 401, 201], builder(&store()).build());
        assert_eq!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.status, StatusCode::UNAUTHORIZED);
        assert_eq!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.status, StatusCode::CREATED);
        assert!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        // The response policy can drop 422 from the stored set.
        let policy = idempotency::ResponsePolicy::default().without(422);
        let (app, calls) = scripted(&[422, 201], builder(&store()).response_policy(policy).build());
        send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.status, StatusCode::CREATED);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_panicking_handler_gets_500_and_the_retry_runs_again() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move || async move {
                    if c.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("the first attempt blows up");
                    }
                    (StatusCode::CREATED, "ok")
                }),
            )
            .layer(builder(&store()).build());
        let a = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(a.problem_type(), "/problems/handler-panicked");
        let b = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((b.status, b.replayed()), (StatusCode::CREATED, false));
        assert!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// A store that is down.
    struct DownStore;

    fn down() -> idempotency::StoreError {
        idempotency::StoreError::unavailable(std::io::Error::other("connection refused"))
    }

    #[async_trait::async_trait]
    impl Store for DownStore {
        async fn claim(
            &self,
            _: idempotency::ClaimRequest,
        ) -> Result<idempotency::ClaimOutcome, idempotency::StoreError> {
            Err(down())
        }
        async fn reclaim(
            &self,
            _: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            Err(down())
        }
        async fn heartbeat(
            &self,
            _: &idempotency::Claim,
            _: idempotency::Renewal,
        ) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn remove(&self, _: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn complete(
            &self,
            _: &idempotency::Claim,
            _: &idempotency::StoredResponse,
            _: idempotency::Timestamp,
        ) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn fail(&self, _: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn mark_uncertain(&self, _: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn mark_stale_uncertain(
            &self,
            _: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            Err(down())
        }
        async fn take_over_uncertain(
            &self,
            _: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            Err(down())
        }
        async fn resolve(
            &self,
            _: &idempotency::RecordId,
            _: &idempotency::StoredResponse,
            _: idempotency::Timestamp,
        ) -> Result<idempotency::Resolve, idempotency::StoreError> {
            Err(down())
        }
        async fn get(&self, _: &idempotency::Scope) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            Err(down())
        }
        async fn sweep_expired(&self, _: idempotency::Timestamp, _: u32) -> Result<u64, idempotency::StoreError> {
            Err(down())
        }
        async fn ping(&self) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn list_records(
            &self,
            _: &idempotency::RecordQuery,
        ) -> Result<idempotency::RecordPage, idempotency::StoreError> {
            Err(down())
        }
        async fn get_by_id(
            &self,
            _: &idempotency::RecordId,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            Err(down())
        }
        async fn forget(&self, _: &idempotency::RecordId) -> Result<idempotency::Forget, idempotency::StoreError> {
            Err(down())
        }
    }

    /// A store with a bug: its claim panics.
    struct PanickingStore;

    #[async_trait::async_trait]
    impl Store for PanickingStore {
        async fn claim(
            &self,
            _: idempotency::ClaimRequest,
        ) -> Result<idempotency::ClaimOutcome, idempotency::StoreError> {
            panic!("a bug in the store")
        }
        async fn reclaim(
            &self,
            req: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            DownStore.reclaim(req).await
        }
        async fn heartbeat(
            &self,
            c: &idempotency::Claim,
            renewal: idempotency::Renewal,
        ) -> Result<(), idempotency::StoreError> {
            DownStore.heartbeat(c, renewal).await
        }
        async fn remove(&self, c: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            DownStore.remove(c).await
        }
        async fn complete(
            &self,
            c: &idempotency::Claim,
            r: &idempotency::StoredResponse,
            t: idempotency::Timestamp,
        ) -> Result<(), idempotency::StoreError> {
            DownStore.complete(c, r, t).await
        }
        async fn fail(&self, c: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            DownStore.fail(c).await
        }
        async fn mark_uncertain(&self, _: &idempotency::Claim) -> Result<(), idempotency::StoreError> {
            Err(down())
        }
        async fn mark_stale_uncertain(
            &self,
            _: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            Err(down())
        }
        async fn take_over_uncertain(
            &self,
            _: idempotency::ReclaimRequest<'_>,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            Err(down())
        }
        async fn resolve(
            &self,
            _: &idempotency::RecordId,
            _: &idempotency::StoredResponse,
            _: idempotency::Timestamp,
        ) -> Result<idempotency::Resolve, idempotency::StoreError> {
            Err(down())
        }
        async fn get(&self, s: &idempotency::Scope) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            DownStore.get(s).await
        }
        async fn sweep_expired(&self, t: idempotency::Timestamp, n: u32) -> Result<u64, idempotency::StoreError> {
            DownStore.sweep_expired(t, n).await
        }
        async fn ping(&self) -> Result<(), idempotency::StoreError> {
            DownStore.ping().await
        }
        async fn list_records(
            &self,
            q: &idempotency::RecordQuery,
        ) -> Result<idempotency::RecordPage, idempotency::StoreError> {
            DownStore.list_records(q).await
        }
        async fn get_by_id(
            &self,
            id: &idempotency::RecordId,
        ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            DownStore.get_by_id(id).await
        }
        async fn forget(&self, id: &idempotency::RecordId) -> Result<idempotency::Forget, idempotency::StoreError> {
            DownStore.forget(id).await
        }
    }

    #[tokio::test]
    async fn a_panic_outside_the_handler_is_a_500_problem_and_the_service_stays_up() {
        let (app, calls) = counting_app(
            IdempotencyLayer::builder(Arc::new(PanickingStore))
                .allow_anonymous(idempotency::Principal::new("a"))
                .build(),
        );
        for key in ["k1", "k2"] {
            let a = send(&app, post_req("/v1/things", Some(key), "{}")).await;
            assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(a.problem_type(), "/problems/handler-panicked");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn an_unavailable_store_gets_503_and_the_handler_never_runs() {
        let (app, calls) = counting_app(
            IdempotencyLayer::builder(Arc::new(DownStore)).allow_anonymous(idempotency::Principal::new("a")).build(),
        );
        let a = send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(a.problem_type(), "/problems/store-unavailable");
        assert!(a.headers["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
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
            .layer(builder(builder_for_p(store)).build());
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
        let first = send(&app, post_key("/v1/big", "k1")).await;
        assert_eq!((first.status, first.replayed()), (StatusCode::CREATED, false));
        assert_eq!(first.body.len(), size);
        assert!(first.body == expected(size), "the client gets the whole response, byte for byte");
        for _ in 0..2 {
            let retry = send(&app, post_key("/v1/big", "k1")).await;
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
        assert_eq!(send(&app, post_key("/v1/big", "k1")).await.body.len(), 100_000);
        let replay = send(&app, post_key("/v1/big", "k1")).await;
        assert_eq!((replay.status, replay.replayed()), (StatusCode::CREATED, true));
        assert!(replay.body == expected(100_000));

        let (app, calls2) =
            big_app(Arc::new(MemoryStore::new()), StatusCode::CREATED, 100_001, |b| b.max_stored_response(100_000));
        assert!(send(&app, post_key("/v1/big", "k1")).await.body == expected(100_001));
        assert_eq!(send(&app, post_key("/v1/big", "k1")).await.status, StatusCode::GONE);
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
            .layer(builder_for_p(Arc::new(MemoryStore::new())).max_stored_response(100_000).build());
        let first = send(&app, post_key("/v1/big", "k1")).await;
        assert_eq!((first.status, first.body.len()), (StatusCode::OK, 200_000));
        assert!(first.body.iter().all(|&b| b == b'x'));
        let retry = send(&app, post_key("/v1/big", "k1")).await;
        assert_eq!((retry.status, retry.problem_type().as_str()), (StatusCode::GONE, "/problems/response-too-large"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_large_response_that_is_not_stored_passes_through_and_reruns() {
        let (app, calls) =
            big_app(Arc::new(MemoryStore::new()), StatusCode::BAD_GATEWAY, 300_000, |b| b.max_stored_response(1000));
        for n in 1..=2 {
            let r = send(&app, post_key("/v1/big", "k1")).await;
            assert_eq!((r.status, r.replayed()), (StatusCode::BAD_GATEWAY, false));
            assert!(r.body == expected(300_000));
            assert_eq!(calls.load(Ordering::SeqCst), n, "a 5xx is never stored: the retry runs again");
        }
    }
}
