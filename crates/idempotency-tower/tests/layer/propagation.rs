//! Key propagation (docs/protocol.md#records): a protected handler's outgoing calls through
//! [`PropagateIdempotencyKey`] carry `Idempotency-Key: "<sub-key>"`, the same on every retry of
//! the record, checked at a real downstream server that records the headers it gets.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use http::{HeaderMap, StatusCode};
use idempotency_tower::{CallKey, IdempotencyContext, PropagateIdempotencyKey, SideEffect};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};

use crate::fixture::*;

/// The calls a downstream got: path and `Idempotency-Key`.
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A downstream on a real port that records the `Idempotency-Key` of every call it gets
/// (`None` for a call without one), by path.
async fn downstream() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let record = |State(seen): State<Seen>, uri: http::Uri, headers: HeaderMap| async move {
        let key = headers.get("idempotency-key").map(|v| v.to_str().expect("ascii").to_owned());
        seen.lock().unwrap().push((uri.path().to_owned(), key));
        StatusCode::ACCEPTED
    };
    let app = Router::new().route("/boot", post(record)).route("/log", post(record)).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

fn client() -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new()).with(PropagateIdempotencyKey).build()
}

#[tokio::test]
async fn a_handlers_named_call_carries_the_records_sub_key_the_same_on_every_retry() {
    let (url, seen) = downstream().await;
    let derived: Arc<Mutex<Vec<String>>> = Arc::default();
    let (d, u) = (derived.clone(), url.clone());
    // The first attempt fails after its calls (500, nothing stored); the retry runs again.
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/v1/provision",
            post(move |ctx: IdempotencyContext| {
                let (d, u, attempts) = (d.clone(), u.clone(), attempts.clone());
                async move {
                    d.lock().unwrap().push(ctx.derive("boot").as_str().to_owned());
                    let client = client();
                    let boot = client.post(format!("{u}/boot")).with_extension(SideEffect::new("boot"));
                    assert_eq!(boot.send().await.expect("boot").status(), 202);
                    // A call that names no side effect goes out without a key.
                    assert_eq!(client.post(format!("{u}/log")).send().await.expect("log").status(), 202);
                    if attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "the first attempt fails");
                    }
                    (StatusCode::CREATED, "provisioned")
                }
            }),
        )
        .layer(builder(&store()).build());

    let a = send(&app, post_key("/v1/provision", "prov-1")).await;
    assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{a:?}");
    let a = send(&app, post_key("/v1/provision", "prov-1")).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let other = send(&app, post_key("/v1/provision", "prov-2")).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");

    let derived = derived.lock().unwrap().clone();
    assert_eq!(derived.len(), 3);
    assert_eq!(derived[0], derived[1], "a retry derives the same sub-key");
    assert_ne!(derived[0], derived[2], "another key, another sub-key");
    let seen = seen.lock().unwrap().clone();
    let boots: Vec<_> = seen.iter().filter(|(p, _)| p == "/boot").map(|(_, k)| k.clone()).collect();
    let quoted = |k: &str| Some(format!("\"{k}\""));
    assert_eq!(boots, [quoted(&derived[0]), quoted(&derived[1]), quoted(&derived[2])]);
    assert!(seen.iter().filter(|(p, _)| p == "/log").all(|(_, k)| k.is_none()), "{seen:?}");
}

#[tokio::test]
async fn outside_a_handler_only_a_given_sub_key_is_sent_and_a_callers_own_key_is_kept() {
    let (url, seen) = downstream().await;
    let client = client();
    // No protected request: a named side effect has no record to derive from.
    client.post(format!("{url}/boot")).with_extension(SideEffect::new("boot")).send().await.expect("call");
    // A sub-key given outright (a resumed intent's tag) is sent as is.
    client.post(format!("{url}/boot")).with_extension(CallKey::new("wkr-7.boot")).send().await.expect("call");
    // A key the caller set itself is left alone.
    client
        .post(format!("{url}/boot"))
        .header("idempotency-key", "own")
        .with_extension(CallKey::new("other"))
        .send()
        .await
        .expect("call");
    let keys: Vec<_> = seen.lock().unwrap().iter().map(|(_, k)| k.clone()).collect();
    assert_eq!(keys, [None, Some("\"wkr-7.boot\"".to_owned()), Some("own".to_owned())]);
}
