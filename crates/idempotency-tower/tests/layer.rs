//! The layer's behaviour, end to end: an axum Router driven through `oneshot`, and a real TCP
//! server where the claim is about connections. Every handler counts its own side effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{MemoryStore, Store};
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
        assert!(v["title"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
        assert!(v["detail"].as_str().is_some(), "{v}");
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

fn post_req(path: &str, key: Option<&str>, body: &'static str) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Body::from(body)).expect("request")
}

fn store() -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new())
}

/// A layer over `store` where requests without a principal share the scope `anonymous`
/// (the explicit opt-in; without it they are refused).
fn builder(store: &Arc<MemoryStore>) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store.clone() as Arc<dyn Store>).allow_anonymous(idempotency::Principal::new("anonymous"))
}

/// `store`, but every claim renewal fails: a claim goes stale after its TTL even while its
/// handler still runs, as a hung or partitioned attempt's would.
fn unrenewed<S: Store>(store: S) -> Arc<dyn Store> {
    let faulty = idempotency::faulty::FaultyStore::new(store);
    faulty.fail_always(idempotency::faulty::Op::Heartbeat);
    Arc::new(faulty)
}

/// A router whose POST /v1/things and /v1/other count calls and answer 201 with the count.
fn counting_app(layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |body: Bytes| async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                [("content-type", "application/json"), ("location", "/v1/things/1")],
                format!("{{\"call\":{n},\"echo\":{}}}", String::from_utf8_lossy(&body)),
            )
        }
    };
    let app = Router::new()
        .route("/v1/things", post(handler.clone()).get(handler.clone()).put(handler.clone()))
        .route("/v1/other", post(handler))
        .layer(layer);
    (app, calls)
}

mod header_forms {
    use super::*;

    #[tokio::test]
    async fn quoted_and_bare_forms_are_the_same_key() {
        let (app, calls) = counting_app(builder(&store()).build());
        let first = send(&app, post_req("/v1/things", Some("\"k-7c3f\""), "{}")).await;
        let second = send(&app, post_req("/v1/things", Some("k-7c3f"), "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(!first.replayed());
        assert_eq!(second.status, StatusCode::CREATED);
        assert!(second.replayed());
        assert_eq!(second.body, first.body);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn invalid_keys_are_refused_and_the_handler_never_runs() {
        let (app, calls) = counting_app(builder(&store()).build());
        let long = "k".repeat(129);
        let invalid: Vec<HeaderValue> = vec![
            HeaderValue::from_static(""),
            HeaderValue::from_static("\"\""),
            HeaderValue::from_str(&long).unwrap(),
            HeaderValue::from_str(&format!("\"{long}\"")).unwrap(),
            HeaderValue::from_static("a\tb"),
            HeaderValue::from_static("a b"),
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
            HeaderValue::from_bytes(b"\"unterminated").unwrap(),
            HeaderValue::from_static("\"k\";param=1"),
        ];
        for value in invalid {
            let mut req = post_req("/v1/things", None, "{}");
            req.headers_mut().insert("idempotency-key", value.clone());
            let a = send(&app, req).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{value:?}");
            assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid", "{value:?}");
        }
        // 128 characters is the longest valid key.
        let ok = send(&app, post_req("/v1/things", Some(&"k".repeat(128)), "{}")).await;
        assert_eq!(ok.status, StatusCode::CREATED);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_header_sent_twice_is_invalid() {
        let (app, calls) = counting_app(builder(&store()).build());
        let mut req = post_req("/v1/things", Some("k1"), "{}");
        req.headers_mut().append("idempotency-key", HeaderValue::from_static("k1"));
        let a = send(&app, req).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_missing_key_is_refused_when_required() {
        let (app, calls) = counting_app(builder(&store()).build());
        let a = send(&app, post_req("/v1/things", None, "{}")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST);
        assert_eq!(a.problem_type(), "/problems/idempotency-key-missing");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn problem_base_is_configurable() {
        let (app, _) = counting_app(builder(&store()).problem_base("https://errors.example.com/").build());
        let a = send(&app, post_req("/v1/things", None, "{}")).await;
        assert_eq!(a.problem_type(), "https://errors.example.com/idempotency-key-missing");
    }
}

mod limits {
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

mod replay {
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

mod mismatch {
    use super::*;
    use idempotency_tower::MismatchStatus;

    async fn assert_mismatch(app: &Router, req: Request<Body>, status: StatusCode) {
        let a = send(app, req).await;
        assert_eq!(a.status, status);
        assert_eq!(a.problem_type(), "/problems/idempotency-key-reused");
    }

    #[tokio::test]
    async fn a_different_body_query_or_content_type_is_refused() {
        let (app, calls) = counting_app(builder(&store()).build());
        assert_eq!(
            send(&app, post_req("/v1/things?x=1", Some("k1"), "{\"cpu\":16}")).await.status,
            StatusCode::CREATED
        );
        assert_mismatch(&app, post_req("/v1/things?x=1", Some("k1"), "{\"cpu\":128}"), StatusCode::CONFLICT).await;
        assert_mismatch(&app, post_req("/v1/things?x=2", Some("k1"), "{\"cpu\":16}"), StatusCode::CONFLICT).await;
        let mut ct = post_req("/v1/things?x=1", Some("k1"), "{\"cpu\":16}");
        ct.headers_mut().insert("content-type", HeaderValue::from_static("text/plain"));
        assert_mismatch(&app, ct, StatusCode::CONFLICT).await;
        // The original request still replays.
        assert!(send(&app, post_req("/v1/things?x=1", Some("k1"), "{\"cpu\":16}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn the_mismatch_status_is_configurable() {
        for (setting, status) in [
            (MismatchStatus::UnprocessableContent, StatusCode::UNPROCESSABLE_ENTITY),
            (MismatchStatus::BadRequest, StatusCode::BAD_REQUEST),
            (MismatchStatus::Conflict, StatusCode::CONFLICT),
        ] {
            let (app, calls) = counting_app(builder(&store()).mismatch_status(setting).build());
            send(&app, post_req("/v1/things", Some("k1"), "{\"cpu\":16}")).await;
            assert_mismatch(&app, post_req("/v1/things", Some("k1"), "{\"cpu\":17}"), status).await;
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        }
    }

    #[tokio::test]
    async fn a_mismatch_while_in_flight_is_still_a_mismatch() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/slow",
                post(move || async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    StatusCode::CREATED
                }),
            )
            .layer(builder(&store()).build());
        let a2 = app.clone();
        let first = tokio::spawn(async move { send(&a2, post_req("/v1/slow", Some("k1"), "{\"a\":1}")).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_mismatch(&app, post_req("/v1/slow", Some("k1"), "{\"a\":2}"), StatusCode::CONFLICT).await;
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

mod scope {
    use super::*;

    #[tokio::test]
    async fn the_same_key_on_two_endpoints_runs_twice() {
        let (app, calls) = counting_app(builder(&store()).build());
        let a = send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        let b = send(&app, post_req("/v1/other", Some("k1"), "{}")).await;
        assert!(!a.replayed() && !b.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // The same path with another method is another endpoint too.
        let c = send(&app, Request::put("/v1/things").header("idempotency-key", "k1").body(Body::from("{}")).unwrap())
            .await;
        assert_eq!(c.status, StatusCode::CREATED);
        assert!(!c.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn the_same_key_from_two_principals_runs_twice() {
        let layer = IdempotencyLayer::builder(store())
            .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(idempotency::Principal::new))
            .build();
        let (app, calls) = counting_app(layer);
        let as_user = |user: &'static str| {
            let mut r = post_req("/v1/things", Some("k1"), "{}");
            r.headers_mut().insert("x-user", HeaderValue::from_static(user));
            r
        };
        let a = send(&app, as_user("alice")).await;
        let b = send(&app, as_user("bob")).await;
        assert!(!a.replayed() && !b.replayed());
        assert_ne!(a.body, b.body);
        let a2 = send(&app, as_user("alice")).await;
        assert!(a2.replayed());
        assert_eq!(a2.body, a.body);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // No identity: refused, never run unscoped.
        let anon = send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        assert_eq!(anon.status, StatusCode::UNAUTHORIZED);
        assert_eq!(anon.problem_type(), "/problems/principal-missing");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn the_default_principal_comes_from_the_extensions() {
        let (inner, calls) = counting_app(builder(&store()).build());
        // An auth middleware outside the layer puts the principal in.
        let app =
            inner.layer(axum::middleware::from_fn(|mut req: Request<Body>, next: axum::middleware::Next| async {
                if let Some(user) = req.headers().get("x-user").and_then(|v| v.to_str().ok()).map(str::to_owned) {
                    req.extensions_mut().insert(idempotency::Principal::new(user));
                }
                next.run(req).await
            }));
        let mut a = post_req("/v1/things", Some("k1"), "{}");
        a.headers_mut().insert("x-user", HeaderValue::from_static("alice"));
        let mut b = post_req("/v1/things", Some("k1"), "{}");
        b.headers_mut().insert("x-user", HeaderValue::from_static("bob"));
        assert!(!send(&app, a).await.replayed());
        assert!(!send(&app, b).await.replayed());
        // Without one, everyone shares the opted-in "anonymous" scope.
        assert!(!send(&app, post_req("/v1/things", Some("k1"), "{}")).await.replayed());
        assert!(send(&app, post_req("/v1/things", Some("k1"), "{}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}

mod passthrough {
    use super::*;
    use idempotency_tower::RoutePolicy;

    #[tokio::test]
    async fn get_ignores_the_header() {
        let (app, calls) = counting_app(builder(&store()).build());
        let get = |key: &'static str| Request::get("/v1/things").header("idempotency-key", key).body(Body::empty());
        assert_eq!(send(&app, get("k1").unwrap()).await.status, StatusCode::CREATED);
        let again = send(&app, get("k1").unwrap()).await;
        assert!(!again.replayed());
        assert_eq!(send(&app, get("").unwrap()).await.status, StatusCode::CREATED);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn optional_routes_run_unprotected_without_a_key_and_off_routes_ignore_it() {
        let layer = builder(&store())
            .policy(|_, path| if path == "/v1/other" { RoutePolicy::Off } else { RoutePolicy::Optional })
            .build();
        let (app, calls) = counting_app(layer);
        send(&app, post_req("/v1/things", None, "{}")).await;
        send(&app, post_req("/v1/things", None, "{}")).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        send(&app, post_req("/v1/things", Some("k1"), "{}")).await;
        assert!(send(&app, post_req("/v1/things", Some("k1"), "{}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        // Off: the header is not even parsed.
        assert_eq!(send(&app, post_req("/v1/other", Some(""), "{}")).await.status, StatusCode::CREATED);
        assert!(!send(&app, post_req("/v1/other", Some("k1"), "{}")).await.replayed());
        assert!(!send(&app, post_req("/v1/other", Some("k1"), "{}")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 6);
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
            _: &idempotency::Record,
            _: idempotency::Timestamp,
            _: Duration,
            _: idempotency::Timestamp,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            Err(down())
        }
        async fn heartbeat(
            &self,
            _: &idempotency::Claim,
            _: idempotency::Timestamp,
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
        async fn get(&self, _: &idempotency::Scope) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            Err(down())
        }
        async fn sweep_expired(&self, _: idempotency::Timestamp, _: u32) -> Result<u64, idempotency::StoreError> {
            Err(down())
        }
        async fn ping(&self) -> Result<(), idempotency::StoreError> {
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
            r: &idempotency::Record,
            t: idempotency::Timestamp,
            d: Duration,
            e: idempotency::Timestamp,
        ) -> Result<Option<idempotency::Claim>, idempotency::StoreError> {
            DownStore.reclaim(r, t, d, e).await
        }
        async fn heartbeat(
            &self,
            c: &idempotency::Claim,
            t: idempotency::Timestamp,
        ) -> Result<(), idempotency::StoreError> {
            DownStore.heartbeat(c, t).await
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
        async fn get(&self, s: &idempotency::Scope) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
            DownStore.get(s).await
        }
        async fn sweep_expired(&self, t: idempotency::Timestamp, n: u32) -> Result<u64, idempotency::StoreError> {
            DownStore.sweep_expired(t, n).await
        }
        async fn ping(&self) -> Result<(), idempotency::StoreError> {
            DownStore.ping().await
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

mod concurrency {
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

mod context {
    use super::*;
    use axum::Extension;
    use idempotency_tower::IdempotencyContext;

    #[tokio::test]
    async fn sub_keys_are_stable_across_a_failed_attempt_and_its_retry() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move |Extension(ctx): Extension<IdempotencyContext>| async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    let status = if n == 0 { StatusCode::BAD_GATEWAY } else { StatusCode::CREATED };
                    let body = format!("{} {} {} {}", ctx.derive("alloc"), ctx.key(), ctx.principal(), ctx.attempt());
                    (status, body)
                }),
            )
            .route(
                "/v1/read",
                get(|ctx: Option<Extension<IdempotencyContext>>| async move { ctx.is_some().to_string() }),
            )
            .layer(builder(&store()).build());
        let a = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        let b = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        let (a, b) = (a.text().to_owned(), b.text().to_owned());
        let (a_parts, b_parts): (Vec<&str>, Vec<&str>) = (a.split(' ').collect(), b.split(' ').collect());
        assert!(a_parts[0].starts_with("sk-"));
        assert_eq!(a_parts[0], b_parts[0], "the same record, the same sub-key");
        assert_eq!(&a_parts[1..3], ["k1", "anonymous"]);
        assert_eq!((a_parts[3], b_parts[3]), ("1", "2"));
        let c = send(&app, post_req("/v1/op", Some("k2"), "{}")).await;
        assert_ne!(c.text().split(' ').next(), Some(a_parts[0]));
        let read =
            send(&app, Request::get("/v1/read").header("idempotency-key", "k1").body(Body::empty()).unwrap()).await;
        assert_eq!(read.text(), "false");
    }
}

mod expiry {
    use super::*;

    #[tokio::test]
    async fn after_retention_the_sweeper_frees_the_key() {
        let store = store();
        let (app, calls) = counting_app(builder(&store).retention(Duration::from_millis(100)).build());
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

/// A few key cases against the SQLite store, each test with its own database file.
mod sqlite {
    use super::*;
    use idempotency_sqlx::SqliteStore;

    async fn sqlite_store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::connect(dir.path().join("idem.db").to_str().expect("path")).await.expect("open");
        store.migrate().await.expect("migrate");
        (dir, Arc::new(store))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_duplicates_run_once_and_replay_exactly() {
        let (_dir, store) = sqlite_store().await;
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/slow",
                post(move || async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    (StatusCode::CREATED, [("location", "/v1/slow/1")], format!("call {n}"))
                }),
            )
            .layer(IdempotencyLayer::builder(store).allow_anonymous(idempotency::Principal::new("a")).build());
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { send(&app, post_req("/v1/slow", Some("dup"), "{}")).await })
            })
            .collect();
        let mut originals = 0;
        for t in tasks {
            let a = t.await.unwrap();
            match a.status {
                StatusCode::CREATED if !a.replayed() => originals += 1,
                StatusCode::CREATED => assert_eq!(a.text(), "call 0"),
                StatusCode::CONFLICT => assert_eq!(a.problem_type(), "/problems/request-in-progress"),
                s => panic!("unexpected {s}: {a:?}"),
            }
        }
        assert_eq!((originals, calls.load(Ordering::SeqCst)), (1, 1));
        let replay = send(&app, post_req("/v1/slow", Some("dup"), "{}")).await;
        assert_eq!((replay.replayed(), replay.text()), (true, "call 0"));
        assert_eq!(replay.headers["location"], "/v1/slow/1");
        let other = send(&app, post_req("/v1/slow", Some("dup"), "{\"x\":1}")).await;
        assert_eq!(other.problem_type(), "/problems/idempotency-key-reused");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failures_rerun_and_stale_claims_are_fenced() {
        let (_dir, store) = sqlite_store().await;
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move || async move {
                    match c.fetch_add(1, Ordering::SeqCst) {
                        0 => (StatusCode::SERVICE_UNAVAILABLE, "down"),
                        1 => {
                            tokio::time::sleep(Duration::from_millis(700)).await;
                            (StatusCode::CREATED, "slow attempt")
                        }
                        _ => (StatusCode::CREATED, "taking over"),
                    }
                }),
            )
            .layer(
                IdempotencyLayer::builder(unrenewed(store))
                    .allow_anonymous(idempotency::Principal::new("a"))
                    .in_flight_ttl(Duration::from_millis(200))
                    .build(),
            );
        assert_eq!(send(&app, post_req("/v1/op", Some("k1"), "{}")).await.status, StatusCode::SERVICE_UNAVAILABLE);
        let a2 = app.clone();
        let slow = tokio::spawn(async move { send(&a2, post_req("/v1/op", Some("k1"), "{}")).await });
        tokio::time::sleep(Duration::from_millis(350)).await;
        let over = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((over.status, over.replayed(), over.text()), (StatusCode::CREATED, false, "taking over"));
        assert_eq!(slow.await.unwrap().text(), "slow attempt");
        let replay = send(&app, post_req("/v1/op", Some("k1"), "{}")).await;
        assert_eq!((replay.replayed(), replay.text()), (true, "taking over"));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
