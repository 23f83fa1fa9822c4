//! The admin records API's shapes (SPEC 7): idempotency records as an operator sees them.

use serde::{Deserialize, Serialize};

pub use crate::types::{InvalidRecordId, RecordId};

/// An idempotency record (`GET /admin/v1/records/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The record id.
    pub id: RecordId,
    /// Whose request it was.
    pub principal: String,
    /// Method and path, e.g. `POST /v1/workers`.
    pub endpoint: String,
    /// The request's `Idempotency-Key`.
    pub key: String,
    /// `in_flight`, `completed` or `failed`.
    pub state: String,
    /// `sha256:<hex>` of the request.
    pub fingerprint: String,
    /// The stored response's status, when completed.
    pub response_status: Option<u16>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339: when the current attempt started.
    pub started_at: String,
    /// RFC 3339: when the key is free again.
    pub expires_at: String,
    /// The stored response body, when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_body: Option<String>,
    /// `utf-8` or `hex`: how `response_body` holds the body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_body_encoding: Option<String>,
}

/// A page of records (`GET /admin/v1/records`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordPage {
    /// This page.
    pub records: Vec<Record>,
    /// Pass as [`RecordFilter::cursor`] for the next page; `None` on the last.
    pub next_cursor: Option<String>,
}

/// Which records to list: each filter as the server takes it (it checks them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordFilter {
    /// `in_flight`, `failed` or `completed`.
    pub state: Option<String>,
    /// Only this principal's records.
    pub principal: Option<String>,
    /// Only records whose current attempt started at least this long ago (`10m`, `2h`).
    pub older_than: Option<String>,
    /// Page size (server default 100).
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}
