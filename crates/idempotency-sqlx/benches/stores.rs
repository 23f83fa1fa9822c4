//! Store throughput: claim + complete (a first execution) and replay (a retry of a completed
//! key), at concurrency 1 and 16, against the memory store, SQLite (a temp file) and PostgreSQL
//! (both claim strategies; only when `TEST_POSTGRES_URL` is set, in a database of its own).
//!
//! `TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!  cargo bench -p idempotency-sqlx --bench stores -- --warm-up-time 1 --measurement-time 3`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use idempotency::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, MemoryStore, Principal, RecordId, Scope, Store,
    StoredBody, StoredResponse, now,
};
use idempotency_sqlx::testing::TestDatabase;
use idempotency_sqlx::{ClaimStrategy, PostgresStore, SqliteStore};
use tokio::runtime::Runtime;

const CONCURRENCY: [u64; 2] = [1, 16];

fn request(scope: Scope) -> ClaimRequest {
    let t = now();
    ClaimRequest {
        scope,
        fingerprint: Fingerprint::from_stored("sha256:bench"),
        now: t,
        in_flight_ttl: std::time::Duration::from_secs(300),
        expires_at: t + chrono::Duration::hours(24),
    }
}

fn fresh_scope() -> Scope {
    Scope::new(
        Principal::new("bench"),
        Endpoint::new("POST", "/v1/workers"),
        IdempotencyKey::try_from(format!("k-{}", RecordId::random().to_hex()).as_str()).expect("valid key"),
    )
}

fn response() -> StoredResponse {
    let body = Bytes::from_static(br#"{"id":"wkr-7Q2K9","state":"booting","image":"worker-base:2025.11","cpu":16}"#);
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/v1/workers/wkr-7Q2K9".into()),
        ],
        body: StoredBody::encode(body, 1024),
    }
}

/// Splits `iters` over `concurrency` tasks, runs `op` that many times in each, and returns the
/// wall time. `setup` runs per task before the clock starts.
async fn run<S, SFut, F, OFut>(iters: u64, concurrency: u64, setup: S, op: F) -> Duration
where
    S: Fn() -> SFut,
    SFut: Future<Output = Option<Scope>>,
    F: Fn(Option<Scope>) -> OFut + Clone + Send + Sync + 'static,
    OFut: Future<Output = ()> + Send,
{
    let mut prepared = vec![];
    for _ in 0..concurrency {
        prepared.push(setup().await);
    }
    let start = Instant::now();
    let tasks: Vec<_> = prepared
        .into_iter()
        .enumerate()
        .map(|(i, scope)| {
            let n = iters / concurrency + u64::from((i as u64) < iters % concurrency);
            let op = op.clone();
            tokio::spawn(async move {
                for _ in 0..n {
                    op(scope.clone()).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("bench task");
    }
    start.elapsed()
}

fn bench_store(c: &mut Criterion, rt: &Runtime, name: &str, store: Arc<dyn Store>) {
    let mut g = c.benchmark_group(format!("store/{name}"));
    g.throughput(Throughput::Elements(1));
    for concurrency in CONCURRENCY {
        let s = store.clone();
        g.bench_function(BenchmarkId::new("claim_complete", concurrency), |b| {
            b.iter_custom(|iters| {
                let s = s.clone();
                rt.block_on(run(
                    iters,
                    concurrency,
                    || async { None },
                    move |_| {
                        let s = s.clone();
                        async move {
                            let req = request(fresh_scope());
                            let expires = req.expires_at;
                            let ClaimOutcome::Owned(claim) = s.claim(req).await.expect("claim") else {
                                panic!("a fresh key is owned")
                            };
                            s.complete(&claim, &response(), expires).await.expect("complete");
                        }
                    },
                ))
            })
        });
        let s = store.clone();
        g.bench_function(BenchmarkId::new("replay", concurrency), |b| {
            b.iter_custom(|iters| {
                let (setup_store, s) = (s.clone(), s.clone());
                rt.block_on(run(
                    iters,
                    concurrency,
                    move || {
                        let s = setup_store.clone();
                        async move {
                            // One completed key per task, replayed over and over.
                            let req = request(fresh_scope());
                            let (scope, expires) = (req.scope.clone(), req.expires_at);
                            let ClaimOutcome::Owned(claim) = s.claim(req).await.expect("claim") else {
                                panic!("a fresh key is owned")
                            };
                            s.complete(&claim, &response(), expires).await.expect("complete");
                            Some(scope)
                        }
                    },
                    move |scope| {
                        let s = s.clone();
                        async move {
                            let scope = scope.expect("set up");
                            let ClaimOutcome::Existing(r) = s.claim(request(scope)).await.expect("claim") else {
                                panic!("a completed key is replayed")
                            };
                            assert!(r.response.is_some());
                        }
                    },
                ))
            })
        });
    }
    g.finish();
}

fn stores(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");

    bench_store(c, &rt, "memory", Arc::new(MemoryStore::new()));

    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = rt.block_on(async {
        let s = SqliteStore::connect(dir.path().join("bench.db").to_str().expect("path")).await.expect("open");
        s.migrate().await.expect("migrate");
        s
    });
    bench_store(c, &rt, "sqlite", Arc::new(sqlite.clone()));
    rt.block_on(sqlite.pool().close());

    if let Some(db) = rt.block_on(TestDatabase::create()) {
        for (name, strategy) in
            [("postgres", ClaimStrategy::InsertOrRead), ("postgres_seed_upsert", ClaimStrategy::SeedUpsert)]
        {
            let pg = rt.block_on(async {
                let s = PostgresStore::connect(db.url()).await.expect("connect").with_claim_strategy(strategy);
                s.migrate().await.expect("migrate");
                s
            });
            bench_store(c, &rt, name, Arc::new(pg.clone()));
            rt.block_on(pg.pool().close());
        }
    }
}

/// Every benchmark of this file, for `criterion_main!`. Written out rather than made by
/// `criterion_group!`, whose undocumented `pub fn` the workspace's `missing_docs` lint refuses.
fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    stores(&mut criterion);
}

criterion_main!(benches);
