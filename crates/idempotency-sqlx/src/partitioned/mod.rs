//! The PostgreSQL store on a records table partitioned by expiry day: the opt-in layout for
//! retention at scale, where the sweeper drops whole days instead of deleting rows.
//!
//! # Layout
//!
//! `idempotency_records_by_day` (its own table, beside the default layout's
//! `idempotency_records`) is partitioned by range on `expires_at`, one partition per UTC day,
//! named `idempotency_records_by_day_pYYYYMMDD`. The partition key is the expiry itself, so when
//! an update moves a record's expiry to another day (a completion stores the retention, a reclaim
//! extends it) PostgreSQL moves the row to that day's partition. Every row of day D's partition
//! therefore expires before D + 1 day: once `D + 1 day <= now`, every row in it has expired for
//! sure, and dropping the partition removes exactly what a `DELETE ... WHERE expires_at <= now`
//! would have removed from it (PostgreSQL itself enforces the bound on every insert and update).
//!
//! # One key, one record
//!
//! A unique index on a partitioned table must contain the partition key, so
//! `(principal, endpoint, key)` is not unique across partitions by an index. Claims are
//! serialised per key instead: the claim is one call of the `idempotency_claim_by_day` function
//! (one round trip, see the migration), which takes a transaction-scoped advisory lock on a hash
//! of the scope, then looks the key up, then inserts or replaces. Only the claim creates a record
//! for a key, always under that lock, and each statement of the function reads a fresh snapshot
//! (READ COMMITTED; the function refuses any other isolation), so the look-up sees every earlier
//! claim of the key. The other transitions change an existing row found by its scope, record id
//! and generation, like the default layout's; an update that moves the row between partitions
//! is a delete and an insert in one transaction, which a snapshot sees as one row. An update that
//! meets a row a concurrent update just moved fails with a serialization failure (SQLSTATE
//! 40001); the store runs the statement again, which is safe since every update is a
//! compare-and-set.
//!
//! # Partitions
//!
//! [`PartitionedPostgresStore::sweep_expired`] creates the partitions of today and the next
//! [`days_ahead`](PartitionedPostgresStore::with_days_ahead) days, then detaches and drops every
//! partition whose day has ended. A write whose expiry falls on a day without a partition (a
//! retention longer than the days created ahead, a clock far off) creates that day's partition
//! and runs again, so a claim never fails for want of one. Creating attaches a new empty table
//! and detaching runs `DETACH PARTITION ... CONCURRENTLY`: both take only `SHARE UPDATE
//! EXCLUSIVE` on the parent, so claims go on. A concurrent detach waits for every transaction
//! that may still be using the partition, so a long transaction on the table delays the drop of
//! a day, never the claims; one interrupted half-way is finished by the next sweep. The rows are
//! then counted and the table dropped with no lock on the parent, at once or, with
//! [`with_drop_window`](PartitionedPostgresStore::with_drop_window), in the next off-peak
//! window (a detached day is invisible to claims while it waits). There is no default
//! partition: it would have to be scanned on every partition created, and a concurrent detach
//! refuses a table that has one.

use std::future::Future;

use async_trait::async_trait;
use chrono::NaiveDate;
use idempotency::{
    Claim, ClaimOutcome, ClaimRequest, Forget, ReclaimRequest, Record, RecordChanges, RecordId, RecordPage,
    RecordQuery, Renewal, Resolve, Scope, Store, StoreError, StoredResponse, Timestamp, stored_component,
};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};

mod days;

pub use days::DropWindow;

use crate::fenced::{FencedSql, bind_fence, bind_scope, fenced_sql};
use crate::postgres::{count_stored, decode_row};
use crate::row::{ClaimDidNotSettle, MAX_CLAIM_ATTEMPTS, SpaceWatch, db_error, fenced, stale_cutoff};
use days::{attached, day_of};

/// The partitioned table.
pub const PARTITIONED_TABLE: &str = "idempotency_records_by_day";

/// The default number of days after today whose partitions the sweeper creates ahead.
pub const DEFAULT_DAYS_AHEAD: u32 = 3;

/// Connections in a pool made by [`PartitionedPostgresStore::connect`].
const MAX_CONNECTIONS: u32 = 10;

/// The advisory lock (two-int form, this layout's namespace) that serialises partition
/// creation, detaching and dropping between replicas. The claim function uses the same first
/// number with a hash of the scope as the second; a collision with `0` only makes one claim wait
/// for one DDL transaction.
const LOCK_NAMESPACE: i32 = 1_229_144_399;

/// The partitioned layout's migrations (`migrations/postgres-partitioned/`), with a history
/// table of their own so they run beside [`crate::postgres_migrator`]'s.
pub const PARTITIONED_MIGRATIONS_TABLE: &str = "_idempotency_partitioned_migrations";

/// The partitioned layout's migrator: the table and the claim function, no partitions (the store
/// creates those).
pub fn postgres_partitioned_migrator() -> sqlx::migrate::Migrator {
    let mut m = crate::embedded_migrator(crate::embedded_migrations!(
        "migrations/postgres-partitioned",
        "20261201000001_records_by_day.sql",
        "20261202000001_record_id_index.sql",
        "20261210000001_claim_spares_live_claims.sql",
        "20261215000001_uncertain_state.sql",
    ))
    .expect("the file names are checked by a test");
    m.dangerous_set_table_name(PARTITIONED_MIGRATIONS_TABLE);
    m
}

/// An [`idempotency::Store`] in PostgreSQL whose records table is partitioned by expiry day, so
/// that [`Store::sweep_expired`] drops whole expired days (a catalog change and a file unlink)
/// instead of deleting rows one by one (a WAL record and a dead tuple each). See the module
/// docs for the design and [`crate::PostgresStore`] for the default layout.
///
/// The price: a key's partition is not known from the key, so every look-up probes each
/// partition's index (today, the days ahead, the days not yet swept), and a claim takes an
/// advisory lock. Use it when the retention's DELETE traffic (WAL, vacuum, replica lag) costs
/// more than that.
///
/// `sweep_expired`'s `batch` bounds nothing here: each call drops every partition whose day
/// has ended, whatever it holds, and returns the exact number of records they held.
#[derive(Debug, Clone)]
pub struct PartitionedPostgresStore {
    pool: PgPool,
    days_ahead: u32,
    drop_window: DropWindow,
    space: SpaceWatch,
    announcements: crate::changes::Announcements,
}

impl PartitionedPostgresStore {
    /// Connects to `url` with a pool of up to 10 connections ([`crate::postgres_pool_options`]).
    /// Does not create the table; call [`PartitionedPostgresStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool =
            crate::connect_postgres(url, crate::postgres_pool_options(MAX_CONNECTIONS)).await.map_err(db_error)?;
        Ok(Self::from_pool(pool))
    }

    /// Wraps an existing pool; creates partitions [`DEFAULT_DAYS_AHEAD`] days ahead.
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            days_ahead: DEFAULT_DAYS_AHEAD,
            drop_window: DropWindow::ANY_TIME,
            space: SpaceWatch::default(),
            announcements: crate::changes::Announcements::default(),
        }
    }

    /// Sends no announcement when a record leaves `in_flight` (it still listens for other
    /// processes' announcements). Waiters in other processes then find this store's changes
    /// by polling, with backoff. For a database where no request waits (`Prefer: wait`) and
    /// for measuring what the announcements cost; by default they are sent.
    pub fn without_announcements(mut self) -> Self {
        self.announcements = crate::changes::Announcements::never();
        self
    }

    /// Creates the partitions of the next `days` days ahead of today on every sweep (and
    /// migration). Make it at least the retention in days plus one, so that claims and
    /// completions find their partition ready; a missing one is created on demand, at the cost
    /// of a catalog change on that request's path.
    pub fn with_days_ahead(mut self, days: u32) -> Self {
        self.days_ahead = days;
        self
    }

    /// Drops detached days only within `window` (hours of the day, UTC); an ended day is still
    /// detached on the first sweep after it ends, so no claim sees it again, and its table waits
    /// for the window. Removing a day's files (hundreds of megabytes) holds up every commit's
    /// `fsync` on a file system that discards freed blocks online (ext4 or XFS mounted with
    /// `discard`): an off-peak window keeps that stall away from the claims of the busy hours.
    /// By default, any time.
    pub fn with_drop_window(mut self, window: DropWindow) -> Self {
        self.drop_window = window;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs the layout's migrations ([`postgres_partitioned_migrator`]) and creates the
    /// partitions of today and the days ahead; safe to call on every start, from several
    /// replicas at once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        postgres_partitioned_migrator().run(&self.pool).await.map_err(StoreError::unavailable)?;
        self.create_partitions_ahead(idempotency::now()).await
    }

    /// Creates the partitions of `now`'s day and the days ahead that do not exist yet.
    pub async fn create_partitions_ahead(&self, now: Timestamp) -> Result<(), StoreError> {
        let today = day_of(now);
        let days: Vec<NaiveDate> =
            (0..=u64::from(self.days_ahead)).filter_map(|d| today.checked_add_days(chrono::Days::new(d))).collect();
        self.ensure_partitions(&days).await
    }

    /// Creates the partition of `day` if it does not exist (for example to load records
    /// expiring on a day not created ahead).
    pub async fn create_partition(&self, day: NaiveDate) -> Result<(), StoreError> {
        self.ensure_partitions(&[day]).await
    }

    /// The days that have a partition now, oldest first.
    pub async fn partition_days(&self) -> Result<Vec<NaiveDate>, StoreError> {
        Ok(attached(&self.pool).await?.into_iter().collect())
    }

    /// Runs `op` until it settles: again after a serialization failure (it met a row a
    /// concurrent update moved to another partition), and once more after creating the
    /// partition of `expiry` when no partition took the row.
    async fn settle<T, F, Fut>(&self, expiry: Option<Timestamp>, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let mut created = false;
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if sqlstate(&e) == Some("40001") => continue,
                // check_violation: no partition for the row (or a CHECK constraint, which
                // fails again and is returned then).
                Err(e) if sqlstate(&e) == Some("23514") && !created && expiry.is_some() => {
                    let day = day_of(expiry.unwrap_or_else(idempotency::now));
                    self.ensure_partitions(&[day]).await?;
                    created = true;
                }
                Err(e) => return Err(self.space.db_error(e)),
            }
        }
        Err(StoreError::unavailable(ClaimDidNotSettle(MAX_CLAIM_ATTEMPTS)))
    }
}

fn sqlstate(e: &sqlx::Error) -> Option<&str> {
    match e {
        sqlx::Error::Database(d) => d.code().map(|c| match c {
            std::borrow::Cow::Borrowed(s) => s,
            // sqlx's PostgreSQL errors borrow their code; an owned one is never one of ours.
            std::borrow::Cow::Owned(_) => "",
        }),
        _ => None,
    }
}

const CLAIM: &str = "SELECT * FROM idempotency_claim_by_day($1, $2, $3, $4, $5, $6, $7, $8)";

/// The read and the fenced transitions, shared with the plain table.
const SQL: FencedSql = fenced_sql!("idempotency_records_by_day", record_columns);

/// The record of `scope` from a row of every column: the row holds the scope as stored
/// ([`stored_component`]: a long component shortened), the caller's record carries it whole.
fn decode_for(row: &PgRow, scope: &Scope) -> Result<Record, StoreError> {
    let mut record = decode_row(row)?;
    record.scope = scope.clone();
    Ok(record)
}

#[async_trait]
impl Store for PartitionedPostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let fresh = req.new_record();
        let pool = &self.pool;
        let (req_ref, id, expires_at) = (&req, fresh.record_id.as_bytes().as_slice(), fresh.expires_at);
        // NULL when no claim can be that old: `started_at <= NULL` is never true.
        let cutoff = stale_cutoff(req.now, req.in_flight_ttl);
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let row = self
                .settle(Some(expires_at), move || {
                    bind_scope(CLAIM, &req_ref.scope)
                        .bind(id)
                        .bind(req_ref.fingerprint.as_str())
                        .bind(req_ref.now)
                        .bind(expires_at)
                        .bind(cutoff)
                        .fetch_optional(pool)
                })
                .await?;
            // None: the expired record it meant to replace changed under it; look again.
            let Some(row) = row else { continue };
            let inserted: bool = row.try_get(14).map_err(|e| self.space.db_error(e))?;
            let record = decode_for(&row, &req.scope)?;
            return Ok(if inserted { self.space.owned(Claim::new(record)) } else { ClaimOutcome::Existing(record) });
        }
        Err(StoreError::unavailable(ClaimDidNotSettle(MAX_CLAIM_ATTEMPTS)))
    }

    async fn reclaim(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let expires_at = req.record_expires_at();
        let pool = &self.pool;
        // NULL when no claim can be that old: `started_at <= NULL` is never true.
        let cutoff = stale_cutoff(now, in_flight_ttl);
        let row = self
            .settle(Some(expires_at), move || {
                bind_fence(SQL.reclaim, record).bind(now).bind(cutoff).bind(expires_at).fetch_optional(pool)
            })
            .await?;
        row.map(|r| decode_for(&r, &record.scope).map(Claim::new)).transpose()
    }

    async fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<(), StoreError> {
        let (pool, r) = (&self.pool, claim.record());
        let headers = response.headers_json();
        let headers = headers.as_str();
        let done = self
            .settle(Some(expires_at), move || {
                bind_fence(SQL.complete, r)
                    .bind(i32::from(response.status))
                    .bind(headers)
                    .bind(response.body.stored_bytes().as_ref())
                    .bind(response.body.encoding().as_str())
                    .bind(expires_at)
                    .execute(pool)
            })
            .await?;
        self.space.wrote();
        fenced(done.rows_affected(), claim)?;
        self.announcements.announce(&self.pool, &r.scope);
        Ok(())
    }

    async fn fail(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced_write(SQL.fail, claim).await?;
        self.announcements.announce(&self.pool, &claim.record().scope);
        Ok(())
    }

    async fn mark_uncertain(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced_write(SQL.mark_uncertain, claim).await?;
        self.announcements.announce(&self.pool, &claim.record().scope);
        Ok(())
    }

    /// Moves the row to another day's partition when the retention asked for ends on a later day.
    async fn mark_stale_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Record>, StoreError> {
        let ReclaimRequest { record, now, in_flight_ttl, .. } = req;
        let expires_at = req.record_expires_at();
        let pool = &self.pool;
        // NULL when no claim can be that old: `started_at <= NULL` is never true.
        let cutoff = stale_cutoff(now, in_flight_ttl);
        let row = self
            .settle(Some(expires_at), move || {
                bind_fence(SQL.mark_stale_uncertain, record).bind(cutoff).bind(expires_at).fetch_optional(pool)
            })
            .await?;
        let Some(row) = row else { return Ok(None) };
        let marked = decode_for(&row, &record.scope)?;
        self.announcements.announce(&self.pool, &record.scope);
        Ok(Some(marked))
    }

    async fn take_over_uncertain(&self, req: ReclaimRequest<'_>) -> Result<Option<Claim>, StoreError> {
        let ReclaimRequest { record, now, .. } = req;
        let expires_at = req.record_expires_at();
        let pool = &self.pool;
        let row = self
            .settle(Some(expires_at), move || {
                bind_fence(SQL.take_over_uncertain, record).bind(now).bind(expires_at).fetch_optional(pool)
            })
            .await?;
        row.map(|r| decode_for(&r, &record.scope).map(Claim::new)).transpose()
    }

    /// Moves the row to another day's partition when the renewed expiry falls on a later day.
    async fn heartbeat(&self, claim: &Claim, renewal: Renewal) -> Result<(), StoreError> {
        let (pool, r) = (&self.pool, claim.record());
        let expires_at = renewal.record_expires_at();
        let done = self
            .settle(Some(expires_at), move || {
                bind_fence(SQL.heartbeat, r).bind(renewal.now).bind(expires_at).execute(pool)
            })
            .await?;
        fenced(done.rows_affected(), claim)
    }

    async fn remove(&self, claim: &Claim) -> Result<(), StoreError> {
        self.fenced_write(SQL.remove, claim).await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        let row = bind_scope(SQL.select, scope).fetch_optional(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        row.map(|r| decode_for(&r, scope)).transpose()
    }

    /// Creates the partitions ahead, then drops every partition whose day ended by `now`
    /// (`batch` does not apply: a whole day goes at once). Returns the exact number of records
    /// dropped. Records that expired earlier today stay on disk until their day ends; claims
    /// treat them as absent meanwhile.
    async fn sweep_expired(&self, now: Timestamp, _batch: u32) -> Result<u64, StoreError> {
        self.create_partitions_ahead(now).await?;
        self.drop_expired_partitions(now).await
    }

    /// Not ready either while a recent write was refused for lack of space and none succeeded
    /// since: a full database still answers a read.
    async fn ping(&self) -> Result<(), StoreError> {
        self.space.check()?;
        sqlx::query("SELECT 1").execute(&self.pool).await.map_err(|e| self.space.db_error(e))?;
        Ok(())
    }

    /// As [`crate::PostgresStore`] counts, on this layout's table.
    async fn count_records(
        &self,
        principal: &idempotency::Principal,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        const COUNT: &str = "SELECT count(*) FROM idempotency_records_by_day \
                             WHERE principal = $1 AND expires_at > $2 AND state <> 'failed'";
        count_stored(&self.pool, &self.space, COUNT, principal, now).await
    }

    async fn list_records(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        self.admin_list(query).await
    }

    async fn get_by_id(&self, id: &RecordId) -> Result<Option<Record>, StoreError> {
        self.admin_get_by_id(id).await
    }

    /// Listens for the announcements of [`crate::CHANGES_CHANNEL`] on one connection of the
    /// pool's, as [`crate::PostgresStore`] does.
    fn changes(&self) -> Option<std::sync::Arc<RecordChanges>> {
        self.announcements.changes(&self.pool)
    }

    /// Announced like `complete`, so that other processes drop their copies of the record.
    async fn forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        let forgot = self.admin_forget(id).await?;
        if let Forget::Forgotten(r) = &forgot {
            self.announcements.announce(&self.pool, &r.scope);
        }
        Ok(forgot)
    }

    /// Creates the partition of `expires_at`'s day first when it is missing: the row moves there.
    async fn resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        self.ensure_partitions(&[day_of(expires_at)]).await?;
        let resolved = self.admin_resolve(id, response, expires_at).await?;
        if let Resolve::Resolved(r) = &resolved {
            self.space.wrote();
            self.announcements.announce(&self.pool, &r.scope);
        }
        Ok(resolved)
    }
}

crate::admin::admin_methods!(
    PartitionedPostgresStore,
    crate::admin::partitioned,
    decode_row,
    |t: Timestamp| t,
    stored_component
);

impl PartitionedPostgresStore {
    /// `fail` and `remove`: fenced by the claim's generation; neither moves a row.
    async fn fenced_write(&self, sql: &'static str, claim: &Claim) -> Result<(), StoreError> {
        let (pool, r) = (&self.pool, claim.record());
        let done = self.settle(None, move || bind_fence(sql, r).execute(pool)).await?;
        fenced(done.rows_affected(), claim)
    }
}
