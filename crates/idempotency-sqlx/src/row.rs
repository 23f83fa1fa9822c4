//! What both backends share: the column list, row decoding and error mapping.

use std::time::Duration;

use bytes::Bytes;
use chrono::SubsecRound;
use idempotency::{
    BodyEncoding, Fingerprint, Record, RecordId, RecordState, Scope, StoreError, StoredBody, StoredResponse, Timestamp,
};
use idempotency::{Endpoint, IdempotencyKey, Principal};

/// The record's columns, in the order [`RawRecord`] reads them. A macro so that SQL strings can
/// be built with `concat!` and stay `&'static str`.
macro_rules! record_columns {
    () => {
        concat!("principal, endpoint, key, ", $crate::row::state_columns!())
    };
}
pub(crate) use record_columns;

/// The record's columns after its scope, in the order [`RawState`] reads them: what a statement
/// returns when the caller already knows the scope it asked about (the PostgreSQL store, where
/// every statement names the row by its scope), so the row carries no copy of it back.
macro_rules! state_columns {
    () => {
        "record_id, fingerprint, state, generation, response_status, response_headers, response_body, \
         response_encoding, created_at, started_at, expires_at"
    };
}
pub(crate) use state_columns;

/// A row as the database returned it, before validation, borrowed from the row: the scope, and
/// the columns of [`state_columns!`].
pub(crate) struct RawRecord<'r> {
    pub principal: &'r str,
    pub endpoint: &'r str,
    pub key: &'r str,
    pub rest: RawState<'r>,
}

/// The columns of [`state_columns!`] as the database returned them, before validation, borrowed
/// from the row.
pub(crate) struct RawState<'r> {
    pub record_id: &'r [u8],
    pub fingerprint: &'r str,
    pub state: &'r str,
    pub generation: i64,
    pub response_status: Option<i32>,
    pub response_headers: Option<&'r str>,
    pub response_body: Option<&'r [u8]>,
    pub response_encoding: Option<&'r str>,
    pub created_at: Timestamp,
    pub started_at: Timestamp,
    pub expires_at: Timestamp,
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

impl<'r> RawState<'r> {
    /// The columns of [`state_columns!`] from `row`, the first at `at`, its timestamps read by
    /// `time`.
    pub(crate) fn read<R>(
        row: &'r R,
        at: usize,
        time: impl Fn(&'r R, usize) -> Result<Timestamp, StoreError>,
    ) -> Result<Self, StoreError>
    where
        R: sqlx::Row,
        usize: sqlx::ColumnIndex<R>,
        &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        &'r [u8]: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        Ok(RawState {
            record_id: row.try_get(at).map_err(db_error)?,
            fingerprint: row.try_get(at + 1).map_err(db_error)?,
            state: row.try_get(at + 2).map_err(db_error)?,
            generation: row.try_get(at + 3).map_err(db_error)?,
            response_status: row.try_get(at + 4).map_err(db_error)?,
            response_headers: row.try_get(at + 5).map_err(db_error)?,
            response_body: row.try_get(at + 6).map_err(db_error)?,
            response_encoding: row.try_get(at + 7).map_err(db_error)?,
            created_at: time(row, at + 8)?,
            started_at: time(row, at + 9)?,
            expires_at: time(row, at + 10)?,
        })
    }
}

impl RawRecord<'_> {
    /// Validates the row into a [`Record`]; anything unexpected is [`StoreError::Corrupt`].
    pub(crate) fn into_record(self) -> Result<Record, StoreError> {
        let key = IdempotencyKey::try_from(self.key).map_err(|e| corrupt(format!("stored key: {e}")))?;
        let scope = Scope::new(Principal::new(self.principal), Endpoint::from_stored(self.endpoint), key);
        self.rest.into_record(scope)
    }
}

impl RawState<'_> {
    /// Validates the row into the [`Record`] of `scope`; anything unexpected is
    /// [`StoreError::Corrupt`].
    pub(crate) fn into_record(self, scope: Scope) -> Result<Record, StoreError> {
        let record_id = <[u8; 16]>::try_from(self.record_id)
            .map(RecordId::from_bytes)
            .map_err(|_| corrupt(format!("record id of {} bytes", self.record_id.len())))?;
        let state =
            RecordState::from_stored(self.state).ok_or_else(|| corrupt(format!("unknown state {:?}", self.state)))?;
        let response = match (self.response_status, self.response_headers, self.response_body, self.response_encoding) {
            (None, None, None, None) => None,
            (Some(status), Some(headers), Some(body), Some(encoding)) => {
                let status = u16::try_from(status).map_err(|_| corrupt(format!("response status {status}")))?;
                let headers = StoredResponse::headers_from_json(headers)
                    .map_err(|e| corrupt(format!("response headers: {e}")))?;
                let encoding = BodyEncoding::from_stored(encoding)
                    .ok_or_else(|| corrupt(format!("unknown body encoding {encoding:?}")))?;
                Some(StoredResponse {
                    status,
                    headers,
                    body: StoredBody::from_stored(encoding, Bytes::copy_from_slice(body)),
                })
            }
            _ => return Err(corrupt("a response stored in part")),
        };
        state.check_response(response.as_ref()).map_err(corrupt)?;
        Ok(Record {
            scope,
            record_id,
            fingerprint: Fingerprint::from_stored(self.fingerprint),
            state,
            generation: self.generation,
            response,
            created_at: self.created_at,
            started_at: self.started_at,
            expires_at: self.expires_at,
        })
    }
}

/// The latest `started_at` at which an in-flight claim is stale at `now`
/// (`started_at + ttl <= now`), floored to the microsecond that stores keep; `None` when no
/// representable claim can be that old.
pub(crate) fn stale_cutoff(now: Timestamp, ttl: Duration) -> Option<Timestamp> {
    let ttl = chrono::Duration::from_std(ttl).ok()?;
    // trunc_subsecs floors: a stored started_at (whole microseconds) is <= the exact cutoff
    // exactly when it is <= the cutoff floored to a microsecond.
    now.checked_sub_signed(ttl).map(|c| c.trunc_subsecs(6))
}

/// Maps a database error: a value that cannot be decoded is corruption, anything else means the
/// store is unavailable.
pub(crate) fn db_error(e: sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. } => StoreError::Corrupt(e.to_string()),
        e => StoreError::unavailable(e),
    }
}

/// How long a write refused for lack of space keeps the store not ready when no write succeeds
/// after it (as the Redis store does for `OOM`): a write that finds space (another process freed
/// some, a sweep deleted records) makes it ready at once.
pub(crate) const SPACE_REMEMBERED: Duration = Duration::from_secs(30);

/// Remembers the last write the database refused for lack of space (SQLite `SQLITE_FULL`,
/// PostgreSQL `53100 disk_full`), so that [`idempotency::Store::ping`] (readiness) reports it:
/// a full database still answers `SELECT 1`. Shared by the clones of one store.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpaceWatch(std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl SpaceWatch {
    /// [`db_error`], noting a refusal for space.
    pub(crate) fn db_error(&self, e: sqlx::Error) -> StoreError {
        if refused_for_space(&e) {
            tracing::warn!("the database refused a write for lack of space; the store reports not ready");
            *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        }
        db_error(e)
    }

    /// A claim that inserted its record: there is space again.
    pub(crate) fn owned(&self, claim: idempotency::Claim) -> idempotency::ClaimOutcome {
        self.wrote();
        idempotency::ClaimOutcome::Owned(claim)
    }

    /// A write succeeded: there is space again.
    pub(crate) fn wrote(&self) {
        let mut at = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if at.take().is_some() {
            tracing::info!("the database takes writes again");
        }
    }

    /// `Err` while a recent write was refused for space and none succeeded since.
    pub(crate) fn check(&self) -> Result<(), StoreError> {
        let at = *self.0.lock().unwrap_or_else(|p| p.into_inner());
        match at {
            Some(at) if at.elapsed() < SPACE_REMEMBERED => Err(StoreError::unavailable(OutOfSpace)),
            _ => Ok(()),
        }
    }
}

/// Whether the database refused a write for lack of space, by its result code (SQLite) or
/// SQLSTATE (PostgreSQL), never by its text.
fn refused_for_space(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else { return false };
    let Some(code) = db.code() else { return false };
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // SQLITE_FULL, and any extended code of it.
        return code.parse::<u32>().is_ok_and(|c| c & 0xff == 13);
    }
    #[cfg(feature = "postgres")]
    if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() {
        return code == "53100";
    }
    false
}

/// The database refused a write for lack of space.
#[derive(Debug, thiserror::Error)]
#[error("the database refused a write for lack of space")]
pub(crate) struct OutOfSpace;

/// A claim that kept racing with concurrent writers and never settled.
#[derive(Debug, thiserror::Error)]
#[error("the claim did not settle after {0} attempts under concurrent writes")]
pub(crate) struct ClaimDidNotSettle(pub u32);

#[cfg(feature = "postgres")]
/// How often a claim re-runs when the row changed under it. Each retry follows a concurrent
/// commit on the same key, so a handful suffices; the bound keeps a pathological loop finite.
pub(crate) const MAX_CLAIM_ATTEMPTS: u32 = 8;

/// The outcome of a fenced `complete`/`fail`: one row changed, or the claim is no longer current.
pub(crate) fn fenced(rows: u64, claim: &idempotency::Claim) -> Result<(), StoreError> {
    if rows == 1 { Ok(()) } else { Err(StoreError::Fenced { generation: claim.generation() }) }
}
