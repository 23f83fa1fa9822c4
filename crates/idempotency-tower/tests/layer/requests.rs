//! How a request maps to a record: header forms, scopes, path spellings, keys with commas,
//! requests without a principal, what passes through untouched, and fingerprint mismatches.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{HeaderValue, Request, StatusCode};
use idempotency::{MemoryStore, Principal};
use idempotency_tower::IdempotencyLayer;

use crate::fixture::*;

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

    /// A base read at run time (from configuration, say) is an owned string.
    #[tokio::test]
    async fn problem_base_can_be_an_owned_string() {
        let host = String::from("errors.internal");
        let (app, _) = counting_app(builder(&store()).problem_base(format!("https://{host}/p/")).build());
        let a = send(&app, post_req("/v1/things", None, "{}")).await;
        assert_eq!(a.problem_type(), "https://errors.internal/p/idempotency-key-missing");
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

/// Issue 12 item 1: the scope's endpoint is the normalized path, so every spelling of one path
/// is one record (and one fingerprint).
mod aliased_paths {
    use super::*;

    #[tokio::test]
    async fn every_spelling_of_one_path_is_one_record() {
        let (app, calls) = counting_route(
            "/v1/workers/{id}/reboot",
            Duration::ZERO,
            builder_for_p(Arc::new(MemoryStore::new())).build(),
        );
        let first = send(&app, post_key("/v1/workers/wkr-1/reboot", "k1")).await;
        assert_eq!((first.status, first.replayed()), (StatusCode::CREATED, false));
        for alias in [
            "/v1/workers/%77kr-1/reboot",
            "/v1/workers/wkr%2D1/reboot",
            "/v1/workers/wkr%2d1/reboot",
            "/v1/workers/wkr-1/%72eboot",
            "/v1/%77orkers/wkr-1/reboot",
        ] {
            let again = send(&app, post_key(alias, "k1")).await;
            assert_eq!(
                (again.status, again.replayed(), again.text()),
                (StatusCode::CREATED, true, "call 0"),
                "{alias}"
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one reboot per key, whatever the spelling");
        // Another worker is another record.
        let other = send(&app, post_key("/v1/workers/wkr-2/reboot", "k1")).await;
        assert_eq!((other.status, other.replayed()), (StatusCode::CREATED, false));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_changed_body_on_an_aliased_path_is_still_a_mismatch() {
        let (app, calls) = counting_route(
            "/v1/workers/{id}/reboot",
            Duration::ZERO,
            builder_for_p(Arc::new(MemoryStore::new())).build(),
        );
        send(&app, post_key("/v1/workers/wkr-1/reboot", "k1")).await;
        let mut changed = post_key("/v1/workers/%77kr-1/reboot", "k1");
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
        let (app, calls) =
            counting_route("/v1/things", Duration::ZERO, builder_for_p(Arc::new(MemoryStore::new())).build());
        for bare in ["a,b", "a,", ",b", "k1,k2"] {
            let r = send(&app, post_key("/v1/things", bare)).await;
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bare}");
            assert_eq!(r.problem_type(), "/problems/idempotency-key-invalid");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        let quoted = send(&app, post_key("/v1/things", r#""a,b""#)).await;
        assert_eq!((quoted.status, quoted.replayed()), (StatusCode::CREATED, false));
        let again = send(&app, post_key("/v1/things", r#""a,b""#)).await;
        assert!(again.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// Issue 17 item 6: no principal, no record, unless the service opted in.
mod anonymous {
    use super::*;

    #[tokio::test]
    async fn a_request_without_a_principal_is_refused_by_default() {
        let (app, calls) =
            counting_route("/v1/things", Duration::ZERO, IdempotencyLayer::new(Arc::new(MemoryStore::new())));
        for _ in 0..2 {
            let r = send(&app, post_key("/v1/things", "k1")).await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED);
            assert_eq!(r.problem_type(), "/problems/principal-missing");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 0, "never run unscoped");
    }

    #[tokio::test]
    async fn a_shared_anonymous_scope_is_an_explicit_opt_in() {
        let layer =
            IdempotencyLayer::builder(Arc::new(MemoryStore::new())).allow_anonymous(Principal::new("anyone")).build();
        let (app, calls) = counting_route("/v1/things", Duration::ZERO, layer);
        assert!(!send(&app, post_key("/v1/things", "k1")).await.replayed());
        assert!(send(&app, post_key("/v1/things", "k1")).await.replayed());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
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
