//! The SQLite and PostgreSQL stores: the shared conformance suite against each backend (and each
//! PostgreSQL claim strategy), then what is specific to each backend.
//!
//! PostgreSQL tests need `TEST_POSTGRES_URL` (a server URL; every test creates and drops its own
//! database). Without it they print a loud SKIPPED line and pass, unless `CI=true`.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

use std::sync::Arc;

use idempotency::conformance::Fixture;
use idempotency_sqlx::{ClaimStrategy, PostgresStore, SqliteStore};

mod support {
    use std::sync::Arc;

    use idempotency::conformance::{Fixture, Holding};
    use idempotency_sqlx::testing::TestDatabase;
    use idempotency_sqlx::{ClaimStrategy, PartitionedPostgresStore, PostgresStore, SqliteStore};
    use sqlx::postgres::{PgPool, PgPoolOptions};

    /// A temp SQLite file; `store` and `peer` are two pools on it, as two processes would be.
    pub(crate) async fn sqlite_fixture() -> Fixture {
        let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
        let url = format!("sqlite://{}", dir.path().join("idempotency.db").display());
        let store = SqliteStore::connect(&url).await.expect("open");
        store.migrate().await.expect("migrate");
        let peer = SqliteStore::connect(&url).await.expect("open peer");
        Fixture { store: Arc::new(Holding::new(store, dir.clone())), peer: Arc::new(Holding::new(peer, dir)) }
    }

    /// A small pool: many tests run at once against one server.
    pub(crate) async fn pg_pool(url: &str) -> PgPool {
        PgPoolOptions::new().max_connections(4).connect(url).await.expect("connect to the test database")
    }

    /// A fresh database; `store` and `peer` are two pools on it, as two replicas would be.
    pub(crate) async fn postgres_fixture(strategy: ClaimStrategy) -> Option<Fixture> {
        let db = Arc::new(TestDatabase::create().await?);
        let store = PostgresStore::from_pool(pg_pool(db.url()).await).with_claim_strategy(strategy);
        store.migrate().await.expect("migrate");
        let peer = PostgresStore::from_pool(pg_pool(db.url()).await).with_claim_strategy(strategy);
        Some(Fixture { store: Arc::new(Holding::new(store, db.clone())), peer: Arc::new(Holding::new(peer, db)) })
    }

    /// [`postgres_fixture`] with each replica behind a replay cache of its own, as leasebroker
    /// and the gateway run it by default.
    pub(crate) async fn postgres_cached_fixture() -> Option<Fixture> {
        use idempotency::{DEFAULT_REPLAY_CACHE_BYTES, ReplayCache, Store};
        let fx = postgres_fixture(ClaimStrategy::InsertOrRead).await?;
        let cached = |s: Arc<dyn Store>| Arc::new(ReplayCache::new(s, DEFAULT_REPLAY_CACHE_BYTES)) as Arc<dyn Store>;
        Some(Fixture { store: cached(fx.store), peer: cached(fx.peer) })
    }

    /// A fresh database with the layout partitioned by expiry day; two pools, as two replicas.
    pub(crate) async fn partitioned_fixture() -> Option<Fixture> {
        let (store, db) = partitioned_store().await?;
        let db = Arc::new(db);
        let peer = PartitionedPostgresStore::from_pool(pg_pool(db.url()).await);
        Some(Fixture { store: Arc::new(Holding::new(store, db.clone())), peer: Arc::new(Holding::new(peer, db)) })
    }

    /// A store with the partitioned layout on a fresh, migrated database, and the database.
    pub(crate) async fn partitioned_store() -> Option<(PartitionedPostgresStore, TestDatabase)> {
        let db = TestDatabase::create().await?;
        let store = PartitionedPostgresStore::from_pool(pg_pool(db.url()).await);
        store.migrate().await.expect("migrate");
        Some((store, db))
    }

    /// A PostgreSQL store on a fresh, migrated database, and the database.
    pub(crate) async fn postgres_store(strategy: ClaimStrategy) -> Option<(PostgresStore, TestDatabase)> {
        let db = TestDatabase::create().await?;
        let store = PostgresStore::from_pool(pg_pool(db.url()).await).with_claim_strategy(strategy);
        store.migrate().await.expect("migrate");
        Some((store, db))
    }
}

idempotency::store_conformance_suite!(sqlite, support::sqlite_fixture());
idempotency::store_conformance_suite!(postgres, optional support::postgres_fixture(ClaimStrategy::InsertOrRead));
idempotency::store_conformance_suite!(
    postgres_seed_upsert,
    optional support::postgres_fixture(ClaimStrategy::SeedUpsert)
);
idempotency::store_conformance_suite!(postgres_partitioned, whole_days optional support::partitioned_fixture());
idempotency::store_conformance_suite!(postgres_replay_cache, optional support::postgres_cached_fixture());

/// Two replicas, each behind a replay cache: a forget on one reaches the other's copy (NOTIFY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replay_cache_is_coherent_across_replicas() {
    let Some(fx) = support::postgres_fixture(ClaimStrategy::InsertOrRead).await else { return };
    idempotency::conformance::replay_cache_is_coherent_across_replicas(fx).await;
}

/// The same on the layout partitioned by expiry day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partitioned_replay_cache_is_coherent_across_replicas() {
    let Some(fx) = support::partitioned_fixture().await else { return };
    idempotency::conformance::replay_cache_is_coherent_across_replicas(fx).await;
}

/// Requests and responses for the backend-specific tests.
mod common {
    use bytes::Bytes;
    use idempotency::{
        ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordId, Scope, Store,
        StoredBody, StoredResponse, Timestamp,
    };

    pub(crate) fn scope(key: &str) -> Scope {
        Scope::new(
            Principal::new("team-a"),
            Endpoint::new("POST", "/v1/workers"),
            IdempotencyKey::try_from(key).expect("valid key"),
        )
    }

    pub(crate) fn unique_scope() -> Scope {
        scope(&format!("k-{}", RecordId::random().to_hex()))
    }

    pub(crate) fn request(scope: &Scope, at: Timestamp) -> ClaimRequest {
        ClaimRequest {
            scope: scope.clone(),
            fingerprint: Fingerprint::from_stored("sha256:ab"),
            now: at,
            in_flight_ttl: std::time::Duration::from_secs(300),
            expires_at: at + chrono::Duration::hours(24),
        }
    }

    pub(crate) fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("location".into(), "/v1/workers/wkr-1".into())],
            body: StoredBody::encode(Bytes::from_static(br#"{"id":"wkr-1"}"#), 1024),
        }
    }

    pub(crate) async fn own(store: &dyn Store, req: ClaimRequest) -> idempotency::Claim {
        match store.claim(req).await.expect("claim") {
            ClaimOutcome::Owned(c) => c,
            ClaimOutcome::Existing(r) => panic!("expected to own the key, found {r:?}"),
        }
    }
}

mod sqlite_backend {
    use std::sync::Arc;
    use std::time::Duration;

    use idempotency::{ClaimOutcome, Decision, RecordState, Store, now};
    use idempotency_sqlx::SqliteStore;

    use crate::common::{own, request, response, scope, unique_scope};

    /// A file made by the release before the `uncertain` state (its table and indexes, with
    /// records in it) is migrated in place: the table is rebuilt with the wider CHECK and every
    /// record is kept, still answering as before; a claim of it can then be marked uncertain.
    #[tokio::test]
    async fn the_uncertain_migration_keeps_an_older_files_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("old.db").display());
        let t = now();
        let (done, flying) = (unique_scope(), unique_scope());
        {
            let old = SqliteStore::connect(&url).await.expect("create");
            for sql in [
                include_str!("../migrations/sqlite/20250101000001_idempotency_records.sql"),
                include_str!("../migrations/sqlite/20261202000001_record_id_index.sql"),
            ] {
                sqlx::raw_sql(sql).execute(old.pool()).await.expect("the older schema");
            }
            let claim = own(&old, request(&done, t)).await;
            old.complete(&claim, &response(), t + chrono::Duration::hours(24)).await.expect("complete");
            own(&old, request(&flying, t)).await;
            let unsure = sqlx::query("UPDATE idempotency_records SET state = 'uncertain'").execute(old.pool()).await;
            assert!(unsure.is_err(), "the older CHECK refuses the state");
            old.pool().close().await;
        }
        let store = SqliteStore::connect(&url).await.expect("reopen");
        store.migrate().await.expect("migrate the older file");
        let replay = store.get(&done).await.expect("get").expect("kept");
        assert_eq!(replay.decide(&replay.fingerprint, t, Duration::from_secs(300)), Decision::Replay(response()));
        let ClaimOutcome::Existing(seen) = store.claim(request(&flying, t)).await.expect("claim") else {
            panic!("the record in flight was kept")
        };
        assert_eq!(seen.state, RecordState::InFlight);
        store.mark_uncertain(&idempotency::Claim::new(seen)).await.expect("mark uncertain");
        assert_eq!(store.get(&flying).await.expect("get").expect("row").state, RecordState::Uncertain);
    }

    #[tokio::test]
    async fn a_completed_record_replays_after_the_file_is_reopened() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub").join("leasebroker.db");
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        let path = path.to_str().expect("utf-8 path").to_owned();
        let t = now();
        let s = scope("survives-restart");
        {
            let store = SqliteStore::connect(&path).await.expect("create");
            store.migrate().await.expect("migrate");
            let mode: String = sqlx::query_scalar("PRAGMA journal_mode").fetch_one(store.pool()).await.expect("pragma");
            assert_eq!(mode, "wal");
            let claim = own(&store, request(&s, t)).await;
            store.complete(&claim, &response(), t + chrono::Duration::hours(24)).await.expect("complete");
            store.pool().close().await;
        }
        let store = SqliteStore::connect(&path).await.expect("reopen");
        store.migrate().await.expect("re-running the migrations is a no-op");
        match store.claim(request(&s, t + chrono::Duration::seconds(5))).await.expect("claim") {
            ClaimOutcome::Existing(r) => {
                assert_eq!(r.state, RecordState::Completed);
                assert_eq!(r.created_at, t);
                let d = r.decide(&r.fingerprint, t + chrono::Duration::seconds(5), Duration::from_secs(300));
                assert_eq!(d, Decision::Replay(response()));
            }
            ClaimOutcome::Owned(c) => panic!("the record was lost on reopen: {c:?}"),
        }
    }

    /// Writers on two pools (two processes) never fail with SQLITE_BUSY: 64 tasks complete 64
    /// keys while 64 more race on one key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_writers_on_two_pools_never_see_busy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite:{}", dir.path().join("busy.db").display());
        let a = Arc::new(SqliteStore::connect(&url).await.expect("open"));
        a.migrate().await.expect("migrate");
        let b = Arc::new(SqliteStore::connect(&url).await.expect("open"));
        let shared = unique_scope();
        let mut tasks = vec![];
        for i in 0..128 {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let shared = shared.clone();
            tasks.push(tokio::spawn(async move {
                let t = now();
                if i < 64 {
                    let s = unique_scope();
                    let c = own(&*store, request(&s, t)).await;
                    store.complete(&c, &response(), t + chrono::Duration::hours(1)).await.expect("complete");
                    (s, false)
                } else {
                    let owned =
                        matches!(store.claim(request(&shared, t)).await.expect("claim"), ClaimOutcome::Owned(_));
                    (shared, owned)
                }
            }));
        }
        let mut owners = 0;
        for task in futures::future::join_all(tasks).await {
            let (s, owned) = task.expect("no task failed");
            owners += usize::from(owned);
            assert!(a.get(&s).await.expect("get").is_some());
        }
        assert_eq!(owners, 1);
    }
}

mod postgres_backend {
    use std::sync::{Arc, Mutex};

    use idempotency::{ClaimOutcome, Decision, RecordId, Store, now};
    use idempotency_sqlx::ClaimStrategy;
    use sqlx::{Connection, PgConnection};
    use tracing::Instrument;
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, SubscriberExt};

    use crate::common::{own, request, response, unique_scope};
    use crate::support::postgres_store;

    /// A database migrated by the release before the `uncertain` state, with a record in flight,
    /// takes the new migration: the state's CHECK is replaced, the record kept, and it can be
    /// marked uncertain.
    #[tokio::test]
    async fn the_uncertain_migration_widens_an_older_databases_check() {
        let Some(db) = idempotency_sqlx::testing::TestDatabase::create().await else { return };
        let store = idempotency_sqlx::PostgresStore::from_pool(crate::support::pg_pool(db.url()).await);
        for sql in [
            include_str!("../migrations/postgres/20250101000001_idempotency_records.sql"),
            include_str!("../migrations/postgres/20261202000001_record_id_index.sql"),
        ] {
            sqlx::raw_sql(sql).execute(store.pool()).await.expect("the older schema");
        }
        let flying = unique_scope();
        let claim = own(&store, request(&flying, now())).await;
        let refused = sqlx::query("UPDATE idempotency_records SET state = 'uncertain'").execute(store.pool()).await;
        assert!(refused.is_err(), "the older CHECK refuses the state");
        store.migrate().await.expect("migrate the older database");
        store.mark_uncertain(&claim).await.expect("mark uncertain");
        let r = store.get(&flying).await.expect("get").expect("kept");
        assert_eq!((r.state, r.record_id), (idempotency::RecordState::Uncertain, claim.record().record_id));
    }

    /// Counts the statements sqlx runs inside one span that touch `idempotency_records`, from
    /// sqlx's own per-statement `sqlx::query` events: one event per statement executed, i.e.
    /// one round trip once the statement is prepared.
    ///
    /// One subscriber for the whole test binary, set once as the global default, attributes each
    /// event to the counting span it ran in. (A thread-local subscriber per test raced with the
    /// other tests' threads over tracing's per-callsite interest cache and sometimes missed
    /// events: the count came out 0 or 1 instead of 2 in about one run in four.)
    #[derive(Clone)]
    struct Statements {
        id: u64,
        seen: Arc<Mutex<Vec<String>>>,
    }

    /// Events by counting span id.
    type Seen = Arc<Mutex<std::collections::HashMap<u64, Arc<Mutex<Vec<String>>>>>>;

    fn registry() -> &'static Seen {
        static SEEN: std::sync::OnceLock<Seen> = std::sync::OnceLock::new();
        SEEN.get_or_init(|| {
            let seen = Seen::default();
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Counter(seen.clone())))
                .expect("no other global subscriber in this test binary");
            seen
        })
    }

    impl Statements {
        /// A new counter, and the span whose statements it counts.
        fn new() -> (Self, tracing::Span) {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let seen = Arc::new(Mutex::new(Vec::new()));
            registry().lock().expect("lock").insert(id, seen.clone());
            (Self { id, seen }, tracing::info_span!("count_statements", counter = id))
        }

        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.seen.lock().expect("lock"))
        }
    }

    impl Drop for Statements {
        fn drop(&mut self) {
            registry().lock().expect("lock").remove(&self.id);
        }
    }

    struct Text(String);
    impl Visit for Text {
        fn record_str(&mut self, _: &Field, value: &str) {
            self.0.push_str(value);
            self.0.push(' ');
        }
        fn record_debug(&mut self, _: &Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!("{value:?} "));
        }
    }

    /// The counting span's id, kept in the span's extensions.
    struct CounterId(u64);

    struct IdOf(Option<u64>);
    impl Visit for IdOf {
        fn record_u64(&mut self, field: &Field, value: u64) {
            if field.name() == "counter" {
                self.0 = Some(value);
            }
        }
        fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
    }

    struct Counter(Seen);

    impl<S> tracing_subscriber::Layer<S> for Counter
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, id: &tracing::span::Id, ctx: Context<'_, S>) {
            let mut of = IdOf(None);
            attrs.record(&mut of);
            if let (Some(counter), Some(span)) = (of.0, ctx.span(id)) {
                span.extensions_mut().insert(CounterId(counter));
            }
        }

        fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
            if event.metadata().target() != "sqlx::query" {
                return;
            }
            let Some(counter) = ctx
                .event_scope(event)
                .and_then(|mut scope| scope.find_map(|span| span.extensions().get::<CounterId>().map(|c| c.0)))
            else {
                return;
            };
            let mut text = Text(String::new());
            event.record(&mut text);
            if text.0.contains("idempotency_records")
                && let Some(seen) = self.0.lock().expect("lock").get(&counter)
            {
                seen.lock().expect("lock").push(text.0);
            }
        }
    }

    /// A replay is one round trip (the claim returns the whole record, response included); a
    /// first execution is two (claim, complete). For both claim strategies.
    #[tokio::test]
    async fn replay_is_one_round_trip_and_first_execution_two() {
        for strategy in [ClaimStrategy::InsertOrRead, ClaimStrategy::SeedUpsert] {
            let Some((store, _db)) = postgres_store(strategy).await else { return };
            let (statements, span) = Statements::new();
            let _entered = span.enter();
            // Warm the connection's statement cache: preparing a statement is a round trip of
            // its own, paid once per connection.
            let warm = own(&store, request(&unique_scope(), now())).await;
            store.complete(&warm, &response(), now() + chrono::Duration::hours(1)).await.expect("complete");
            store.claim(request(warm.scope(), now())).await.expect("claim");
            statements.take();

            let s = unique_scope();
            let t = now();
            let claim = own(&store, request(&s, t)).await;
            store.complete(&claim, &response(), t + chrono::Duration::hours(1)).await.expect("complete");
            assert_eq!(statements.take().len(), 2, "{strategy:?}: a first execution is claim + complete");

            let ClaimOutcome::Existing(r) = store.claim(request(&s, t)).await.expect("claim") else {
                panic!("{strategy:?}: expected a replay")
            };
            assert_eq!(r.decide(&r.fingerprint, t, std::time::Duration::from_secs(300)), Decision::Replay(response()));
            assert_eq!(statements.take().len(), 1, "{strategy:?}: a replay is one statement");
        }
    }

    /// The InsertOrRead race the statement's comment describes, forced deterministically: a
    /// second transaction inserts the key and commits while the claim's INSERT waits on it. The
    /// claim's first statement returns zero rows (its snapshot predates the commit); the retry
    /// sees the committed record. SeedUpsert's DO UPDATE sees it at once.
    #[tokio::test]
    async fn a_row_committed_after_the_claim_snapshot_is_found_by_the_retry() {
        for (strategy, expected_statements) in [(ClaimStrategy::InsertOrRead, 2), (ClaimStrategy::SeedUpsert, 1)] {
            let Some((store, db)) = postgres_store(strategy).await else { return };
            let (statements, span) = Statements::new();
            let s = unique_scope();
            let t = now();
            let theirs = RecordId::random();

            let mut other = PgConnection::connect(db.url()).await.expect("connect");
            sqlx::query("BEGIN").execute(&mut other).await.expect("begin");
            sqlx::query(
                "INSERT INTO idempotency_records (principal, endpoint, key, record_id, fingerprint, state, generation, \
                   created_at, started_at, expires_at) \
                 VALUES ($1, $2, $3, $4, 'sha256:ab', 'in_flight', 1, $5, $5, $6)",
            )
            .bind(s.principal.as_str())
            .bind(s.endpoint.as_str())
            .bind(s.key.as_str())
            .bind(theirs.as_bytes().as_slice())
            .bind(t)
            .bind(t + chrono::Duration::hours(1))
            .execute(&mut other)
            .await
            .expect("insert");
            statements.take();

            let claimer = tokio::spawn({
                let store = store.clone();
                let req = request(&s, t);
                async move { store.claim(req).await }.instrument(span.clone())
            });
            // Commit only once the claim is waiting on our uncommitted row.
            let mut watcher = PgConnection::connect(db.url()).await.expect("connect");
            let mut waited = false;
            for _ in 0..500 {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&mut watcher)
                .await
                .expect("pg_stat_activity");
                if n > 0 {
                    waited = true;
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            assert!(waited, "{strategy:?}: the claim never waited on the uncommitted insert");
            sqlx::query("COMMIT").execute(&mut other).await.expect("commit");

            match claimer.await.expect("task").expect("claim") {
                ClaimOutcome::Existing(r) => assert_eq!(r.record_id, theirs, "{strategy:?}"),
                ClaimOutcome::Owned(c) => panic!("{strategy:?}: two owners of one key: {c:?}"),
            }
            let claims = statements.take().into_iter().filter(|s| s.contains("INSERT INTO")).count();
            assert_eq!(claims, expected_statements, "{strategy:?}: claim statements run");
        }
    }

    /// InsertOrRead writes nothing when the key exists (the row version is untouched); the seed's
    /// no-op DO UPDATE writes a new row version on every retry.
    #[tokio::test]
    async fn only_the_seed_upsert_writes_on_conflict() {
        for (strategy, writes) in [(ClaimStrategy::InsertOrRead, false), (ClaimStrategy::SeedUpsert, true)] {
            let Some((store, _db)) = postgres_store(strategy).await else { return };
            let s = unique_scope();
            let t = now();
            own(&store, request(&s, t)).await;
            let version = || async {
                sqlx::query_scalar::<_, String>(
                    "SELECT xmin::text || '/' || ctid::text FROM idempotency_records WHERE key = $1",
                )
                .bind(s.key.as_str())
                .fetch_one(store.pool())
                .await
                .expect("row version")
            };
            let before = version().await;
            for _ in 0..3 {
                assert!(matches!(store.claim(request(&s, t)).await.expect("claim"), ClaimOutcome::Existing(_)));
            }
            assert_eq!(version().await != before, writes, "{strategy:?}");
        }
    }
}

/// The idempotency migrator and a service's own migrator share one database.
mod migrators {
    use std::borrow::Cow;

    use idempotency_sqlx::testing::TestDatabase;
    use idempotency_sqlx::{MIGRATIONS_TABLE, postgres_migrator, sqlite_migrator};
    use sqlx::SqlSafeStr;
    use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};

    /// A service's migrator with sqlx's defaults (`_sqlx_migrations`) and a version of its own.
    fn service_migrator() -> Migrator {
        Migrator::with_migrations(vec![Migration::new(
            1,
            Cow::Borrowed("service tables"),
            MigrationType::Simple,
            "CREATE TABLE service_things (id BIGINT PRIMARY KEY)".into_sql_str(),
            false,
        )])
    }

    fn ours_on_the_default_table(mut m: Migrator) -> Migrator {
        m.dangerous_set_table_name("_sqlx_migrations");
        m
    }

    #[tokio::test]
    async fn sqlite_migrators_coexist_in_either_order() {
        for ours_first in [true, false] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = idempotency_sqlx::SqliteStore::connect(dir.path().join("db.sqlite").to_str().expect("path"))
                .await
                .expect("open");
            let pool = store.pool();
            for _ in 0..2 {
                if ours_first {
                    sqlite_migrator().run(pool).await.expect("ours");
                    service_migrator().run(pool).await.expect("theirs");
                } else {
                    service_migrator().run(pool).await.expect("theirs");
                    sqlite_migrator().run(pool).await.expect("ours");
                }
            }
            let ours: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {MIGRATIONS_TABLE}")))
                .fetch_one(pool)
                .await
                .expect("ours");
            assert_eq!(ours, sqlite_migrator().iter().count() as i64);
            let theirs: Vec<i64> =
                sqlx::query_scalar("SELECT version FROM _sqlx_migrations").fetch_all(pool).await.expect("theirs");
            assert_eq!(theirs, vec![1]);
            sqlx::query("SELECT count(*) FROM idempotency_records").execute(pool).await.expect("our table");
            sqlx::query("SELECT count(*) FROM service_things").execute(pool).await.expect("their table");
            // Why the separate table: on sqlx's default one, each migrator sees the other's
            // versions as missing and refuses to run.
            let clash = ours_on_the_default_table(sqlite_migrator()).run(pool).await;
            assert!(matches!(clash, Err(MigrateError::VersionMissing(1))), "{clash:?}");
        }
    }

    #[tokio::test]
    async fn postgres_migrators_coexist_in_either_order_and_at_once() {
        for order in ["ours first", "theirs first", "at once"] {
            let Some(db) = TestDatabase::create().await else { return };
            let pool = crate::support::pg_pool(db.url()).await;
            for _ in 0..2 {
                match order {
                    "ours first" => {
                        postgres_migrator().run(&pool).await.expect("ours");
                        service_migrator().run(&pool).await.expect("theirs");
                    }
                    "theirs first" => {
                        service_migrator().run(&pool).await.expect("theirs");
                        postgres_migrator().run(&pool).await.expect("ours");
                    }
                    _ => {
                        let (ours, theirs) = (postgres_migrator(), service_migrator());
                        let (a, b) = tokio::join!(ours.run(&pool), theirs.run(&pool));
                        a.expect("ours");
                        b.expect("theirs");
                    }
                }
            }
            let ours: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {MIGRATIONS_TABLE}")))
                .fetch_one(&pool)
                .await
                .expect("ours");
            assert_eq!(ours, postgres_migrator().iter().count() as i64, "{order}");
            let theirs: Vec<i64> =
                sqlx::query_scalar("SELECT version FROM _sqlx_migrations").fetch_all(&pool).await.expect("theirs");
            assert_eq!(theirs, vec![1], "{order}");
            sqlx::query("SELECT count(*) FROM idempotency_records").execute(&pool).await.expect("our table");
            sqlx::query("SELECT count(*) FROM service_things").execute(&pool).await.expect("their table");
            let clash = ours_on_the_default_table(postgres_migrator()).run(&pool).await;
            assert!(matches!(clash, Err(MigrateError::VersionMissing(1))), "{order}: {clash:?}");
            pool.close().await;
        }
    }
}

// The stores are Clone + Send + Sync and usable as `Arc<dyn Store>`: checked when this compiles.
const _: fn(SqliteStore, PostgresStore) -> (Fixture, Fixture) = |s, p| {
    let s: Arc<dyn idempotency::Store> = Arc::new(s);
    let p: Arc<dyn idempotency::Store> = Arc::new(p);
    (Fixture { store: s.clone(), peer: s }, Fixture { store: p.clone(), peer: p })
};

/// The layout partitioned by expiry day: one owner per key with no table-wide unique index,
/// whole days swept, partitions made ahead and on demand.
mod postgres_partitioned_layout {
    use std::sync::Arc;
    use std::time::Duration;

    use chrono::{Duration as Span, NaiveDate, TimeZone, Utc};
    use idempotency::{
        ClaimOutcome, ClaimRequest, Fingerprint, RecordState, Renewal, Scope, Store, StoreError, Sweeper, Timestamp,
        now,
    };
    use idempotency_sqlx::PartitionedPostgresStore;
    use sqlx::postgres::PgPoolOptions;

    use crate::common::{own, request, response, unique_scope};
    use crate::support::partitioned_store;

    fn midnight(day: NaiveDate) -> Timestamp {
        Utc.from_utc_datetime(&day.and_time(chrono::NaiveTime::MIN))
    }

    /// A claim of `scope` at `at` whose record expires at `expires_at` exactly (no in-flight TTL
    /// to keep it longer), so a test places it in the partition of its choice.
    fn claim_request(scope: &Scope, at: Timestamp, expires_at: Timestamp) -> ClaimRequest {
        let fingerprint = Fingerprint::from_stored("sha256:ab");
        ClaimRequest { scope: scope.clone(), fingerprint, now: at, in_flight_ttl: Duration::ZERO, expires_at }
    }

    async fn rows_of(store: &PartitionedPostgresStore, scope: &Scope) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records_by_day WHERE principal = $1 AND key = $2")
            .bind(scope.principal.as_str())
            .bind(scope.key.as_str())
            .fetch_one(store.pool())
            .await
            .expect("count")
    }

    /// Many tasks on two pools claim one key at once, their requests' expiries alternating
    /// between two days (so their inserts would land in two partitions, where no unique index
    /// could stop a second row): exactly one owns it, and the table holds one row. Then the same
    /// race on an expired record, which every claimer tries to replace.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_claims_of_one_key_have_one_owner_across_days() {
        let Some((store, db)) = partitioned_store().await else { return };
        let pool = || PgPoolOptions::new().max_connections(12).connect(db.url());
        let stores = [
            Arc::new(PartitionedPostgresStore::from_pool(pool().await.expect("pool"))),
            Arc::new(PartitionedPostgresStore::from_pool(pool().await.expect("pool"))),
        ];
        // A midnight with partitions on both sides of it.
        let boundary = midnight(now().date_naive() + chrono::Days::new(2));
        const TASKS: usize = 48;
        for round in 0..6 {
            let scope = unique_scope();
            let t = now();
            if round % 2 == 1 {
                // An expired record to replace, from three days ago.
                let old = t - Span::days(3);
                let c = own(&store, claim_request(&scope, old, old + Span::minutes(1))).await;
                store.complete(&c, &response(), old + Span::minutes(1)).await.expect("complete");
            }
            let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
            let tasks: Vec<_> = (0..TASKS)
                .map(|i| {
                    let (store, barrier, scope) = (stores[i % 2].clone(), barrier.clone(), scope.clone());
                    let side = if i % 4 < 2 { -Span::milliseconds(1) } else { Span::milliseconds(1) };
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.claim(claim_request(&scope, t, boundary + side)).await
                    })
                })
                .collect();
            let mut owners = 0;
            for task in tasks {
                match task.await.expect("task").expect("claim") {
                    ClaimOutcome::Owned(_) => owners += 1,
                    ClaimOutcome::Existing(r) => assert_eq!(r.state, RecordState::InFlight),
                }
            }
            assert_eq!(owners, 1, "round {round}: one key, one owner");
            assert_eq!(rows_of(&store, &scope).await, 1, "round {round}: one key, one row");
        }
    }

    /// A sweep drops exactly the partitions whose day has ended by its `now`, counts their
    /// records exactly, and keeps every record of a day not yet over, expired or not.
    #[tokio::test]
    async fn the_sweep_drops_only_ended_days_and_counts_exactly() {
        let Some((store, _db)) = partitioned_store().await else { return };
        let today = now().date_naive();
        let d0 = midnight(today);
        let (gone, kept): (Vec<Timestamp>, Vec<Timestamp>) = (
            vec![d0 - Span::hours(36), d0 - Span::microseconds(1)],
            vec![d0, d0 + Span::hours(11), d0 + Span::days(1) + Span::hours(1)],
        );
        let mut scopes = vec![];
        for (i, &expires) in gone.iter().chain(&kept).enumerate() {
            let scope = unique_scope();
            let c = own(&store, claim_request(&scope, expires - Span::hours(1), expires)).await;
            if i % 2 == 0 {
                store.complete(&c, &response(), expires).await.expect("complete");
            }
            scopes.push(scope);
        }
        let at = d0 + Span::hours(12);
        assert_eq!(store.sweep_expired(at, 1).await.expect("sweep"), 2, "the two records of ended days");
        for (scope, expected) in scopes.iter().zip([false, false, true, true, true]) {
            assert_eq!(store.get(scope).await.expect("get").is_some(), expected, "{scope:?}");
        }
        assert_eq!(store.sweep_expired(at, 1).await.expect("sweep"), 0, "nothing more has ended");
        let days = store.partition_days().await.expect("days");
        assert_eq!(days.first(), Some(&today), "{days:?}");

        // When today ends, today's two records go; tomorrow's stays.
        assert_eq!(store.sweep_expired(d0 + Span::days(1), 1000).await.expect("sweep"), 2);
        let alive: Vec<bool> = futures::future::join_all(scopes.iter().map(|s| store.get(s)))
            .await
            .into_iter()
            .map(|r| r.expect("get").is_some())
            .collect();
        assert_eq!(alive, [false, false, false, false, true]);

        // The Sweeper reports the exact count it dropped.
        let past = now() - Span::days(10);
        for _ in 0..3 {
            own(&store, claim_request(&unique_scope(), past, past + Span::hours(1))).await;
        }
        let swept = Sweeper::new(Arc::new(store.clone()), std::time::Duration::from_secs(60)).run_once().await;
        assert_eq!(swept.expect("sweep"), 3);
    }

    /// With a drop window, an ended day is detached at once (no claim sees its records again)
    /// and dropped only by a sweep within the window; the count comes with the drop.
    #[tokio::test]
    async fn an_ended_day_waits_detached_for_the_drop_window() {
        let Some((store, _db)) = partitioned_store().await else { return };
        let today = now().date_naive();
        let d0 = midnight(today);
        let window = idempotency_sqlx::DropWindow::hours(2, 4).expect("window");
        let store = store.with_drop_window(window);
        let expires = d0 - Span::hours(3);
        let scope = unique_scope();
        own(&store, claim_request(&scope, expires - Span::hours(1), expires)).await;
        let partition = format!("idempotency_records_by_day_p{}", expires.format("%Y%m%d"));
        let table_exists = async |name: &str| -> bool {
            sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(name)
                .fetch_one(store.pool())
                .await
                .expect("catalog")
        };
        // 12:00, outside the window: detached, not dropped, nothing counted.
        assert_eq!(store.sweep_expired(d0 + Span::hours(12), 1).await.expect("sweep"), 0);
        assert!(!store.partition_days().await.expect("days").contains(&expires.date_naive()), "detached");
        assert!(table_exists(&partition).await, "kept for the window");
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records_by_day")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(seen, 0, "no statement on the table sees a detached day");
        // 02:30 the next night, within it: dropped and counted.
        assert_eq!(store.sweep_expired(d0 + Span::hours(26) + Span::minutes(30), 1).await.expect("sweep"), 1);
        assert!(!table_exists(&partition).await, "dropped");
    }

    /// The partitions of today and the days ahead exist after `migrate` and after every sweep;
    /// a write whose expiry has no partition creates it; a completion moves the record to the
    /// partition of its new expiry.
    #[tokio::test]
    async fn partitions_are_created_ahead_and_on_demand() {
        let Some((store, _db)) = partitioned_store().await else { return };
        let today = now().date_naive();
        let ahead = |n: u64| (0..=n).map(|d| today + chrono::Days::new(d)).collect::<Vec<_>>();
        assert_eq!(store.partition_days().await.expect("days"), ahead(u64::from(idempotency_sqlx::DEFAULT_DAYS_AHEAD)));
        let store = store.with_days_ahead(6);
        store.sweep_expired(now(), 1000).await.expect("sweep");
        assert_eq!(store.partition_days().await.expect("days"), ahead(6));

        let t = now();
        let scope = unique_scope();
        let c = own(&store, claim_request(&scope, t, t + Span::days(40))).await;
        assert!(store.partition_days().await.expect("days").contains(&(t + Span::days(40)).date_naive()));
        let retention = t + Span::days(100);
        store.complete(&c, &response(), retention).await.expect("complete");
        let (partition, expires): (String, Timestamp) = sqlx::query_as(
            "SELECT tableoid::regclass::text, expires_at FROM idempotency_records_by_day WHERE key = $1",
        )
        .bind(scope.key.as_str())
        .fetch_one(store.pool())
        .await
        .expect("row");
        assert_eq!(partition, format!("idempotency_records_by_day_p{}", retention.format("%Y%m%d")));
        assert_eq!(expires, chrono::SubsecRound::trunc_subsecs(retention, 6));
        assert_eq!(store.get(&scope).await.expect("get").expect("row").state, RecordState::Completed);
    }

    /// Claims `n` records that expired yesterday; returns yesterday's partition's name.
    async fn expired_yesterday(store: &PartitionedPostgresStore, n: usize) -> String {
        let yesterday = midnight(now().date_naive()) - Span::hours(1);
        for _ in 0..n {
            own(store, claim_request(&unique_scope(), yesterday - Span::hours(1), yesterday)).await;
        }
        format!("idempotency_records_by_day_p{}", yesterday.format("%Y%m%d"))
    }

    /// A connection in a transaction that has read the partitioned table, as a long report
    /// would: it holds a lock on the table and every partition until it ends.
    async fn long_reader(url: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let pool = PgPoolOptions::new().max_connections(1).connect(url).await.expect("pool");
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query("SELECT count(*) FROM idempotency_records_by_day").execute(&mut *tx).await.expect("read");
        tx
    }

    /// Waits until a session on this test's database runs a statement containing `text`.
    async fn until_running(store: &PartitionedPostgresStore, text: &str) {
        for _ in 0..1000 {
            let running: bool = sqlx::query_scalar(
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE state = 'active' AND strpos(query, $1) > 0 \
                   AND datname = current_database() AND pid <> pg_backend_pid()",
            )
            .bind(text)
            .fetch_one(store.pool())
            .await
            .expect("activity");
            if running {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("no session ran {text:?}");
    }

    /// A transaction that holds the table (a long report) delays the drop of an ended day, not
    /// the claims: the sweep waits for it, claims go on meanwhile, and once it ends the sweep
    /// drops the day and counts its records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_transaction_delays_the_drop_of_a_day_and_not_the_claims() {
        let Some((store, db)) = partitioned_store().await else { return };
        let partition = expired_yesterday(&store, 3).await;
        let reader = long_reader(db.url()).await;
        let sweep = tokio::spawn({
            let store = store.clone();
            async move { store.sweep_expired(now(), 1000).await }
        });
        until_running(&store, "DETACH PARTITION").await;
        for _ in 0..5 {
            own(&store, request(&unique_scope(), now())).await;
        }
        assert!(!sweep.is_finished(), "the sweep waits for the long transaction, the claims do not");
        reader.commit().await.expect("end the long transaction");
        assert_eq!(sweep.await.expect("task").expect("sweep"), 3, "the day is dropped once the reader ends");
        let left: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&partition)
            .fetch_one(store.pool())
            .await
            .expect("regclass");
        assert!(!left, "{partition} is dropped");
    }

    /// A detach interrupted half-way (cancelled while it waited, or the sweeper's process
    /// killed) leaves the partition pending detach; the next sweep finishes it and drops the day.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweep_finishes_a_detach_left_pending() {
        let Some((store, db)) = partitioned_store().await else { return };
        let partition = expired_yesterday(&store, 2).await;
        let reader = long_reader(db.url()).await;
        let mut conn = store.pool().acquire().await.expect("connection");
        sqlx::query("SET statement_timeout = '300ms'").execute(&mut *conn).await.expect("timeout");
        let detach = format!(r#"ALTER TABLE idempotency_records_by_day DETACH PARTITION "{partition}" CONCURRENTLY"#);
        sqlx::raw_sql(sqlx::AssertSqlSafe(detach)).execute(&mut *conn).await.expect_err("cancelled while it waits");
        sqlx::query("RESET statement_timeout").execute(&mut *conn).await.expect("reset");
        drop(conn);
        let pending: bool =
            sqlx::query_scalar("SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1)")
                .bind(&partition)
                .fetch_one(store.pool())
                .await
                .expect("pg_inherits");
        assert!(pending, "the cancelled detach leaves {partition} pending");
        reader.commit().await.expect("end the long transaction");
        assert_eq!(store.sweep_expired(now(), 1000).await.expect("sweep"), 2);
        assert!(!store.partition_days().await.expect("days").contains(&(now().date_naive() - chrono::Days::new(1))));
        assert_eq!(store.sweep_expired(now(), 1000).await.expect("sweep"), 0);
    }

    /// Heartbeats racing with the completion that moves their row to another partition settle
    /// (they meet the moved row, run again and are fenced): never an error, one row left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn updates_racing_with_a_move_between_partitions_settle() {
        let Some((store, db)) = partitioned_store().await else { return };
        let peer = Arc::new(PartitionedPostgresStore::from_pool(
            PgPoolOptions::new().max_connections(8).connect(db.url()).await.expect("pool"),
        ));
        for _ in 0..10 {
            let t = now();
            let scope = unique_scope();
            let claim = Arc::new(own(&store, request(&scope, t)).await);
            let beats: Vec<_> = (0..8)
                .map(|i| {
                    let (peer, claim) = (peer.clone(), claim.clone());
                    let at = t + Span::milliseconds(i);
                    let renewal =
                        Renewal { now: at, in_flight_ttl: Duration::from_secs(300), expires_at: at + Span::hours(24) };
                    tokio::spawn(async move { peer.heartbeat(&claim, renewal).await })
                })
                .collect();
            store.complete(&claim, &response(), t + Span::days(3)).await.expect("complete");
            for beat in beats {
                match beat.await.expect("task") {
                    Ok(()) | Err(StoreError::Fenced { .. }) => {}
                    Err(e) => panic!("a heartbeat must settle, not fail: {e:?}"),
                }
            }
            assert_eq!(rows_of(&store, &scope).await, 1);
            let r = store.get(&scope).await.expect("get").expect("row");
            assert_eq!(r.state, RecordState::Completed);
        }
    }
}

/// Across processes on PostgreSQL: records completed and failed at once by one store are each
/// announced to the waiters of another store on the same database (two pools, two processes),
/// however the announcements are batched, and a waiter of a record nobody touched is not woken.
mod announcements {
    use std::sync::Arc;
    use std::time::Duration;

    use idempotency::{RecordState, Scope, Store, now};
    use idempotency_sqlx::testing::TestDatabase;
    use idempotency_sqlx::{PartitionedPostgresStore, PostgresStore};

    use crate::common::{own, request, response, unique_scope};
    use crate::support::{partitioned_store, pg_pool};

    const RECORDS: usize = 200;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_records_completed_at_once_each_announce_to_their_waiter() {
        let Some(db) = TestDatabase::create().await else { return };
        let one = PostgresStore::from_pool(pg_pool(db.url()).await);
        one.migrate().await.expect("migrate");
        let two = PostgresStore::from_pool(pg_pool(db.url()).await);
        each_announced(Arc::new(one), Arc::new(two), &db).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_partitioned_records_completed_at_once_each_announce_to_their_waiter() {
        let Some((one, db)) = partitioned_store().await else { return };
        let two = PartitionedPostgresStore::from_pool(pg_pool(db.url()).await);
        each_announced(Arc::new(one), Arc::new(two), &db).await;
    }

    /// Returns once a store's LISTEN is in: the wake-up every waiter gets when the listener
    /// starts is behind us, so only an announcement can wake a waiter armed from then on.
    async fn listening(db: &TestDatabase) {
        let watch = pg_pool(db.url()).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                       AND query LIKE 'LISTEN%' AND state = 'idle'";
            if sqlx::query_scalar::<_, i64>(sql).fetch_one(&watch).await.expect("pg_stat_activity") >= 1 {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the store never listened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A store built `without_announcements` completes without announcing; one built by
    /// default, completing after it, is heard. The record completed first is still unheard two
    /// seconds after the second was (an announcement arrives in milliseconds).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_without_announcements_sends_none() {
        let Some(db) = TestDatabase::create().await else { return };
        let loud = PostgresStore::from_pool(pg_pool(db.url()).await);
        loud.migrate().await.expect("migrate");
        let quiet = PostgresStore::from_pool(pg_pool(db.url()).await).without_announcements();
        let waiter = PostgresStore::from_pool(pg_pool(db.url()).await);
        let changes = waiter.changes().expect("a PostgreSQL store listens");
        listening(&db).await;

        let (a, b) = (unique_scope(), unique_scope());
        let (claim_a, claim_b) = (own(&quiet, request(&a, now())).await, own(&loud, request(&b, now())).await);
        let (sub_a, sub_b) = (changes.subscribe(&a), changes.subscribe(&b));
        let mut heard_a = std::pin::pin!(sub_a.notify().notified());
        heard_a.as_mut().enable();
        let mut heard_b = std::pin::pin!(sub_b.notify().notified());
        heard_b.as_mut().enable();
        quiet.complete(&claim_a, &response(), now() + chrono::Duration::hours(1)).await.expect("complete a");
        loud.complete(&claim_b, &response(), now() + chrono::Duration::hours(1)).await.expect("complete b");
        tokio::time::timeout(Duration::from_secs(30), heard_b.as_mut()).await.expect("the default store announces");
        let unheard = tokio::time::timeout(Duration::from_secs(2), heard_a.as_mut()).await;
        assert!(unheard.is_err(), "a store without announcements announced a completion");
        assert_eq!(waiter.get(&a).await.expect("get").expect("a").state, RecordState::Completed);
    }

    /// `one` completes two records in four, fails the third and marks the fourth uncertain, all
    /// at once, from a task each; every record has a waiter in `two`, armed before the first
    /// completion.
    async fn each_announced(one: Arc<dyn Store>, two: Arc<dyn Store>, db: &TestDatabase) {
        let changes = two.changes().expect("a PostgreSQL store announces changes");
        listening(db).await;

        let scopes: Vec<Scope> = (0..RECORDS).map(|_| unique_scope()).collect();
        let mut claims = Vec::with_capacity(RECORDS);
        for s in &scopes {
            claims.push(own(&*one, request(s, now())).await);
        }
        let subscriptions: Vec<_> = scopes.iter().map(|s| changes.subscribe(s)).collect();
        let mut heard: Vec<_> = subscriptions.iter().map(|s| Box::pin(s.notify().notified())).collect();
        for h in &mut heard {
            h.as_mut().enable();
        }
        let quiet = changes.subscribe(&unique_scope());
        let mut not_heard = std::pin::pin!(quiet.notify().notified());
        not_heard.as_mut().enable();

        let writers: Vec<_> = claims
            .into_iter()
            .enumerate()
            .map(|(i, claim)| {
                let one = one.clone();
                tokio::spawn(async move {
                    if i % 4 == 3 {
                        one.fail(&claim).await
                    } else if i % 4 == 2 {
                        one.mark_uncertain(&claim).await
                    } else {
                        one.complete(&claim, &response(), now() + chrono::Duration::hours(1)).await
                    }
                })
            })
            .collect();
        for w in futures::future::join_all(writers).await {
            w.expect("writer").expect("complete, fail or mark uncertain");
        }

        // A deadline for the condition, not a measure of speed: nothing but an announcement
        // wakes these waiters (they do not poll).
        let answers = futures::future::join_all(heard.into_iter().zip(&scopes).map(|(h, s)| {
            let two = two.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(30), h).await.ok()?;
                Some(two.get(s).await.expect("get").expect("the record").state)
            }
        }))
        .await;
        let woken = answers.iter().filter(|a| a.is_some()).count();
        let completed = answers.iter().filter(|a| matches!(a, Some(RecordState::Completed))).count();
        let failed = answers.iter().filter(|a| matches!(a, Some(RecordState::Failed))).count();
        let uncertain = answers.iter().filter(|a| matches!(a, Some(RecordState::Uncertain))).count();
        assert_eq!(woken, RECORDS, "waiters not woken by their record's announcement");
        assert_eq!(
            (completed, failed, uncertain),
            (RECORDS / 2, RECORDS / 4, RECORDS / 4),
            "a woken waiter read the record's answer"
        );
        assert!(futures::poll!(not_heard.as_mut()).is_pending(), "a record nobody touched was announced");
    }
}

mod local_server {
    use idempotency_sqlx::testing::LocalServer;

    /// A stopped server's port stays its own until it starts again: no other listener can take
    /// it meanwhile (seen: another test's HTTP server did, and the restart failed).
    #[test]
    fn a_stopped_server_keeps_its_port_until_it_starts_again() {
        let Some(mut pg) = LocalServer::start() else { return };
        pg.stop();
        assert!(pg.holds_its_port());
        let taken = std::net::TcpListener::bind(("127.0.0.1", pg.port()));
        assert!(taken.is_err(), "another listener took the stopped server's port");
        pg.start_again();
        assert!(!pg.holds_its_port());
        assert!(pg.is_running());
    }
}
