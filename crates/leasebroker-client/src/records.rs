//! The admin records API (docs/protocol.md#operating-it): idempotency records as an operator sees them. The record and
//! its page are `leasebroker-api`'s; the filter is the SDK's way to ask for a page.

pub use crate::types::{InvalidRecordId, Record, RecordId, RecordPage, RecordState};

/// Which records to list: each filter as the server takes it (it checks them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordFilter {
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only this principal's records.
    pub principal: Option<String>,
    /// Only records whose current attempt started at least this long ago (`10m`, `2h`).
    pub older_than: Option<String>,
    /// Page size (server default 100).
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}
