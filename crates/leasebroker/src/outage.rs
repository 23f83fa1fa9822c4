//! Answering within docs/protocol.md#running-leasebroker's 5 s when the database stops answering.
//!
//! A database that refuses connections fails every statement at once, and the pool's acquire
//! timeout ([`crate::db::PG_ACQUIRE_TIMEOUT`]) bounds the wait for a new connection. Neither
//! bounds a database that does not answer at all: a network partition that drops packets leaves
//! a pooled connection waiting for TCP's retransmission timeout (many minutes), and a SQLite file
//! locked by another process keeps a writer in its busy timeout while every other request queues
//! for the connection. The idempotency layer bounds its own store calls
//! ([`idempotency_tower::IdempotencyLayerBuilder::store_timeout`]); the service's own statements
//! (the handlers' domain reads and writes, on every route) are bounded here, by one middleware:
//!
//! - a request answered within [`STORE_DEADLINE`] (3 s) is untouched;
//! - a request still running then is given a probe of the database of at most [`PROBE_TIMEOUT`]:
//!   on PostgreSQL one `SELECT 1` through the service's own pool; on SQLite, whose one pooled
//!   connection is also the writer queue (and may be busy for longer than that under load
//!   without anything being wrong), whether a connection of the probe's own can take the write
//!   lock (`BEGIN IMMEDIATE`, then `ROLLBACK`) or, when it cannot, whether other connections
//!   committed meanwhile (`PRAGMA data_version`): writers that keep committing on a disk slowed
//!   by other work are busy, not stuck. A lock not taken in time is an outage only when
//!   **another process** holds it ([`sqlite_write_lock_holder`], read from the kernel's lock
//!   table): the service's own writers, however slow (a CPU-starved machine stretches one
//!   transaction over seconds), are load, not an outage. When the database does not answer
//!   (every connection waits on a PostgreSQL that does not answer; another process holds the
//!   SQLite file's write lock), the request is answered `503 store-unavailable` with
//!   `Retry-After`, at most 4 s after it came;
//! - when the probe succeeds, the request is slow for another reason (a slow hypervisor) and
//!   keeps running, probed again every [`RECHECK`]; once a probe has succeeded for a request,
//!   it takes two failed probes in a row to give it up (one may meet a commit of the service's
//!   own that holds the SQLite write lock a little longer than the probe waits, on a loaded
//!   disk), so a database that stops answering mid-request is answered within 2 s of a
//!   [`RECHECK`].
//!
//! Dropping the request's future cuts nothing that must finish: a claimed request runs in the
//! idempotency layer's own detachable future, which finishes in a task of its own when dropped
//! (exactly as when a client hangs up), and its record is released as soon as the store answers
//! again if its handler fails meanwhile. What is dropped otherwise is a read, or work before a
//! claim. A probe cut in the middle (its request's client went away, or its own time ran out)
//! closes the probe's SQLite connection rather than keeping it: its `BEGIN IMMEDIATE` may still
//! take the write lock after the cut, with no `ROLLBACK` to follow.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotency::ErrorChain;
use idempotency_tower::Problem;

use crate::db::Db;

/// How long a request runs before the database is probed on its behalf.
pub const STORE_DEADLINE: Duration = Duration::from_secs(3);
/// The longest a probe may take: [`STORE_DEADLINE`] plus this is under docs/protocol.md#running-leasebroker's 5 s, with
/// room for the answer. A pool so busy that a `SELECT 1` waits longer than this for a request
/// that already waited [`STORE_DEADLINE`] is answered `503` too (with `Retry-After`: retry).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a request that is slow for another reason is probed again.
pub const RECHECK: Duration = Duration::from_secs(1);
/// How long a probe's result is reused by other waiting requests.
const PROBE_REUSED_FOR: Duration = Duration::from_secs(1);

/// Probes whether the database answers now, for [`store_deadline`].
///
/// Only the service's own database: the idempotency layer bounds its calls to the record store
/// itself, so a record store that is down (Redis) never holds a request, and a request that is
/// slow for another reason while it is down (a slow hypervisor) keeps running.
#[derive(Clone)]
pub struct StoreProbe {
    db: Db,
    last: Arc<Mutex<Option<(Instant, bool)>>>,
    /// SQLite: the probe's own connection, opened on first use.
    writer: Arc<tokio::sync::Mutex<Option<sqlx::SqliteConnection>>>,
}

impl std::fmt::Debug for StoreProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreProbe").finish_non_exhaustive()
    }
}

impl StoreProbe {
    /// Probes `db`.
    pub fn new(db: Db) -> Self {
        Self { db, last: Arc::default(), writer: Arc::default() }
    }

    /// Whether the database (and the record store) answer within [`PROBE_TIMEOUT`]; a result
    /// at most [`PROBE_REUSED_FOR`] old is reused.
    pub async fn answers(&self) -> bool {
        let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, ok)) = last
            && at.elapsed() < PROBE_REUSED_FOR
        {
            return ok;
        }
        self.probe_now().await
    }

    /// Probes now, whatever an earlier probe found, and records the result for [`Self::answers`].
    async fn probe_now(&self) -> bool {
        let ok = match tokio::time::timeout(PROBE_TIMEOUT, self.probe()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) if is_busy(&e) && self.only_this_process_writes() => {
                tracing::info!(error = %ErrorChain(&e), "the SQLite write lock is held by this process's own writers: busy, not out");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %ErrorChain(&e), "the database does not answer a probe");
                false
            }
            Err(_) => {
                // The cut probe dropped its connection (see `probe`).
                if self.only_this_process_writes() {
                    tracing::info!(timeout = ?PROBE_TIMEOUT, "a probe of SQLite took longer than its timeout and no other process holds the write lock: busy, not out");
                    true
                } else {
                    tracing::warn!(timeout = ?PROBE_TIMEOUT, "the database did not answer a probe in time");
                    false
                }
            }
        };
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), ok));
        ok
    }

    /// SQLite: whether the kernel's lock table shows that no other process holds the database's
    /// write lock (so what kept the probe from it is this process's own writers). False on
    /// PostgreSQL, and when it cannot tell (no lock table to read, no `-shm` file).
    fn only_this_process_writes(&self) -> bool {
        let Db::Sqlite(pool) = &self.db else { return false };
        let shm = shm_path(pool.connect_options().get_filename());
        matches!(sqlite_write_lock_holder(&shm), Some(Holder::ThisProcess))
    }

    /// PostgreSQL: `SELECT 1` through the service's pool, what every handler's statement waits
    /// for. SQLite: the write lock, taken and given back on the probe's own connection (a
    /// write-locked file still reads, so a read would pass; and the pool's one connection may be
    /// busy with other requests' work for a while under load, which is no outage); a lock not
    /// given in time while commits still land (a disk slowed by other writers makes each commit's
    /// fsync slow) is no outage either.
    async fn probe(&self) -> Result<(), sqlx::Error> {
        match &self.db {
            Db::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop),
            Db::Sqlite(pool) => {
                use sqlx::ConnectOptions;
                let mut writer = self.writer.lock().await;
                // The connection is this probe's own until it ends, and is put back only then. A
                // probe cut in the middle (its caller went away, or its time ran out) drops it,
                // which closes it: its `BEGIN IMMEDIATE` runs on the connection's thread and still
                // takes the lock once it is free, and the `ROLLBACK` after it is never sent to a
                // caller that is gone. Kept, the connection would hold the write lock, and every
                // writer of the service would wait out its busy timeout behind it.
                let mut conn = match writer.take() {
                    Some(conn) => conn,
                    None => {
                        // Shorter than the probe's own bound, so a lock not given in time is an
                        // answer (SQLITE_BUSY), not a statement cut in the middle.
                        let options = (*pool.connect_options()).clone().busy_timeout(PROBE_TIMEOUT * 3 / 4);
                        options.connect().await?
                    }
                };
                // Whether other connections committed meanwhile (`PRAGMA data_version`, per
                // connection): a writer that keeps committing on a slow disk holds the lock for
                // longer than the probe waits, and is no outage.
                const VERSION: &str = "PRAGMA data_version";
                let before = sqlx::query_scalar::<_, i64>(VERSION).fetch_one(&mut conn).await;
                let locked = sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK").execute(&mut conn).await;
                let Err(e) = locked else {
                    *writer = Some(conn);
                    return Ok(());
                };
                let committed = match before {
                    Ok(before) => {
                        let after = sqlx::query_scalar::<_, i64>(VERSION).fetch_one(&mut conn).await;
                        after.is_ok_and(|after| after != before)
                    }
                    Err(_) => false,
                };
                // Whatever state it is left in, the next probe starts on a fresh connection: this
                // one is dropped here.
                if committed { Ok(()) } else { Err(e) }
            }
        }
    }
}

/// Whether `e` is SQLite's "the lock is taken" (`SQLITE_BUSY`, `SQLITE_LOCKED`), not a failure.
fn is_busy(e: &sqlx::Error) -> bool {
    // The extended result code; its low byte is the primary code (5 busy, 6 locked).
    matches!(e, sqlx::Error::Database(db)
        if db.code().and_then(|c| c.parse::<i32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6)))
}

/// Who holds a SQLite database's write lock, as far as the kernel's lock table tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Nobody in another process: this process's own connections, or nobody.
    ThisProcess,
    /// Another process (its pid).
    Another(u32),
}

/// The `-shm` file of a WAL database at `db`, where SQLite's unix VFS takes its WAL locks.
fn shm_path(db: &std::path::Path) -> std::path::PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push("-shm");
    name.into()
}

/// The byte of the `-shm` file whose `fcntl` write lock is a WAL database's write lock
/// (SQLite's unix VFS: `UNIX_SHM_BASE` 120 plus `WAL_WRITE_LOCK` 0).
const WAL_WRITE_LOCK_BYTE: u64 = 120;

/// Who holds the write lock of the WAL database whose `-shm` file is `shm`, read from Linux's
/// `/proc/locks` (reading it opens no descriptor of the file: closing one would drop every POSIX
/// lock this process's SQLite connections hold on it). `None` when it cannot tell.
pub fn sqlite_write_lock_holder(shm: &std::path::Path) -> Option<Holder> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(shm).ok()?;
    let table = std::fs::read_to_string("/proc/locks").ok()?;
    Some(write_lock_holder(&table, meta.dev(), meta.ino(), std::process::id()))
}

/// [`sqlite_write_lock_holder`] on the text of `/proc/locks` (lines such as
/// `1: POSIX  ADVISORY  WRITE 2315 fd:01:1839 120 120`; `->` lines are waiters, not holders).
fn write_lock_holder(table: &str, dev: u64, ino: u64, me: u32) -> Holder {
    // Linux's `st_dev` encoding, as /proc/locks prints it (hex major:minor).
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let file = format!("{major:02x}:{minor:02x}:{ino}");
    for line in table.lines().filter(|l| !l.contains("->")) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, _kind, _, access, pid, id, start, end, ..] = fields[..] else { continue };
        let covers = start.parse::<u64>().is_ok_and(|s| s <= WAL_WRITE_LOCK_BYTE)
            && (end == "EOF" || end.parse::<u64>().is_ok_and(|e| e >= WAL_WRITE_LOCK_BYTE));
        if access != "WRITE" || id != file || !covers {
            continue;
        }
        // An OFD lock names no process (-1): not this process's SQLite, which takes POSIX locks.
        match pid.parse::<u32>() {
            Ok(pid) if pid == me => {}
            Ok(pid) => return Holder::Another(pid),
            Err(_) => return Holder::Another(0),
        }
    }
    Holder::ThisProcess
}

/// The middleware: see the module docs.
pub async fn store_deadline(State(probe): State<StoreProbe>, req: Request, next: Next) -> Response {
    let work = next.run(req);
    tokio::pin!(work);
    let mut wait = STORE_DEADLINE;
    // Whether the store answered a probe during this request: then one failed probe may be a
    // commit of the service's own holding the SQLite write lock a little longer than the probe
    // waits (a loaded disk), and the store is probed once more, afresh, before the request is
    // given up. The first probe is not repeated: that keeps docs/protocol.md#running-leasebroker's 5 s.
    let mut answered = false;
    loop {
        if let Ok(response) = tokio::time::timeout(wait, &mut work).await {
            return response;
        }
        if still_answers(&mut answered, probe.answers(), || probe.probe_now()).await {
            wait = RECHECK;
            continue;
        }
        tracing::warn!("a request waited on a store that does not answer; it is answered 503");
        return store_unavailable();
    }
}

/// Whether a request still waiting on its work keeps waiting: the store answered the probe
/// (`probe`, a result reused for a while), or it failed but had answered one of this request's
/// earlier probes (`answered`) and answers a fresh one (`again`).
async fn still_answers<F: Future<Output = bool>>(
    answered: &mut bool,
    probe: impl Future<Output = bool>,
    again: impl FnOnce() -> F,
) -> bool {
    if probe.await || (*answered && again().await) {
        *answered = true;
        return true;
    }
    false
}

/// `503 store-unavailable` with `Retry-After`, the one answer of docs/protocol.md#running-leasebroker.
pub(crate) fn store_unavailable() -> Response {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        idempotency::problems::STORE_UNAVAILABLE,
        "Store unavailable",
        "the store does not answer; a retry with the same key replays or resumes the request",
    )
    .with_retry_after(1)
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sqlite(dir: &tempfile::TempDir) -> Db {
        let db = Db::connect(&format!("sqlite://{}", dir.path().join("p.db").display())).await.expect("db");
        db.migrate().await.expect("migrate");
        db
    }

    #[tokio::test]
    async fn a_busy_pool_is_no_outage_while_the_sqlite_file_takes_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sqlite(&dir).await;
        let Db::Sqlite(pool) = &db else { unreachable!() };
        // The pool's one connection is busy (here: held), as under a queue of requests.
        let _held = pool.acquire().await.expect("the pool's connection");
        assert!(StoreProbe::new(db.clone()).answers().await, "a busy pool answered 503 while the file takes writes");
    }

    /// Seen in CI under load: a request slow for another reason (a slow hypervisor) was answered
    /// 503 when one probe, late in the request, met the write lock held for longer than the
    /// probe's busy timeout by a commit on a loaded disk. A store that answered this request's
    /// earlier probe is probed once more before the request is given up; the first probe of a
    /// request is not repeated (docs/protocol.md#running-leasebroker's 5 s). (What a probe finds on a locked SQLite file is
    /// `a_sqlite_file_another_process_has_locked_is_an_outage`.)
    #[tokio::test]
    async fn one_failed_probe_after_a_good_one_is_not_an_outage() {
        let fresh_probes = std::cell::Cell::new(0);
        let again = |ok: bool| {
            let fresh_probes = &fresh_probes;
            move || {
                fresh_probes.set(fresh_probes.get() + 1);
                std::future::ready(ok)
            }
        };
        let mut answered = false;
        // The first probe fails: given up at once, no second probe.
        assert!(!still_answers(&mut answered, std::future::ready(false), again(true)).await);
        assert_eq!(fresh_probes.get(), 0);
        // A probe passes; a later one fails and a fresh one passes: keep waiting.
        assert!(still_answers(&mut answered, std::future::ready(true), again(false)).await);
        assert!(still_answers(&mut answered, std::future::ready(false), again(true)).await);
        assert_eq!(fresh_probes.get(), 1);
        // Two failed in a row after a good one: given up.
        assert!(!still_answers(&mut answered, std::future::ready(false), again(false)).await);
        assert_eq!(fresh_probes.get(), 2);
    }

    /// Seen on a loaded machine (a build writing beside the tests): each commit's fsync was slow,
    /// the service's own writers held the SQLite write lock one after the other for longer than
    /// the probe waits, and a healthy slow create was answered 503.
    #[tokio::test]
    async fn writers_that_keep_committing_are_no_outage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sqlite(&dir).await;
        let Db::Sqlite(pool) = &db else { unreachable!() };
        use sqlx::ConnectOptions;
        let mut other = (*pool.connect_options()).clone().connect().await.expect("another connection");
        sqlx::raw_sql("CREATE TABLE probe_busy (n INTEGER)").execute(&mut other).await.expect("table");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = tokio::spawn({
            let stop = stop.clone();
            async move {
                // Each transaction holds the lock 200 ms, the next takes it at once.
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    sqlx::raw_sql("BEGIN IMMEDIATE; INSERT INTO probe_busy VALUES (1)")
                        .execute(&mut other)
                        .await
                        .expect("write");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    sqlx::raw_sql("COMMIT").execute(&mut other).await.expect("commit");
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let answered = StoreProbe::new(db.clone()).answers().await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.await.expect("writer");
        assert!(answered, "writers committing one after the other were taken for an outage");
    }

    /// Seen in CI under load (both cores busy): a request's second and third probes found the
    /// write lock taken for longer than the probe waits, with no commit meanwhile, and a healthy
    /// create was answered 503. The holder was the service's own writer, one transaction
    /// stretched over seconds by a starved CPU. Here a connection of this process holds the lock
    /// for the probe's whole time, committing nothing: load, not an outage. (A lock another
    /// process holds is an outage: `store_bounds::a_locked_sqlite_database_is_answered_503_within_5_s_on_every_route`,
    /// where the test process holds the lock of the server's database.)
    #[tokio::test]
    async fn a_write_lock_this_process_holds_is_load_not_an_outage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sqlite(&dir).await;
        let Db::Sqlite(pool) = &db else { unreachable!() };
        use sqlx::ConnectOptions;
        let mut other = (*pool.connect_options()).clone().connect().await.expect("another connection");
        sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut other).await.expect("lock");
        let shm = shm_path(pool.connect_options().get_filename());
        assert_eq!(sqlite_write_lock_holder(&shm), Some(Holder::ThisProcess));
        let probe = StoreProbe::new(db.clone());
        assert!(probe.answers().await, "this process's own writer was taken for an outage");
        sqlx::raw_sql("ROLLBACK").execute(&mut other).await.expect("unlock");
        *probe.last.lock().expect("last") = None;
        assert!(probe.answers().await, "and the lock given back answers");
    }

    /// A probe cut while its `BEGIN IMMEDIATE` waits for the write lock (its caller went away: a
    /// client that hung up during a slow request) must leave no lock behind. The statement runs on
    /// the connection's own thread and still takes the lock once it is free; the `ROLLBACK` after
    /// it is not sent to a caller that is gone, so a connection kept for the next probe would hold
    /// the write lock, and every writer of the service would wait out its busy timeout behind it.
    #[tokio::test]
    async fn a_probe_cut_while_it_waits_for_the_write_lock_leaves_no_lock_behind() {
        use sqlx::ConnectOptions;
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sqlite(&dir).await;
        let Db::Sqlite(pool) = &db else { unreachable!("a SQLite database") };
        let probe = StoreProbe::new(db.clone());
        let mut other = (*pool.connect_options()).clone().connect().await.expect("another connection");
        sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut other).await.expect("lock");
        // The probe waits for the lock; its caller gives up before it is given.
        let cut = tokio::time::timeout(Duration::from_millis(300), probe.probe_now()).await;
        assert!(cut.is_err(), "the probe answered while the lock was held");
        sqlx::raw_sql("ROLLBACK").execute(&mut other).await.expect("unlock");
        // The cut statement's busy handler retries within its 750 ms and takes the lock; then,
        // whatever it does, a writer gets the lock within 2 s.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let writer = (*pool.connect_options()).clone().busy_timeout(Duration::from_secs(2));
        let mut writer = writer.connect().await.expect("a writer");
        sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK")
            .execute(&mut writer)
            .await
            .expect("the write lock was left held by the cut probe");
    }

    #[test]
    fn the_lock_table_names_another_process_only_for_the_write_lock_byte_of_the_file() {
        // dev 0xfd01 is fd:01; the file is inode 1839.
        let (dev, ino, me) = (0xfd01, 1839, 4242);
        let holder = |table: &str| write_lock_holder(table, dev, ino, me);
        assert_eq!(holder(""), Holder::ThisProcess);
        assert_eq!(holder("1: POSIX  ADVISORY  WRITE 4242 fd:01:1839 120 120\n"), Holder::ThisProcess);
        assert_eq!(holder("1: POSIX  ADVISORY  WRITE 777 fd:01:1839 120 120\n"), Holder::Another(777));
        assert_eq!(holder("1: POSIX  ADVISORY  WRITE 777 fd:01:1839 100 EOF\n"), Holder::Another(777));
        assert_eq!(holder("1: OFDLCK ADVISORY  WRITE -1 fd:01:1839 120 120\n"), Holder::Another(0));
        // Another byte (a reader's mark), a read lock, another file, another device, a waiter.
        for other in [
            "1: POSIX  ADVISORY  WRITE 777 fd:01:1839 123 123",
            "1: POSIX  ADVISORY  READ  777 fd:01:1839 120 120",
            "1: POSIX  ADVISORY  WRITE 777 fd:01:1840 120 120",
            "1: POSIX  ADVISORY  WRITE 777 fd:02:1839 120 120",
            "1: -> POSIX  ADVISORY  WRITE 777 fd:01:1839 120 120",
        ] {
            assert_eq!(holder(other), Holder::ThisProcess, "{other}");
        }
    }
}
