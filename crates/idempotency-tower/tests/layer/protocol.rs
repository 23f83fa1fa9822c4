//! The protocol headers of docs/protocol.md#records: `Idempotency-Key-Expires` on every response that has a
//! record, and `Prefer: wait=N`, which attaches a retry to the request in flight with its key.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idempotency::faulty::{FaultyStore, Op};
use idempotency::{MemoryStore, Principal, Store};
use idempotency_tower::IdempotencyLayer;
use tokio::sync::Semaphore;

use crate::fixture::*;

/// A route whose handler counts its calls, then holds until the test lets it go (one permit per
/// call), then answers `201 call <n>`; a body `"fail"` answers 500 instead.
fn gated_app(layer: IdempotencyLayer) -> (Router, Arc<AtomicUsize>, Arc<Semaphore>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let (c, g) = (calls.clone(), gate.clone());
    let app = Router::new()
        .route(
            "/v1/gated",
            post(move |body: String| async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                g.acquire().await.expect("gate").forget();
                if body == "fail" {
                    return (StatusCode::INTERNAL_SERVER_ERROR, format!("call {n} failed"));
                }
                (StatusCode::CREATED, format!("call {n}"))
            }),
        )
        .layer(layer);
    (app, calls, gate)
}

fn gated(key: &str, prefer: Option<&str>, body: &'static str) -> Request<Body> {
    let mut b = Request::post("/v1/gated").header("idempotency-key", key);
    if let Some(p) = prefer {
        b = b.header("prefer", p);
    }
    b.body(Body::from(body)).expect("request")
}

fn expires(a: &Answer) -> SystemTime {
    let v = a.headers.get("idempotency-key-expires").unwrap_or_else(|| panic!("no Idempotency-Key-Expires: {a:?}"));
    let v = v.to_str().expect("ascii");
    assert!(v.ends_with(" GMT") && v.len() == 29, "not an IMF-fixdate: {v}");
    httpdate::parse_http_date(v).expect("an HTTP-date")
}

/// A memory store that counts its calls, and a layer builder over it.
fn counted() -> (Arc<FaultyStore<MemoryStore>>, idempotency_tower::IdempotencyLayerBuilder) {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let builder =
        IdempotencyLayer::builder(store.clone() as Arc<dyn Store>).allow_anonymous(Principal::new("anonymous"));
    (store, builder)
}

/// Waits until a waiter has found the record in flight and started waiting: it reads the record
/// again (`get`) only after its first wait.
async fn until_waiting(store: &FaultyStore<MemoryStore>) {
    wait_until("a request waits", Duration::from_secs(30), async || store.calls(Op::Get) >= 1).await;
}

async fn until_called(calls: &Arc<AtomicUsize>, n: usize) {
    wait_until("the handler runs", Duration::from_secs(30), async || calls.load(Ordering::SeqCst) >= n).await;
}

mod expires_header {
    use super::*;

    #[tokio::test]
    async fn first_execution_replay_mismatch_and_in_flight_carry_the_records_expiry() {
        let retention = Duration::from_secs(3 * 3600);
        let (app, calls, gate) = gated_app(builder(&store()).retention(retention).build());
        let before = SystemTime::now();

        // In flight: the 409 says until when the claim's record is kept.
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("k1", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let busy = send(&app, gated("k1", None, "a")).await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        let in_flight_expiry = expires(&busy);
        gate.add_permits(1);
        let first = first.await.expect("first");
        let after = SystemTime::now();

        assert_eq!(first.status, StatusCode::CREATED);
        let stored = expires(&first);
        // Whole seconds: the date is truncated to the second.
        let low = before + retention - Duration::from_secs(1);
        let high = after + retention + Duration::from_secs(1);
        assert!(low <= stored && stored <= high, "{stored:?} not within {low:?}..{high:?}");
        assert!(low <= in_flight_expiry && in_flight_expiry <= high);

        let replay = send(&app, gated("k1", None, "a")).await;
        assert!(replay.replayed());
        assert_eq!(expires(&replay), stored, "a replay says the stored record's expiry");

        let mismatch = send(&app, gated("k1", None, "b")).await;
        assert_eq!(mismatch.status, StatusCode::CONFLICT);
        assert_eq!(mismatch.problem_type(), "/problems/idempotency-key-reused");
        assert_eq!(expires(&mismatch), stored);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn no_expiry_without_a_record() {
        let (app, _calls, gate) = gated_app(builder(&store()).build());
        gate.add_permits(1);
        // A 5xx is not stored: the key is free at once, there is no expiry to tell.
        let failed = send(&app, gated("k2", None, "fail")).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(failed.headers.get("idempotency-key-expires").is_none(), "{failed:?}");
        let missing = send(&app, Request::post("/v1/gated").body(Body::from("a")).expect("request")).await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert!(missing.headers.get("idempotency-key-expires").is_none());
    }
}

mod prefer_wait {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retry_that_prefers_to_wait_gets_the_replay_of_the_running_request() {
        let (store, builder) = counted();
        let (app, calls, gate) = gated_app(builder.build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w1", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let waiter = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w1", Some("respond-async, WAIT = 10"), "a")).await }
        });
        // The waiter is attached, not answered 409: let the first one finish only now.
        until_waiting(&store).await;
        gate.add_permits(1);
        let (first, waited) = (first.await.expect("first"), waiter.await.expect("waiter"));
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
        assert!(waited.replayed());
        assert_eq!(waited.body, first.body);
        assert_eq!(waited.headers["preference-applied"], "wait=10");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn still_in_flight_after_the_wait_is_the_usual_409() {
        let (app, calls, gate) = gated_app(builder(&store()).build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w2", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let busy = send(&app, gated("w2", Some("wait=1"), "a")).await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        assert_eq!(busy.problem_type(), "/problems/request-in-progress");
        assert!(busy.headers.contains_key("retry-after"));
        assert_eq!(busy.headers["preference-applied"], "wait=1");
        gate.add_permits(1);
        assert_eq!(first.await.expect("first").status, StatusCode::CREATED);
    }

    #[tokio::test]
    async fn the_wait_is_bounded_by_max_wait() {
        let (app, calls, gate) = gated_app(builder(&store()).max_wait(Duration::from_secs(1)).build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w3", None, "a")).await }
        });
        until_called(&calls, 1).await;
        // Asked for an hour, got a second: answered while the first still runs.
        let busy = send(&app, gated("w3", Some("wait=3600"), "a")).await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        assert_eq!(busy.headers["preference-applied"], "wait=1");
        gate.add_permits(1);
        first.await.expect("first");
    }

    #[tokio::test]
    async fn without_the_preference_the_answer_is_at_once() {
        let (app, calls, gate) = gated_app(builder(&store()).build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w4", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let busy = send(&app, gated("w4", Some("respond-async"), "a")).await;
        assert_eq!(busy.status, StatusCode::CONFLICT);
        assert!(busy.headers.get("preference-applied").is_none());
        gate.add_permits(1);
        first.await.expect("first");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn thirty_two_waiters_attach_to_one_execution() {
        let (store, builder) = counted();
        let (app, calls, gate) = gated_app(builder.build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w5", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let waiters: Vec<_> = (0..32)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { send(&app, gated("w5", Some("wait=30"), "a")).await })
            })
            .collect();
        // Every one has read the record (in flight) before it completes.
        wait_until("all waiters read the record", Duration::from_secs(30), async || {
            store.calls(Op::Claim) >= 33 && store.calls(Op::Get) >= 1
        })
        .await;
        gate.add_permits(1);
        let first = first.await.expect("first");
        for w in waiters {
            let a = w.await.expect("waiter");
            assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
            assert_eq!(a.body, first.body);
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "one execution for 33 requests");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_takes_over_a_record_whose_attempt_failed() {
        let (store, builder) = counted();
        let (app, calls, gate) = gated_app(builder.build());
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w6", None, "fail")).await }
        });
        until_called(&calls, 1).await;
        let waiter = tokio::spawn({
            let app = app.clone();
            async move { send(&app, gated("w6", Some("wait=10"), "fail")).await }
        });
        until_waiting(&store).await;
        gate.add_permits(2);
        assert_eq!(first.await.expect("first").status, StatusCode::INTERNAL_SERVER_ERROR);
        let again = waiter.await.expect("waiter");
        assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(again.text(), "call 1 failed", "the waiter ran the handler again itself");
    }

    /// Two layers over one store stand for two processes: the waiter's process has no
    /// notification of the other's completion and finds it by polling the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_in_another_process_finds_the_completion_by_polling() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        let layer = || {
            IdempotencyLayer::builder(store.clone() as Arc<dyn Store>)
                .allow_anonymous(Principal::new("anonymous"))
                .build()
        };
        let (one, calls, gate) = gated_app(layer());
        let (two, other_calls, _) = gated_app(layer());
        let first = tokio::spawn({
            let one = one.clone();
            async move { send(&one, gated("w7", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let waiter = tokio::spawn(async move { send(&two, gated("w7", Some("wait=20"), "a")).await });
        until_waiting(&store).await;
        gate.add_permits(1);
        let first = first.await.expect("first");
        // A deadline for the condition, not a measure of speed: without the announcement the
        // waiter would answer in an hour.
        let waited = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("the waiter was not woken by the announcement")
            .expect("waiter");
        assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
        assert_eq!(waited.body, first.body);
        assert_eq!(waited.headers["preference-applied"], "wait=20");
        assert_eq!(other_calls.load(Ordering::SeqCst), 0);
        // Polled, not woken: it read the record more than once.
        assert!(store.calls(Op::Get) >= 1);
    }
}

/// Across processes on PostgreSQL: the completion is announced (LISTEN/NOTIFY), so a waiter in
/// another process that would not read the record again for an hour gets the response as soon
/// as it is stored.
mod announced {
    use std::sync::atomic::AtomicU64;

    use async_trait::async_trait;
    use idempotency::{
        Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordChanges, RecordId, RecordPage,
        RecordQuery, Renewal, Scope, StoreError, StoredResponse, Timestamp,
    };

    use super::*;

    /// A store that counts the claims it has answered (after the answer, unlike `FaultyStore`,
    /// which counts calls as they start).
    struct Answered<S> {
        inner: S,
        claims: AtomicU64,
    }

    #[async_trait]
    impl<S: Store> Store for Answered<S> {
        async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
            let out = self.inner.claim(req).await;
            self.claims.fetch_add(1, Ordering::SeqCst);
            out
        }
        async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
            self.inner.reclaim(req).await
        }
        async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
            self.inner.heartbeat(claim, renewal).await
        }
        async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
            self.inner.remove(claim).await
        }
        async fn complete(&self, claim: &Claim, r: &StoredResponse, expires_at: Timestamp) -> Result<(), StoreError> {
            self.inner.complete(claim, r, expires_at).await
        }
        async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
            self.inner.fail(claim).await
        }
        async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
            self.inner.mark_uncertain(claim).await
        }
        async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
            self.inner.mark_stale_uncertain(req).await
        }
        async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
            self.inner.take_over_uncertain(req).await
        }
        async fn resolve(
            &self,
            id: &RecordId,
            r: &StoredResponse,
            expires_at: Timestamp,
        ) -> Result<idempotency::Resolve, StoreError> {
            self.inner.resolve(id, r, expires_at).await
        }
        async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
            self.inner.get(scope).await
        }
        async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
            self.inner.sweep_expired(now, batch).await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            self.inner.ping().await
        }
        async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
            self.inner.list_records(query).await
        }
        async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
            self.inner.get_by_id(id).await
        }
        async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
            self.inner.forget(id).await
        }
        fn changes(&self) -> Option<Arc<RecordChanges>> {
            self.inner.changes()
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_in_another_process_is_woken_by_the_postgres_announcement() {
        let Some(db) = testkit::postgres::TestDatabase::create().await else { return };
        let connect = || async {
            let store = idempotency_sqlx::PostgresStore::connect(db.url()).await.expect("connect");
            store.migrate().await.expect("migrate");
            store
        };
        // Two pools and two layers: two processes. Neither polls within the wait.
        let (one_store, two_store) = (connect().await, connect().await);
        let pool = two_store.pool().clone();
        woken_by_the_announcement(Arc::new(one_store), Arc::new(two_store), pool).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_in_another_process_is_woken_by_the_partitioned_stores_announcement() {
        let Some(db) = testkit::postgres::TestDatabase::create().await else { return };
        let connect = || async {
            let store = idempotency_sqlx::PartitionedPostgresStore::connect(db.url()).await.expect("connect");
            store.migrate().await.expect("migrate");
            store
        };
        let (one_store, two_store) = (connect().await, connect().await);
        let pool = two_store.pool().clone();
        woken_by_the_announcement(Arc::new(one_store), Arc::new(two_store), pool).await;
    }

    /// `one` and `two` on one PostgreSQL database, two processes; `pool` is `two`'s.
    async fn woken_by_the_announcement(one_store: Arc<dyn Store>, two_store: Arc<dyn Store>, pool: sqlx::PgPool) {
        // The second process listens from now on; the test goes on once its LISTEN is in (so
        // the announcement, not the wake-up every listener gives when it starts, ends the wait).
        assert!(two_store.changes().is_some());
        wait_until("the second process listens", Duration::from_secs(30), async || {
            let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                       AND query LIKE 'LISTEN%' AND state = 'idle'";
            sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.expect("pg_stat_activity") >= 1
        })
        .await;
        let two_store = Arc::new(Answered { inner: two_store, claims: AtomicU64::new(0) });
        let layer = |store: Arc<dyn Store>| {
            IdempotencyLayer::builder(store)
                .allow_anonymous(Principal::new("anonymous"))
                .max_wait(HOUR)
                .wait_poll(HOUR, HOUR)
                .build()
        };
        let (one, calls, gate) = gated_app(layer(one_store));
        let (two, other_calls, _) = gated_app(layer(two_store.clone()));
        let first = tokio::spawn({
            let one = one.clone();
            async move { send(&one, gated("pg-1", None, "a")).await }
        });
        until_called(&calls, 1).await;
        let waiter = tokio::spawn(async move { send(&two, gated("pg-1", Some("wait=3600"), "a")).await });
        // The waiter has read the record in flight: from now on only an announcement (or the
        // end of its hour) ends its wait.
        wait_until("the waiter read the record", Duration::from_secs(30), async || {
            two_store.claims.load(Ordering::SeqCst) >= 1
        })
        .await;
        gate.add_permits(1);
        let first = first.await.expect("first");
        // A deadline for the condition, not a measure of speed: without the announcement the
        // waiter would answer in an hour.
        let waited = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("the waiter was not woken by the announcement")
            .expect("waiter");
        assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
        assert_eq!(waited.body, first.body);
        assert_eq!(waited.headers["preference-applied"], "wait=3600");
        assert_eq!(other_calls.load(Ordering::SeqCst), 0);
    }
}
