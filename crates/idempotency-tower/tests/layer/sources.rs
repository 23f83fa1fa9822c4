//! Other key sources (docs/protocol.md#records), opt-in per route: `Repeatability-Request-ID` with
//! `Repeatability-First-Sent` and `Repeatability-Result`, and a JSON body field (AIP-155's
//! `request_id`). Each names the same record as `Idempotency-Key`; two different keys are refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idempotency::{MemoryStore, Store};
use idempotency_tower::{IdempotencyLayer, KeySources, RoutePolicy};
use tokio::sync::Semaphore;

use crate::fixture::*;

/// Routes under `/azure/` take `Repeatability-Request-ID`, under `/google/` the body field
/// `request_id`, under `/optional/` the body field on an `Optional` route; `/plain` only
/// `Idempotency-Key`. Every handler counts its calls and answers `201 call <n>`.
fn app(layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let handler = move || async move {
        let n = c.fetch_add(1, Ordering::SeqCst);
        (StatusCode::CREATED, [("content-type", "text/plain")], format!("call {n}"))
    };
    let app = Router::new()
        .route("/azure/things", post(handler.clone()))
        .route("/google/things", post(handler.clone()))
        .route("/optional/things", post(handler.clone()))
        .route("/plain", post(handler))
        .layer(layer);
    (app, calls)
}

fn layer(store: &Arc<MemoryStore>, retention: Duration) -> IdempotencyLayer {
    builder(store)
        .retention(retention)
        .policy(|_, path| if path.starts_with("/optional/") { RoutePolicy::Optional } else { RoutePolicy::Required })
        .key_sources(|_, path| match path {
            p if p.starts_with("/azure/") => KeySources::default().repeatability(),
            p if p.starts_with("/google/") || p.starts_with("/optional/") => {
                KeySources::default().body_field(idempotency_tower::AIP_155_REQUEST_ID)
            }
            _ => KeySources::default(),
        })
        .build()
}

fn first_sent(ago: Duration) -> String {
    httpdate::fmt_http_date(SystemTime::now() - ago)
}

/// A POST with `headers` and a JSON `body`.
fn req(path: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(Body::from(body.to_owned())).expect("request")
}

fn result(a: &Answer) -> &str {
    a.headers
        .get("repeatability-result")
        .unwrap_or_else(|| panic!("no Repeatability-Result: {a:?}"))
        .to_str()
        .expect("ascii")
}

fn anonymous_scope(path: &str, key: &str) -> idempotency::Scope {
    idempotency::Scope::new(
        idempotency::Principal::new("anonymous"),
        idempotency::Endpoint::new("POST", path),
        idempotency::IdempotencyKey::try_from(key).expect("key"),
    )
}

mod repeatability {
    use super::*;

    #[tokio::test]
    async fn the_request_id_is_the_same_record_as_idempotency_key_and_every_answer_says_accepted() {
        let store = store();
        let (app, calls) = app(layer(&store, Duration::from_secs(3600)));
        let sent = first_sent(Duration::from_secs(5));
        let rid = [("repeatability-request-id", "rr-1"), ("repeatability-first-sent", sent.as_str())];

        let first = send(&app, req("/azure/things", &rid, "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert_eq!(first.text(), "call 0");
        assert!(!first.replayed());
        assert_eq!(result(&first), "accepted");
        assert!(first.headers.get("idempotency-key-expires").is_some(), "{first:?}");

        let again = send(&app, req("/azure/things", &rid, "{}")).await;
        assert_eq!((again.status, again.text(), again.replayed()), (StatusCode::CREATED, "call 0", true));
        assert_eq!(result(&again), "accepted");

        // The same value as an Idempotency-Key is the same record; alongside it, the same key.
        let as_key = send(&app, req("/azure/things", &[("idempotency-key", "rr-1")], "{}")).await;
        assert_eq!((as_key.status, as_key.text(), as_key.replayed()), (StatusCode::CREATED, "call 0", true));
        assert!(as_key.headers.get("repeatability-result").is_none(), "no request id, no result: {as_key:?}");
        let both = [rid[0], rid[1], ("idempotency-key", "\"rr-1\"")];
        let both = send(&app, req("/azure/things", &both, "{}")).await;
        assert_eq!((both.status, both.replayed()), (StatusCode::CREATED, true), "{both:?}");
        assert_eq!(result(&both), "accepted");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(store.get(&anonymous_scope("/azure/things", "rr-1")).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn first_sent_older_than_the_retention_is_412_rejected_and_runs_nothing() {
        let store = store();
        let (app, calls) = app(layer(&store, Duration::from_secs(600)));
        let old = first_sent(Duration::from_secs(601));
        let a = send(
            &app,
            req("/azure/things", &[("repeatability-request-id", "rr-old"), ("repeatability-first-sent", &old)], "{}"),
        )
        .await;
        assert_eq!(a.status, StatusCode::PRECONDITION_FAILED, "{a:?}");
        assert_eq!(a.problem_type(), "/problems/repeatability-expired");
        assert_eq!(result(&a), "rejected");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert!(store.get(&anonymous_scope("/azure/things", "rr-old")).await.unwrap().is_none());

        // Within the window (and a client clock ahead of ours) it runs.
        for (id, ago) in [
            ("rr-recent", first_sent(Duration::from_secs(590))),
            ("rr-ahead", { httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(60)) }),
        ] {
            let a = send(
                &app,
                req("/azure/things", &[("repeatability-request-id", id), ("repeatability-first-sent", &ago)], "{}"),
            )
            .await;
            assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
            assert_eq!(result(&a), "accepted");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_missing_or_bad_first_sent_or_a_bad_id_is_400_rejected() {
        let (app, calls) = app(layer(&store(), Duration::from_secs(3600)));
        let now = first_sent(Duration::ZERO);
        let cases: [&[(&str, &str)]; 6] = [
            &[("repeatability-request-id", "rr-1")],
            &[("repeatability-request-id", "rr-1"), ("repeatability-first-sent", "yesterday")],
            &[
                ("repeatability-request-id", "rr-1"),
                ("repeatability-first-sent", &now),
                ("repeatability-first-sent", &now),
            ],
            &[("repeatability-request-id", ""), ("repeatability-first-sent", &now)],
            &[("repeatability-request-id", "a b"), ("repeatability-first-sent", &now)],
            &[("repeatability-request-id", "a"), ("repeatability-request-id", "a"), ("repeatability-first-sent", &now)],
        ];
        for headers in cases {
            let a = send(&app, req("/azure/things", headers, "{}")).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{headers:?}: {a:?}");
            assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid", "{headers:?}");
            assert_eq!(result(&a), "rejected", "{headers:?}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_different_idempotency_key_alongside_is_400_and_runs_nothing() {
        let store = store();
        let (app, calls) = app(layer(&store, Duration::from_secs(3600)));
        let now = first_sent(Duration::ZERO);
        let headers =
            [("idempotency-key", "k-a"), ("repeatability-request-id", "k-b"), ("repeatability-first-sent", &now)];
        let a = send(&app, req("/azure/things", &headers, "{}")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
        assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid");
        assert!(a.text().contains("two different keys"), "{}", a.text());
        assert_eq!(result(&a), "rejected");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        for key in ["k-a", "k-b"] {
            assert!(store.get(&anonymous_scope("/azure/things", key)).await.unwrap().is_none());
        }
    }

    #[tokio::test]
    async fn a_route_that_did_not_opt_in_ignores_the_header() {
        let (app, calls) = app(layer(&store(), Duration::from_secs(3600)));
        let now = first_sent(Duration::ZERO);
        let headers = [("repeatability-request-id", "rr-1"), ("repeatability-first-sent", now.as_str())];
        let a = send(&app, req("/plain", &headers, "{}")).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
        assert_eq!(a.problem_type(), "/problems/idempotency-key-missing");
        assert!(a.headers.get("repeatability-result").is_none(), "{a:?}");
        // And an expired first sending on such a route is not judged either.
        let old = first_sent(Duration::from_secs(7200));
        let headers = [("idempotency-key", "k"), ("repeatability-request-id", "x"), ("repeatability-first-sent", &old)];
        let a = send(&app, req("/plain", &headers, "{}")).await;
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    /// 16 requests with one Repeatability-Request-ID at once, the handler held until all of
    /// them were answered: one execution, 15 `409 rejected`; after it completes, 16 more at once
    /// all replay, `accepted`, and the handler still ran once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixteen_concurrent_requests_with_one_request_id_run_the_handler_once() {
        let calls = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (c, g) = (calls.clone(), gate.clone());
        let app = Router::new()
            .route(
                "/azure/held",
                post(move || async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    g.acquire().await.expect("gate").forget();
                    (StatusCode::CREATED, format!("call {n}"))
                }),
            )
            .layer(layer(&store(), Duration::from_secs(3600)));
        let sent = first_sent(Duration::from_secs(1));
        let burst = |app: Router, sent: String| async move {
            let barrier = Arc::new(tokio::sync::Barrier::new(16));
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let (app, barrier, sent) = (app.clone(), barrier.clone(), sent.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        let headers =
                            [("repeatability-request-id", "rr-burst"), ("repeatability-first-sent", sent.as_str())];
                        send(&app, req("/azure/held", &headers, "{}")).await
                    })
                })
                .collect();
            tasks
        };
        let first = burst(app.clone(), sent.clone()).await;
        // The 15 duplicates are answered while the one execution is held at the gate.
        wait_until("15 duplicates are answered", Duration::from_secs(30), async || {
            first.iter().filter(|t| t.is_finished()).count() >= 15
        })
        .await;
        assert_eq!(first.iter().filter(|t| t.is_finished()).count(), 15, "one request is held in the handler");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        gate.add_permits(1);
        let (mut executed, mut refused) = (0, 0);
        for t in first {
            let a = t.await.unwrap();
            match a.status {
                StatusCode::CREATED => {
                    assert_eq!((a.text(), a.replayed()), ("call 0", false), "{a:?}");
                    assert_eq!(result(&a), "accepted");
                    executed += 1;
                }
                _ => {
                    assert_eq!(a.status, StatusCode::CONFLICT, "{a:?}");
                    assert_eq!(a.problem_type(), "/problems/request-in-progress");
                    assert_eq!(result(&a), "rejected");
                    refused += 1;
                }
            }
        }
        assert_eq!((executed, refused), (1, 15));

        for t in burst(app, sent).await {
            let a = t.await.unwrap();
            assert_eq!((a.status, a.text(), a.replayed()), (StatusCode::CREATED, "call 0", true), "{a:?}");
            assert_eq!(result(&a), "accepted");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one execution for 32 requests");
    }
}

mod body_field {
    use super::*;

    #[tokio::test]
    async fn request_id_in_the_body_is_the_key_and_the_same_record_as_the_header() {
        let store = store();
        let (app, calls) = app(layer(&store, Duration::from_secs(3600)));
        let body = r#"{"name":"w","request_id":"0f1e2d3c-aaaa-4bbb-8ccc-123456789abc"}"#;
        let first = send(&app, req("/google/things", &[], body)).await;
        assert_eq!((first.status, first.text(), first.replayed()), (StatusCode::CREATED, "call 0", false));
        assert!(first.headers.get("idempotency-key-expires").is_some(), "{first:?}");
        assert!(first.headers.get("repeatability-result").is_none(), "{first:?}");
        let again = send(&app, req("/google/things", &[], body)).await;
        assert_eq!((again.status, again.text(), again.replayed()), (StatusCode::CREATED, "call 0", true));
        // The same key in the header (and in both places) names the same record.
        let key = [("idempotency-key", "0f1e2d3c-aaaa-4bbb-8ccc-123456789abc")];
        let both = send(&app, req("/google/things", &key, body)).await;
        assert_eq!((both.status, both.replayed()), (StatusCode::CREATED, true), "{both:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let scope = anonymous_scope("/google/things", "0f1e2d3c-aaaa-4bbb-8ccc-123456789abc");
        assert!(store.get(&scope).await.unwrap().is_some());

        // Another body with the key: the fingerprint differs, so it is the mismatch, not a run.
        let other = r#"{"name":"x","request_id":"0f1e2d3c-aaaa-4bbb-8ccc-123456789abc"}"#;
        let a = send(&app, req("/google/things", &[], other)).await;
        assert_eq!(a.status, StatusCode::CONFLICT, "{a:?}");
        assert_eq!(a.problem_type(), "/problems/idempotency-key-reused");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_header_key_different_from_the_body_field_is_400_and_runs_nothing() {
        let store = store();
        let (app, calls) = app(layer(&store, Duration::from_secs(3600)));
        let a = send(&app, req("/google/things", &[("idempotency-key", "k-a")], r#"{"request_id":"k-b"}"#)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{a:?}");
        assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid");
        assert!(a.text().contains("two different keys"), "{}", a.text());
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        for key in ["k-a", "k-b"] {
            assert!(store.get(&anonymous_scope("/google/things", key)).await.unwrap().is_none());
        }
    }

    #[tokio::test]
    async fn a_field_that_is_not_a_valid_key_is_400_and_no_key_at_all_is_missing() {
        let (app, calls) = app(layer(&store(), Duration::from_secs(3600)));
        for body in [r#"{"request_id":42}"#, r#"{"request_id":""}"#, r#"{"request_id":"has space"}"#] {
            let a = send(&app, req("/google/things", &[], body)).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {a:?}");
            assert_eq!(a.problem_type(), "/problems/idempotency-key-invalid", "{body}");
        }
        for body in ["{}", r#"{"request_id":null}"#, "not json", r#"{"inner":{"request_id":"k"}}"#] {
            let a = send(&app, req("/google/things", &[], body)).await;
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {a:?}");
            assert_eq!(a.problem_type(), "/problems/idempotency-key-missing", "{body}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        // A route without the option does not read the field.
        let a = send(&app, req("/plain", &[], r#"{"request_id":"k"}"#)).await;
        assert_eq!(a.problem_type(), "/problems/idempotency-key-missing");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn on_an_optional_route_a_body_without_the_field_runs_unprotected_and_one_with_it_once() {
        let (app, calls) = app(layer(&store(), Duration::from_secs(3600)));
        for _ in 0..2 {
            let a = send(&app, req("/optional/things", &[], r#"{"name":"w"}"#)).await;
            assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
            assert!(a.headers.get("idempotency-key-expires").is_none(), "unprotected: {a:?}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        for _ in 0..2 {
            let a = send(&app, req("/optional/things", &[], r#"{"name":"w","request_id":"opt-1"}"#)).await;
            assert_eq!((a.status, a.text()), (StatusCode::CREATED, "call 2"), "{a:?}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
