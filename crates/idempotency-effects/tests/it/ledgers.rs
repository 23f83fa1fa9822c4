//! The ledger conformance suite on memory, SQLite and PostgreSQL. `peer` and `store_peer` are
//! second pools on the same database, as a second replica would be.

use std::sync::Arc;

use idempotency::Store;
use idempotency_effects::conformance::Fixture;
use idempotency_effects::{Ledger, MemoryLedger, SqlLedger};
use idempotency_sqlx::{PostgresStore, SqliteStore};
use testkit::postgres::TestDatabase;

/// Keeps what a fixture lives in (a temp dir, a test database) alive as long as the handles.
#[derive(Debug)]
struct Holding<G> {
    ledger: SqlLedger,
    _guard: Arc<G>,
}

macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        #[async_trait::async_trait]
        impl<G: std::fmt::Debug + Send + Sync + 'static> Ledger for Holding<G> {
            $(async fn $method(&self, $($arg: $ty),*) -> $ret { self.ledger.$method($($arg),*).await })*
        }
    };
}

use idempotency_effects::{Decided, Intent, IntentState, LedgerError, NewIntent, OperationRow};
use std::time::Duration;

forward! {
    decide(op: &OperationRow, intent: &NewIntent, ahead: Duration) -> Result<Decided, LedgerError>;
    stamp(op_id: &str, intent_id: &str, seen: i64, ahead: Duration) -> Result<Option<i64>, LedgerError>;
    adopt(op_id: &str, intent_id: &str, candidate: &str) -> Result<String, LedgerError>;
    record(op_id: &str, intent_id: &str, id: &str, state: IntentState) -> Result<String, LedgerError>;
    release(intent_id: &str, sent_at: i64) -> Result<bool, LedgerError>;
    finish(op_id: &str, now: i64) -> Result<(), LedgerError>;
    operation(op_id: &str) -> Result<Option<OperationRow>, LedgerError>;
    intents(op_id: &str) -> Result<Vec<Intent>, LedgerError>;
    due(now: i64, limit: u32) -> Result<Vec<OperationRow>, LedgerError>;
    put_off(op_id: &str, at: i64) -> Result<(), LedgerError>;
    take_for_rollback(op_id: &str, seen: i64) -> Result<bool, LedgerError>;
    take_unbegun(op: &OperationRow) -> Result<bool, LedgerError>;
    intent(intent_id: &str) -> Result<Option<Intent>, LedgerError>;
    rolled_back(op_id: &str, now: i64) -> Result<bool, LedgerError>;
    prune(before: i64) -> Result<u64, LedgerError>;
    ownership(tag: &str, id: &str, settled_before: i64) -> Result<idempotency_effects::Ownership, LedgerError>;
    disown(id: &str) -> Result<u64, LedgerError>;
    to_watch(watcher: &str, now: i64, limit: u32) -> Result<Vec<Intent>, LedgerError>;
    take_watch(intent_id: &str, watcher: &str, seen: i64, until: i64) -> Result<bool, LedgerError>;
    conclude(intent_id: &str, watcher: &str, state: IntentState) -> Result<bool, LedgerError>;
    insert_operations(rows: &[OperationRow]) -> Result<(), LedgerError>;
}

idempotency_effects::ledger_conformance_suite!(memory, async {
    let ledger = Arc::new(MemoryLedger::new());
    let store = Arc::new(idempotency::MemoryStore::new());
    Fixture { ledger: ledger.clone(), peer: ledger, store: store.clone(), store_peer: store }
});

idempotency_effects::ledger_conformance_suite!(sqlite, async {
    let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
    let url = format!("sqlite://{}", dir.path().join("effects.db").display());
    let ledger = SqlLedger::connect(&url, 4).await.expect("open");
    ledger.migrate().await.expect("migrate");
    let peer = SqlLedger::connect(&url, 4).await.expect("open peer");
    let store = SqliteStore::connect(&url).await.expect("store");
    store.migrate().await.expect("migrate store");
    let store_peer = SqliteStore::connect(&url).await.expect("store peer");
    Fixture {
        ledger: Arc::new(Holding { ledger, _guard: dir.clone() }),
        peer: Arc::new(Holding { ledger: peer, _guard: dir }),
        store: Arc::new(store) as Arc<dyn Store>,
        store_peer: Arc::new(store_peer),
    }
});

idempotency_effects::ledger_conformance_suite!(postgres, optional async {
    let db = Arc::new(TestDatabase::create().await?);
    let ledger = SqlLedger::connect(db.url(), 4).await.expect("connect");
    ledger.migrate().await.expect("migrate");
    let peer = SqlLedger::connect(db.url(), 4).await.expect("connect peer");
    let pool = || async { idempotency_sqlx::postgres_pool_options(3).connect(db.url()).await.expect("connect") };
    let store = PostgresStore::from_pool(pool().await);
    store.migrate().await.expect("migrate store");
    let store_peer = PostgresStore::from_pool(pool().await);
    Some(Fixture {
        ledger: Arc::new(Holding { ledger, _guard: db.clone() }),
        peer: Arc::new(Holding { ledger: peer, _guard: db }),
        store: Arc::new(store) as Arc<dyn Store>,
        store_peer: Arc::new(store_peer),
    })
});

/// SQLite, the real queue: another connection holds the write lock for 1.5 s while an attempt
/// records its intent with a send stamp 1 s ahead. The stamp is taken once the transaction holds
/// the lock, so the call still goes out (hole 4: a stamp taken before the wait refused it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_attempt_that_queued_for_the_write_lock_still_sends() {
    use idempotency_effects::conformance::Downstream;
    use idempotency_effects::{Effects, Operation, Outcome};
    use sqlx::{Connection, Executor};

    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("effects.db").display());
    let ledger = SqlLedger::connect(&url, 2).await.expect("open");
    ledger.migrate().await.expect("migrate");
    let scope = idempotency::Scope::new(
        idempotency::Principal::new("team-a"),
        idempotency::Endpoint::new("POST", "/v1/things"),
        idempotency::IdempotencyKey::try_from("k1").unwrap(),
    );
    let op = Operation::new(scope, idempotency::RecordId::random(), "create");
    let ds = Arc::new(Downstream::new("thing", false));

    let mut holder = sqlx::SqliteConnection::connect(&url).await.expect("second connection");
    holder.execute("BEGIN IMMEDIATE").await.expect("take the write lock");
    let run = {
        let (ds, op) = (ds.clone(), op.clone());
        let effects = Effects::new(Arc::new(ledger)).send_ahead(Duration::from_secs(1));
        tokio::spawn(async move { effects.attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await })
    };
    // The hold is the condition under test (longer than the stamp lies ahead), not a wait for
    // the attempt: that it queued is asserted next.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!run.is_finished(), "the attempt waits for the write lock");
    holder.execute("COMMIT").await.expect("release the lock");
    let outcome = run.await.expect("task");
    assert!(matches!(outcome, Ok(Outcome::Done(_))), "{outcome:?}");
    assert_eq!(ds.sends(), 1);
}

/// The first step of an effect inside the service's own transaction (SQLite, then PostgreSQL):
/// the service's row and the intent commit together, or not at all (a refusal after the step
/// rolls both back: no operation row, nothing sent); after the commit the attempt goes on and
/// sends once, and a retry finds the intent.
mod in_the_callers_transaction {
    use super::*;
    use idempotency_effects::conformance::Downstream;
    use idempotency_effects::{Decided, Effects, Operation, Outcome};

    pub(super) fn operation() -> Operation {
        let scope = idempotency::Scope::new(
            idempotency::Principal::new("team-a"),
            idempotency::Endpoint::new("POST", "/v1/things"),
            idempotency::IdempotencyKey::try_from("k1").unwrap(),
        );
        Operation::new(scope, idempotency::RecordId::random(), "create")
    }

    async fn after_commit(ledger: Arc<dyn Ledger>, op: &Operation, decided: Decided, ds: &Arc<Downstream>) {
        assert!(matches!(decided, Decided::Fresh(_)), "{decided:?}");
        let effects = Effects::new(ledger.clone());
        let done = effects.attempt(op).run_decided(&**ds, decided, |t| ds.send(t, Duration::ZERO)).await;
        assert!(matches!(done, Ok(Outcome::Done(_))), "{done:?}");
        let again = effects.attempt(op).run(&**ds, |t| ds.send(t, Duration::ZERO)).await.unwrap();
        assert_eq!(Some(again), done.ok());
        assert_eq!(ds.sends(), 1);
    }

    #[tokio::test]
    async fn sqlite() {
        use sqlx::{Connection, Executor};
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("effects.db").display());
        let ledger = SqlLedger::connect(&url, 2).await.expect("open");
        ledger.migrate().await.expect("migrate");
        let ledger: Arc<dyn Ledger> = Arc::new(ledger);
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("the service's connection");
        conn.execute("CREATE TABLE nodes (alloc_id TEXT PRIMARY KEY)").await.unwrap();
        let ds = Arc::new(Downstream::new("thing", false));
        let effects = Effects::new(ledger.clone());

        // Refused after the step (say, quota): both roll back.
        let refused = operation();
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.unwrap();
        tx.execute("INSERT INTO nodes VALUES ('n-refused')").await.unwrap();
        let decided = effects.attempt(&refused).decide_in_sqlite(&mut tx, &*ds).await.unwrap();
        assert!(matches!(decided, Decided::Fresh(_)));
        tx.rollback().await.unwrap();
        assert_eq!(ledger.operation(refused.id()).await.unwrap(), None, "no row for the reaper");

        let op = operation();
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.unwrap();
        tx.execute("INSERT INTO nodes VALUES ('n-1')").await.unwrap();
        let decided = effects.attempt(&op).decide_in_sqlite(&mut tx, &*ds).await.unwrap();
        tx.commit().await.unwrap();
        after_commit(ledger.clone(), &op, decided, &ds).await;
        let nodes: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM nodes").fetch_one(&mut conn).await.unwrap();
        assert_eq!(nodes, 1);
    }

    #[tokio::test]
    async fn postgres() {
        use sqlx::{Connection, Executor};
        let Some(db) = TestDatabase::create().await else { return };
        let ledger = SqlLedger::connect(db.url(), 2).await.expect("connect");
        ledger.migrate().await.expect("migrate");
        let ledger: Arc<dyn Ledger> = Arc::new(ledger);
        let mut conn = sqlx::PgConnection::connect(db.url()).await.expect("the service's connection");
        conn.execute("CREATE TABLE nodes (alloc_id TEXT PRIMARY KEY)").await.unwrap();
        let ds = Arc::new(Downstream::new("thing", false));
        let effects = Effects::new(ledger.clone());

        let refused = operation();
        let mut tx = conn.begin().await.unwrap();
        tx.execute("INSERT INTO nodes VALUES ('n-refused')").await.unwrap();
        let decided = effects.attempt(&refused).decide_in_postgres(&mut tx, &*ds).await.unwrap();
        assert!(matches!(decided, Decided::Fresh(_)));
        tx.rollback().await.unwrap();
        assert_eq!(ledger.operation(refused.id()).await.unwrap(), None, "no row for the reaper");

        let op = operation();
        let mut tx = conn.begin().await.unwrap();
        tx.execute("INSERT INTO nodes VALUES ('n-1')").await.unwrap();
        let decided = effects.attempt(&op).decide_in_postgres(&mut tx, &*ds).await.unwrap();
        tx.commit().await.unwrap();
        after_commit(ledger.clone(), &op, decided, &ds).await;
        let nodes: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM nodes").fetch_one(&mut conn).await.unwrap();
        assert_eq!(nodes, 1);
        drop(conn);
    }
}

/// What a call made, recorded by the transaction that finishes the operation with the service's
/// own row (`run_decided_unrecorded`, then `finish_made_in_*`), on SQLite and PostgreSQL:
/// - the call is sent once, and nothing records it before that transaction; the transaction
///   records it, finishes the operation and keeps the resource owned, with the service's row;
/// - an attempt that stops between the call and that transaction leaves the intent pending: the
///   next attempt adopts the resource by tag and sends nothing;
/// - an overlapping attempt that recorded another resource first wins: the finish returns its
///   id, and this attempt's resource is undone;
/// - an operation taken for a rollback meanwhile refuses the finish, and the record, committed
///   still, is there for the reaper.
mod the_record_in_the_finishing_transaction {
    use super::in_the_callers_transaction::operation;
    use super::*;
    use idempotency_effects::conformance::Downstream;
    use idempotency_effects::{Decided, EffectError, Effects, IntentState, Mark, Outcome, Ownership};

    /// The cases on one database: `$begin` opens a transaction on `$conn`; `$decide` / `$finish`
    /// are the attempt's steps inside one.
    macro_rules! cases {
        ($ledger:expr, $conn:ident, $begin:expr, $decide:ident, $finish:ident) => {{
            let ledger: Arc<dyn Ledger> = $ledger;
            let ds = Arc::new(Downstream::new("thing", false));
            let effects = Effects::new(ledger.clone());
            // Decides in its own transaction, then sends: what the call made, unrecorded.
            macro_rules! sent {
                ($op:expr) => {{
                    let attempt = effects.attempt($op);
                    let mut tx = $begin;
                    let decided = attempt.$decide(&mut tx, &*ds).await.expect("decide");
                    tx.commit().await.unwrap();
                    assert!(matches!(decided, Decided::Fresh(_)), "{decided:?}");
                    attempt.run_decided_unrecorded(&*ds, decided, |t| ds.send(t, Duration::ZERO)).await.expect("send")
                }};
            }
            let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as i64;

            // Sent once; nothing recorded before the finish; then recorded, finished and owned,
            // with the service's row, in one commit.
            let op = operation();
            let tag = op.derive("thing").to_string();
            let made = sent!(&op);
            assert_eq!(ds.with_tag(&tag), vec![made.outcome().id().to_owned()]);
            let pending = ledger.intent(&tag).await.unwrap().expect("the intent");
            assert_eq!((pending.state, pending.resource_id), (IntentState::Pending, None), "nothing recorded yet");
            let mut tx = $begin;
            let recorded = effects.attempt(&op).$finish(&mut tx, &made).await.expect("finish");
            sqlx::query("INSERT INTO things (id) VALUES ($1)").bind(recorded.id()).execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
            assert_eq!(&recorded, made.outcome());
            assert_eq!(ledger.operation(op.id()).await.unwrap().map(|o| o.mark), Some(Mark::Finished));
            assert_eq!(ledger.ownership(&tag, recorded.id(), now()).await.unwrap(), Ownership::Owned);
            let things: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM things").fetch_one(&mut $conn).await.unwrap();
            assert_eq!(things, 1);
            let again = effects.attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await;
            assert!(matches!(again, Err(EffectError::Finished)), "{again:?}");
            assert_eq!(ds.sends(), 1);

            // Stopped between the call and the finish: the next attempt adopts by tag.
            let op = operation();
            let made = sent!(&op);
            let adopted = effects.attempt(&op).run(&*ds, |t| ds.send(t, Duration::ZERO)).await.expect("adopted");
            assert_eq!(&adopted, made.outcome());
            assert_eq!(ds.sends(), 2, "the retry sent nothing");

            // An overlapping attempt recorded another resource first: it is kept, ours undone.
            let op = operation();
            let tag = op.derive("thing").to_string();
            let made = sent!(&op);
            let theirs = ds.land(&tag);
            let kept = ledger.record(op.id(), &tag, &theirs, IntentState::Done).await.unwrap();
            assert_eq!(kept, theirs);
            let mut tx = $begin;
            let recorded = effects.attempt(&op).$finish(&mut tx, &made).await.expect("finish");
            tx.commit().await.unwrap();
            assert_eq!(recorded, Outcome::Done(theirs.clone()));
            effects.attempt(&op).undo_unkept(&*ds, &made, &recorded).await;
            assert_eq!(ds.with_tag(&tag), vec![theirs.clone()], "ours undone, theirs kept");
            assert_eq!(ledger.ownership(&tag, &theirs, now()).await.unwrap(), Ownership::Owned);

            // Taken for a rollback before the finish: refused, and the record is committed still.
            let op = operation();
            let tag = op.derive("thing").to_string();
            let made = sent!(&op);
            let row = ledger.operation(op.id()).await.unwrap().expect("the operation");
            assert!(ledger.take_for_rollback(op.id(), row.last_attempt_at).await.unwrap());
            let mut tx = $begin;
            let refused = effects.attempt(&op).$finish(&mut tx, &made).await;
            assert!(matches!(refused, Err(EffectError::RolledBack)), "{refused:?}");
            tx.commit().await.unwrap();
            let intent = ledger.intent(&tag).await.unwrap().expect("the intent, for the reaper");
            assert_eq!(intent.resource_id.as_deref(), Some(made.outcome().id()));
            assert_eq!(intent.state, IntentState::Done);
            assert_eq!(ds.sends(), 4);
        }};
    }

    #[tokio::test]
    async fn sqlite() {
        use sqlx::{Connection, Executor};
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("effects.db").display());
        let ledger = SqlLedger::connect(&url, 2).await.expect("open");
        ledger.migrate().await.expect("migrate");
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("the service's connection");
        conn.execute("CREATE TABLE things (id TEXT PRIMARY KEY)").await.unwrap();
        cases!(
            Arc::new(ledger),
            conn,
            conn.begin_with("BEGIN IMMEDIATE").await.unwrap(),
            decide_in_sqlite,
            finish_made_in_sqlite
        );
    }

    #[tokio::test]
    async fn postgres() {
        use sqlx::{Connection, Executor};
        let Some(db) = TestDatabase::create().await else { return };
        let ledger = SqlLedger::connect(db.url(), 2).await.expect("connect");
        ledger.migrate().await.expect("migrate");
        let mut conn = sqlx::PgConnection::connect(db.url()).await.expect("the service's connection");
        conn.execute("CREATE TABLE things (id TEXT PRIMARY KEY)").await.unwrap();
        cases!(Arc::new(ledger), conn, conn.begin().await.unwrap(), decide_in_postgres, finish_made_in_postgres);
        drop(conn);
    }
}
