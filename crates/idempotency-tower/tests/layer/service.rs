//! The layer in a real stack: the request context, the inner service, and the SQLite store.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use http::{Request, StatusCode};
use idempotency::{MemoryStore, Store};
use idempotency_tower::IdempotencyLayer;

use crate::fixture::*;

mod context {
    use super::*;
    use idempotency_tower::IdempotencyContext;

    #[tokio::test]
    async fn sub_keys_are_stable_across_a_failed_attempt_and_its_retry() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let app = Router::new()
            .route(
                "/v1/op",
                post(move |ctx: IdempotencyContext| async move {
                    let n = c.fetch_add(1, Ordering::SeqCst);
                    let status = if n == 0 { StatusCode::BAD_GATEWAY } else { StatusCode::CREATED };
                    let body = format!("{} {} {} {}", ctx.derive("alloc"), ctx.key(), ctx.principal(), ctx.attempt());
                    (status, body)
                }),
            )
            .route("/v1/read", get(|ctx: Option<IdempotencyContext>| async move { ctx.is_some().to_string() }))
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

mod inner_service {
    use super::*;
    use tower::Layer;

    /// As with tower-http's services, the wrapped service can be read, changed and taken back.
    #[tokio::test]
    async fn the_inner_service_is_reachable() {
        let mut service = builder_for_p(Arc::new(MemoryStore::new())).build().layer(vec![1]);
        service.get_mut().push(2);
        assert_eq!(service.get_ref(), &[1, 2]);
        assert_eq!(service.into_inner(), [1, 2]);
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
