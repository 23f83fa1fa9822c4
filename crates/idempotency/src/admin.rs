//! What an operator asks a store: records a page at a time, one record by its id, forgetting
//! a record and resolving an uncertain one (the [`Store`](crate::Store) methods `list_records`,
//! `get_by_id`, `forget` and `resolve`).

use crate::{Principal, Record, RecordId, RecordState, Timestamp};

/// The most records one page may hold; a larger `limit` is lowered to it.
pub const MAX_PAGE: u32 = 1000;

/// Which records to list, and where the page starts.
#[derive(Debug, Clone)]
pub struct RecordQuery {
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only records of this principal.
    pub principal: Option<Principal>,
    /// Only records whose current attempt started at or before this time (`started_at <= t`):
    /// an in-flight record that old has not been renewed since, so its attempt is stuck.
    pub started_before: Option<Timestamp>,
    /// The current time: records that have expired by then (`expires_at <= now`) are not listed.
    pub now: Timestamp,
    /// At most this many records (1 to [`MAX_PAGE`]).
    pub limit: u32,
    /// Where to continue: the `next_cursor` of the previous page. Opaque, and only meaningful to
    /// the store that made it.
    pub cursor: Option<String>,
}

impl RecordQuery {
    /// Every live record at `now`, from the first page, `limit` at a time.
    pub fn all(now: Timestamp, limit: u32) -> Self {
        Self { state: None, principal: None, started_before: None, now, limit, cursor: None }
    }

    /// The page size to use: `limit` within 1..=[`MAX_PAGE`].
    pub fn page_size(&self) -> usize {
        self.limit.clamp(1, MAX_PAGE) as usize
    }

    /// True when `record` matches the filters (state, principal, age, not expired). A record
    /// read back from a store that keeps a long principal shortened
    /// ([`stored_component`](crate::stored_component)) matches its principal too.
    pub fn matches(&self, record: &Record) -> bool {
        let principal = record.scope.principal.as_str();
        !record.is_expired(self.now)
            && self.state.is_none_or(|s| record.state == s)
            && self
                .principal
                .as_ref()
                .is_none_or(|p| principal == p.as_str() || principal == crate::stored_component(p.as_str()))
            && self.started_before.is_none_or(|t| record.started_at <= t)
    }

    /// The record id after which this page starts, for stores whose cursor is the last record
    /// id of the previous page (32 hex digits); [`StoreError::InvalidCursor`] for anything else.
    ///
    /// [`StoreError::InvalidCursor`]: crate::StoreError::InvalidCursor
    pub fn cursor_record_id(&self) -> Result<Option<RecordId>, crate::StoreError> {
        match &self.cursor {
            None => Ok(None),
            Some(c) => RecordId::from_hex(c).map(Some).ok_or(crate::StoreError::InvalidCursor),
        }
    }
}

/// One page of records, in the store's order (by record id in the SQL and in-memory stores).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordPage {
    /// The records.
    pub records: Vec<Record>,
    /// Where the next page starts; `None` on the last page.
    pub next_cursor: Option<String>,
}

impl RecordPage {
    /// A page of at most `page_size` of `sorted` (records after the cursor, in order, with one
    /// more than the page when there is one), its cursor the last record's id when more follow.
    pub fn from_sorted(mut sorted: Vec<Record>, page_size: usize) -> Self {
        let more = sorted.len() > page_size;
        sorted.truncate(page_size);
        let next_cursor = if more { sorted.last().map(|r| r.record_id.to_hex()) } else { None };
        Self { records: sorted, next_cursor }
    }
}

/// What [`Store::forget`](crate::Store::forget) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forget {
    /// The record (completed, failed or uncertain) was deleted; here it is as it was. The next
    /// request with its key runs as a new operation.
    Forgotten(Record),
    /// The record is in flight: nothing was deleted.
    InFlight(Record),
    /// No record has this id.
    Absent,
}

/// What [`Store::resolve`](crate::Store::resolve) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolve {
    /// The record was uncertain and is now completed with the response given; here it is as
    /// stored. Every retry with its key replays that response.
    Resolved(Record),
    /// The record is not uncertain (in flight, completed or failed): nothing was written. Here it
    /// is as it stands, its state saying why.
    NotUncertain(Record),
    /// No record has this id.
    Absent,
}
