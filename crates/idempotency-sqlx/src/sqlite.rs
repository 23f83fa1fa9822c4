//! The SQLite store.

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordId, RecordPage, RecordQuery, Renewal,
    Resolve, Scope, Store, StoreError, StoredResponse, Timestamp,
};
use sqlx::Row;
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteRow, SqliteSynchronous,
};

use crate::row::{ClaimDidNotSettle, RawRecord, RawState, SpaceWatch, db_error, fenced, record_columns, stale_cutoff};

/// How long a connection waits for SQLite's write lock before giving up. Writers queue on one
/// lock; every write here is one short statement or transaction, so waiting is always better
/// than failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections in a pool made by [`SqliteStore::connect`]: readers run in parallel under WAL,
/// writers queue on the file's lock anyway.
const MAX_CONNECTIONS: u32 = 8;

/// An [`idempotency::Store`] in an SQLite database file.
///
/// Durable across restarts: WAL journal with `synchronous = FULL`, so a record whose claim or
/// completion returned is on disk. Multi-statement writes run in `BEGIN IMMEDIATE`
/// transactions and every connection has a busy timeout, so concurrent writers wait for the
/// lock instead of failing with `SQLITE_BUSY`.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    space: SpaceWatch,
}

impl SqliteStore {
    /// Opens (and creates, when missing) the database at `url`: `sqlite://path/to/file.db`,
    /// `sqlite:file.db`, or a plain file path. Does not run the migrations; call
    /// [`SqliteStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = crate::sqlite_pool_options(MAX_CONNECTIONS)
            .connect_with(Self::connect_options(url)?)
            .await
            .map_err(db_error)?;
        Ok(Self::from_pool(pool))
    }

    /// The connection options [`SqliteStore::connect`] uses (create if missing, WAL,
    /// `synchronous = FULL`, busy timeout, foreign keys on), for a service that builds its own
    /// pool on the same file and passes it to [`SqliteStore::from_pool`].
    pub fn connect_options(url: &str) -> Result<SqliteConnectOptions, StoreError> {
        let options = match url.parse() {
            Ok(crate::DatabaseUrl::Sqlite(url)) => {
                SqliteConnectOptions::from_str(&url).map_err(StoreError::unavailable)?
            }
            _ => SqliteConnectOptions::new().filename(url),
        };
        Ok(options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true))
    }

    /// Wraps an existing pool. Its connections should have a busy timeout and WAL mode (see
    /// [`SqliteStore::connect_options`]).
    pub fn from_pool(pool: SqlitePool) -> Self {
        Self { pool, space: SpaceWatch::default() }
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Runs the migrations ([`crate::sqlite_migrator`]); safe to call on every start.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        crate::sqlite_migrator().run(&self.pool).await.map_err(StoreError::unavailable)
    }

    async fn fetch<'e, E>(executor: E, scope: &Scope) -> Result<Option<Record>, StoreError>
    where
        E: sqlx::Executor<'e, Database = sqlx::Sqlite>,
    {
        let row = sqlx::query(SELECT)
            .bind(scope.principal.as_str())
            .bind(scope.endpoint.as_str())
            .bind(scope.key.as_str())
            .fetch_optional(executor)
            .await
            .map_err(db_error)?;
        row.map(|r| decode(&r)).transpose()
    }
}

const SELECT: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_records WHERE principal = ?1 AND endpoint = ?2 AND key = ?3"
);

// Inserts a new record, or replaces one whose key is free (expired, and not in flight under a
// claim started after the stale cutoff ?8: `Record::is_free`); a live record is left alone and
// nothing is returned for it.
const UPSERT: &str = concat!(
    "INSERT INTO idempotency_records \
       (principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at) \
     VALUES (?1, ?2, ?3, ?4, ?5, 'in_flight', 1, ?6, ?6, ?7) \
     ON CONFLICT (principal, endpoint, key) DO UPDATE SET \
       record_id = excluded.record_id, fingerprint = excluded.fingerprint, state = 'in_flight', generation = 1, \
       response_status = NULL, response_headers = NULL, response_body = NULL, response_encoding = NULL, \
       created_at = excluded.created_at, started_at = excluded.started_at, expires_at = excluded.expires_at \
     WHERE idempotency_records.expires_at <= excluded.created_at \
       AND (idempotency_records.state <> 'in_flight' OR idempotency_records.started_at <= ?8) \
     RETURNING ",
    record_columns!()
);

const RECLAIM: &str = concat!(
    "UPDATE idempotency_records SET state = 'in_flight', generation = generation + 1, started_at = ?6, \
       expires_at = MAX(expires_at, ?8) \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND (state = 'failed' OR (state = 'in_flight' AND started_at <= ?7)) \
     RETURNING ",
    record_columns!()
);

const COMPLETE: &str = "UPDATE idempotency_records SET state = 'completed', response_status = ?6, \
       response_headers = ?7, response_body = ?8, response_encoding = ?9, expires_at = ?10 \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight'";

const FAIL: &str = "UPDATE idempotency_records SET state = 'failed' \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight'";

const MARK_UNCERTAIN: &str = "UPDATE idempotency_records SET state = 'uncertain' \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight'";

// A stale in-flight record (started at or before ?6) becomes uncertain; its generation stays.
const MARK_STALE_UNCERTAIN: &str = concat!(
    "UPDATE idempotency_records SET state = 'uncertain', expires_at = MAX(expires_at, ?7) \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight' AND started_at <= ?6 \
     RETURNING ",
    record_columns!()
);

const TAKE_OVER_UNCERTAIN: &str = concat!(
    "UPDATE idempotency_records SET state = 'in_flight', generation = generation + 1, started_at = ?6, \
       expires_at = MAX(expires_at, ?7) \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'uncertain' \
     RETURNING ",
    record_columns!()
);

// Renews a live claim and, with it, the record's expiry; neither moves backwards (replicas'
// clocks differ a little).
const HEARTBEAT: &str = "UPDATE idempotency_records SET started_at = MAX(started_at, ?6), \
       expires_at = MAX(expires_at, ?7) \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight'";

const REMOVE: &str = "DELETE FROM idempotency_records \
     WHERE principal = ?1 AND endpoint = ?2 AND key = ?3 AND record_id = ?4 AND generation = ?5 \
       AND state = 'in_flight'";

const SWEEP: &str = "DELETE FROM idempotency_records WHERE rowid IN \
     (SELECT rowid FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";

fn micros(t: Timestamp) -> i64 {
    t.timestamp_micros()
}

fn timestamp(row: &SqliteRow, i: usize) -> Result<Timestamp, StoreError> {
    let us: i64 = row.try_get(i).map_err(db_error)?;
    chrono::DateTime::from_timestamp_micros(us).ok_or_else(|| StoreError::Corrupt(format!("timestamp {us}")))
}

fn decode(row: &SqliteRow) -> Result<Record, StoreError> {
    RawRecord {
        principal: row.try_get(0).map_err(db_error)?,
        endpoint: row.try_get(1).map_err(db_error)?,
        key: row.try_get(2).map_err(db_error)?,
        rest: RawState::read(row, 3, timestamp)?,
    }
    .into_record()
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        // A replay or an in-progress answer needs only a read, which WAL runs beside writers
        // without taking the write lock.
        if let Some(record) = Self::fetch(&self.pool, &req.scope).await?
            && !record.is_free(req.now, req.in_flight_ttl)
        {
            return Ok(ClaimOutcome::Existing(record));
        }
        // Absent or expired: insert or replace under the write lock. BEGIN IMMEDIATE takes the
        // lock up front (waiting out the busy timeout), so the read that may follow the upsert
        // cannot be invalidated by another writer.
        let record = req.new_record();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(|e| self.space.db_error(e))?;
        let row = sqlx::query(UPSERT)
            .bind(req.scope.principal.as_str())
            .bind(req.scope.endpoint.as_str())
            .bind(req.scope.key.as_str())
            .bind(record.record_id.as_bytes().as_slice())
            .bind(record.fingerprint.as_str())
            .bind(micros(req.now))
            .bind(micros(record.expires_at))
            // NULL when no claim can be that old: `started_at <= NULL` is never true.
            .bind(stale_cutoff(req.now, req.in_flight_ttl).map(micros))
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.space.db_error(e))?;
        let outcome = match row {
            Some(row) => self.space.owned(Claim::new(decode(&row)?)),
            None => match Self::fetch(&mut *tx, &req.scope).await? {
                Some(existing) => ClaimOutcome::Existing(existing),
                // The upsert conflicted, so the row exists and we hold the write lock.
                None => return Err(StoreError::unavailable(ClaimDidNotSettle(1))),
            },
        };
        tx.commit().await.map_err(|e| self.space.db_error(e))?;
        Ok(outcome)
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let row = bind_fence(RECLAIM, record)
            .bind(micros(now))
            // NULL when no claim can be that old: `started_at <= NULL` is never true.
            .bind(stale_cutoff(now, in_flight_ttl).map(micros))
            .bind(micros(req.record_expires_at()))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r).map(Claim::new)).transpose()
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(COMPLETE, r)
            .bind(i32::from(response.status))
            .bind(response.headers_json())
            .bind(response.body.stored_bytes().as_ref())
            .bind(response.body.encoding().as_str())
            .bind(micros(expires_at))
            .execute(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        self.space.wrote();
        fenced(done.rows_affected(), claim)
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(FAIL, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(MARK_UNCERTAIN, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let row = bind_fence(MARK_STALE_UNCERTAIN, record)
            // NULL when no claim can be that old: `started_at <= NULL` is never true.
            .bind(stale_cutoff(now, in_flight_ttl).map(micros))
            .bind(micros(req.record_expires_at()))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r)).transpose()
    }

    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, .. } = req;
        let row = bind_fence(TAKE_OVER_UNCERTAIN, record)
            .bind(micros(now))
            .bind(micros(req.record_expires_at()))
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r).map(Claim::new)).transpose()
    }

    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(HEARTBEAT, r)
            .bind(micros(renewal.now))
            .bind(micros(renewal.record_expires_at()))
            .execute(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(REMOVE, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        Self::fetch(&self.pool, scope).await
    }

    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(SWEEP)
            .bind(micros(now))
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        Ok(done.rows_affected())
    }

    /// Not ready either while a recent write was refused for lack of space and none succeeded
    /// since: a full database still answers a read.
    async fn ping(&self) -> Result<(), StoreError> {
        self.space.check()?;
        sqlx::query("SELECT 1").execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        Ok(())
    }

    /// A range scan of the primary key, whose first column is the principal; failed records
    /// (which stored nothing) are left out with the expired ones.
    async fn count_records(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records WHERE principal = ?1 AND expires_at > ?2 AND state <> 'failed'",
        )
        .bind(principal.as_str())
        .bind(micros(now))
        .fetch_one(&self.pool)
        .await
        .map_err(|e| self.space.db_error(e))?;
        Ok(Some(u64::try_from(n).unwrap_or(0)))
    }

    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.admin_list(query).await
    }

    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.admin_get_by_id(id).await
    }

    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        self.admin_forget(id).await
    }

    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        self.admin_resolve(id, response, expires_at).await
    }
}

/// `sql` with `?1`-`?5` bound to the row of `record` and its fence: record id and generation.
fn bind_fence<'q>(sql: &'static str, record: &'q Record) -> sqlx::query::Query<'q, sqlx::Sqlite, SqliteArguments> {
    sqlx::query(sql)
        .bind(record.scope.principal.as_str())
        .bind(record.scope.endpoint.as_str())
        .bind(record.scope.key.as_str())
        .bind(record.record_id.as_bytes().as_slice())
        .bind(record.generation)
}

// SQLite keeps the scope whole: its index has no row-size limit.
crate::admin::admin_methods!(
    SqliteStore,
    crate::admin::sqlite,
    decode,
    |t: Timestamp| micros(t),
    std::borrow::Cow::<str>::Borrowed
);
