//! The PostgreSQL store.

use std::sync::Arc;

use async_trait::async_trait;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordChanges, RecordId, RecordPage,
    RecordQuery, Renewal, Resolve, Scope, Store, StoreError, StoredResponse, Timestamp, stored_component,
};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};

use crate::changes::Announcements;
use crate::fenced::{FencedSql, bind_fence, bind_scope, fenced_sql};

use crate::row::{
    ClaimDidNotSettle, MAX_CLAIM_ATTEMPTS, RawRecord, RawState, SpaceWatch, db_error, fenced, stale_cutoff,
    state_columns,
};

/// Connections in a pool made by [`PostgresStore::connect`].
const MAX_CONNECTIONS: u32 = 10;

/// Which statement [`PostgresStore`] uses to claim a key. Both are one round trip that tells
/// the caller whether it owns the key and, if not, returns the whole existing record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// `INSERT ... ON CONFLICT DO NOTHING` in a CTE, with a `UNION ALL` read of the existing
    /// row: writes nothing when the key exists, so a retry storm on one key costs only reads.
    /// The default.
    #[default]
    InsertOrRead,
    /// The design's reference statement,
    /// `INSERT ... ON CONFLICT (principal, endpoint, key) DO UPDATE SET key = EXCLUDED.key
    /// RETURNING (xmax = 0) AS inserted, ...`: its no-op update locks the row and writes a new
    /// row version (and WAL) on every conflict, i.e. on every retry. Kept for comparison.
    SeedUpsert,
}

/// An [`idempotency::Store`] in PostgreSQL, for several replicas sharing one database.
///
/// Every transition is one statement in its own implicit transaction; nothing is held open
/// between `claim` and `complete`. A claim is one round trip and returns the whole record, so
/// a replay costs one round trip and a first execution two (claim, complete).
///
/// Completing or failing a record announces it (`NOTIFY idempotency_record_changes`, once the
/// change committed, sent with others' by a background task off the request's path), and
/// [`Store::changes`] listens on one connection per store, so a request of another replica
/// waiting for the record (`Prefer: wait`) is woken at once. A connection pooler in transaction
/// mode (PgBouncer) does not carry LISTEN; the waiters then find the change by polling, as with
/// any store.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    strategy: ClaimStrategy,
    announcements: Announcements,
    space: SpaceWatch,
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:5432/db`) with a pool of up to 10 connections
    /// ([`crate::postgres_pool_options`]: no ping per checkout).
    /// Does not run the migrations; call [`PostgresStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool =
            crate::connect_postgres(url, crate::postgres_pool_options(MAX_CONNECTIONS)).await.map_err(db_error)?;
        Ok(Self::from_pool(pool))
    }

    /// Wraps an existing pool, with the default [`ClaimStrategy`].
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            strategy: ClaimStrategy::default(),
            announcements: Announcements::default(),
            space: SpaceWatch::default(),
        }
    }

    /// Uses `strategy` to claim keys.
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The claim strategy in use.
    pub fn claim_strategy(&self) -> ClaimStrategy {
        self.strategy
    }

    /// Sends no announcement when a record leaves `in_flight` (it still listens for other
    /// processes' announcements). Waiters in other processes then find this store's changes
    /// by polling, with backoff. For a database where no request waits (`Prefer: wait`) and
    /// for measuring what the announcements cost; by default they are sent.
    pub fn without_announcements(mut self) -> Self {
        self.announcements = crate::changes::Announcements::never();
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs the migrations ([`crate::postgres_migrator`]); safe to call on every start, from
    /// several replicas at once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        crate::postgres_migrator().run(&self.pool).await.map_err(StoreError::unavailable)
    }
}

const INSERT_OR_READ: &str = concat!(
    "WITH ins AS ( \
       INSERT INTO idempotency_records \
         (principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at) \
       VALUES ($1, $2, $3, $4, $5, 'in_flight', 1, $6, $6, $7) \
       ON CONFLICT (principal, endpoint, key) DO NOTHING \
       RETURNING ",
    state_columns!(),
    ", true AS inserted) \
     SELECT * FROM ins \
     UNION ALL \
     SELECT ",
    state_columns!(),
    ", false AS inserted FROM idempotency_records \
     WHERE principal = $1 AND endpoint = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)"
);

const SEED_UPSERT: &str = concat!(
    "INSERT INTO idempotency_records \
       (principal, endpoint, key, record_id, fingerprint, state, generation, created_at, started_at, expires_at) \
     VALUES ($1, $2, $3, $4, $5, 'in_flight', 1, $6, $6, $7) \
     ON CONFLICT (principal, endpoint, key) DO UPDATE SET key = EXCLUDED.key \
     RETURNING ",
    state_columns!(),
    ", (xmax = 0) AS inserted"
);

// Replaces a record whose key is free with a fresh one: a compare-and-set on the version the
// claimer read (record id and generation), still expired and not in flight under a claim started
// after the stale cutoff $10 (`Record::is_free`), so of concurrent claimers exactly one wins.
const REPLACE_EXPIRED: &str = concat!(
    "UPDATE idempotency_records SET record_id = $4, fingerprint = $5, state = 'in_flight', generation = 1, \
       response_status = NULL, response_headers = NULL, response_body = NULL, response_encoding = NULL, \
       created_at = $6, started_at = $6, expires_at = $7 \
     WHERE principal = $1 AND endpoint = $2 AND key = $3 AND record_id = $8 AND generation = $9 \
       AND expires_at <= $6 AND (state <> 'in_flight' OR started_at <= $10) \
     RETURNING ",
    state_columns!()
);

/// The read and the fenced transitions, shared with the partitioned table.
const SQL: FencedSql = fenced_sql!("idempotency_records", state_columns);

// Rows locked by a concurrent claim or sweeper are skipped, not waited for; the ctid list
// becomes a TID scan. The outer condition re-checks expiry on the row actually deleted.
const SWEEP: &str = "DELETE FROM idempotency_records WHERE ctid = ANY(ARRAY( \
       SELECT ctid FROM idempotency_records WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED)) \
     AND expires_at <= $1";

/// The record of `scope` from a row of [`state_columns!`]: every statement names its row by the
/// scope, so the row does not carry it back. Text and bytes are read borrowed from the row.
/// What a principal stores, for [`count_stored`].
const COUNT: &str =
    "SELECT count(*) FROM idempotency_records WHERE principal = $1 AND expires_at > $2 AND state <> 'failed'";

/// `count_records` of both PostgreSQL layouts, with `sql` counting one's table: a range scan of
/// the primary key, whose first column is the principal; failed records (which stored nothing)
/// are left out with the expired ones.
pub(crate) async fn count_stored(
    pool: &PgPool,
    space: &SpaceWatch,
    sql: &'static str,
    principal: &idempotency::Principal,
    now: Timestamp,
) -> Result<Option<u64>, StoreError> {
    let n: i64 = sqlx::query_scalar(sql)
        .bind(stored_component(principal.as_str()))
        .bind(now)
        .fetch_one(pool)
        .await
        .map_err(|e| space.db_error(e))?;
    Ok(Some(u64::try_from(n).unwrap_or(0)))
}

/// A record from a row of every column (as `record_columns!` lists them): the admin listing of
/// both PostgreSQL layouts.
pub(crate) fn decode_row(row: &PgRow) -> Result<Record, StoreError> {
    RawRecord {
        principal: row.try_get(0).map_err(db_error)?,
        endpoint: row.try_get(1).map_err(db_error)?,
        key: row.try_get(2).map_err(db_error)?,
        rest: RawState::read(row, 3, |row, i| row.try_get(i).map_err(db_error))?,
    }
    .into_record()
}

fn decode(row: &PgRow, scope: &Scope) -> Result<Record, StoreError> {
    RawState::read(row, 0, |row, i| row.try_get(i).map_err(db_error))?.into_record(scope.clone())
}

/// The column after [`state_columns!`] in a claim's row: whether this statement inserted it.
const INSERTED: usize = 11;

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let fresh = req.new_record();
        let sql = match self.strategy {
            ClaimStrategy::InsertOrRead => INSERT_OR_READ,
            ClaimStrategy::SeedUpsert => SEED_UPSERT,
        };
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let row = bind_scope(sql, &req.scope)
                .bind(fresh.record_id.as_bytes().as_slice())
                .bind(fresh.fingerprint.as_str())
                .bind(req.now)
                .bind(fresh.expires_at)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.space.db_error(e))?;
            // Zero rows (InsertOrRead only): a concurrent transaction inserted the key and
            // committed after this statement took its snapshot. The INSERT waited for it and
            // then did nothing, but the outer SELECT reads the statement's snapshot, in which
            // the row does not exist yet. The row is committed now, so running the statement
            // again sees it. (Also when the sweeper deleted the row in between: then the
            // insert wins.)
            let Some(row) = row else { continue };
            let inserted: bool = row.try_get(INSERTED).map_err(|e| self.space.db_error(e))?;
            let record = decode(&row, &req.scope)?;
            if inserted {
                return Ok(self.space.owned(Claim::new(record)));
            }
            if !record.is_free(req.now, req.in_flight_ttl) {
                return Ok(ClaimOutcome::Existing(record));
            }
            let replaced = bind_scope(REPLACE_EXPIRED, &req.scope)
                .bind(fresh.record_id.as_bytes().as_slice())
                .bind(fresh.fingerprint.as_str())
                .bind(req.now)
                .bind(fresh.expires_at)
                .bind(record.record_id.as_bytes().as_slice())
                .bind(record.generation)
                // NULL when no claim can be that old: `started_at <= NULL` is never true.
                .bind(stale_cutoff(req.now, req.in_flight_ttl))
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.space.db_error(e))?;
            if let Some(row) = replaced {
                return Ok(self.space.owned(Claim::new(decode(&row, &req.scope)?)));
            }
            // Another claimer replaced it first, its owner completed it, or the sweeper
            // deleted it: look again.
        }
        Err(StoreError::unavailable(ClaimDidNotSettle(MAX_CLAIM_ATTEMPTS)))
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let row = bind_fence(SQL.reclaim, record)
            .bind(now)
            // NULL when no claim can be that old: `started_at <= NULL` is never true.
            .bind(stale_cutoff(now, in_flight_ttl))
            .bind(req.record_expires_at())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r, &record.scope).map(Claim::new)).transpose()
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(SQL.complete, r)
            .bind(i32::from(response.status))
            .bind(response.headers_json())
            .bind(response.body.stored_bytes().as_ref())
            .bind(response.body.encoding().as_str())
            .bind(expires_at)
            .execute(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        self.space.wrote();
        fenced(done.rows_affected(), claim)?;
        self.announcements.announce(&self.pool, &r.scope);
        Ok(())
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(SQL.fail, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)?;
        self.announcements.announce(&self.pool, &r.scope);
        Ok(())
    }

    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(SQL.mark_uncertain, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)?;
        self.announcements.announce(&self.pool, &r.scope);
        Ok(())
    }

    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let row = bind_fence(SQL.mark_stale_uncertain, record)
            // NULL when no claim can be that old: `started_at <= NULL` is never true.
            .bind(stale_cutoff(now, in_flight_ttl))
            .bind(req.record_expires_at())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        let Some(row) = row else { return Ok(None) };
        let marked = decode(&row, &record.scope)?;
        self.announcements.announce(&self.pool, &record.scope);
        Ok(Some(marked))
    }

    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, .. } = req;
        let row = bind_fence(SQL.take_over_uncertain, record)
            .bind(now)
            .bind(req.record_expires_at())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r, &record.scope).map(Claim::new)).transpose()
    }

    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        let done = bind_fence(SQL.heartbeat, claim.record())
            .bind(renewal.now)
            .bind(renewal.record_expires_at())
            .execute(&self.pool)
            .await
            .map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        let r = claim.record();
        let done = bind_fence(SQL.remove, r).execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        fenced(done.rows_affected(), claim)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        let row = bind_scope(SQL.select, scope).fetch_optional(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode(&r, scope)).transpose()
    }

    async fn sweep_expired(&self, now: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(SWEEP)
            .bind(now)
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

    async fn count_records(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        count_stored(&self.pool, &self.space, COUNT, principal, now).await
    }

    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.admin_list(query).await
    }

    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.admin_get_by_id(id).await
    }

    /// Announced like `complete`, so that other processes drop their copies of the record.
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        let forgot = self.admin_forget(id).await?;
        if let Forget::Forgotten(r) = &forgot {
            self.announcements.announce(&self.pool, &r.scope);
        }
        Ok(forgot)
    }

    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        let resolved = self.admin_resolve(id, response, expires_at).await?;
        if let Resolve::Resolved(r) = &resolved {
            self.space.wrote();
            self.announcements.announce(&self.pool, &r.scope);
        }
        Ok(resolved)
    }

    /// Listens for the announcements of [`crate::CHANGES_CHANNEL`] on one connection of the
    /// pool's, from the first call on (it needs a tokio runtime; without one: none, and waiters
    /// poll).
    fn changes(&self) -> Option<Arc<RecordChanges>> {
        self.announcements.changes(&self.pool)
    }
}

crate::admin::admin_methods!(PostgresStore, crate::admin::postgres, decode_row, |t: Timestamp| t, stored_component);
