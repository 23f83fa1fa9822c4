//! Idempotency records as the admin API shows them (docs/protocol.md#operating-it): `GET /admin/v1/records` and
//! `GET /admin/v1/records/{id}`.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::RecordId;

open_enum!(
    /// Where an idempotency record is (docs/protocol.md#records). A state this side does not
    /// know yet is kept as [`RecordState::Other`], so a newer server's records still parse.
    RecordState {
        /// An attempt holds the key; its outcome is not stored yet.
        InFlight = "in_flight",
        /// The attempt failed; a retry runs the request again.
        Failed = "failed",
        /// The response is stored and replayed.
        Completed = "completed",
        /// The request was sent on and what came of it is unknown: held, probed or resent.
        Uncertain = "uncertain",
    }
);

/// A record as the admin API shows it.
// The schema keeps the service's first names (`AdminRecord`, `RecordList`), which its
// `/openapi.json` has always used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = AdminRecord))]
pub struct Record {
    /// The record id: 32 hex digits.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub id: RecordId,
    /// Whose request it was.
    pub principal: String,
    /// Method and path, e.g. `POST /v1/workers`.
    pub endpoint: String,
    /// The request's `Idempotency-Key`.
    pub key: String,
    /// `in_flight`, `completed`, `failed` or `uncertain` (sent on, outcome unknown).
    pub state: RecordState,
    /// `sha256:<hex>` of the request.
    pub fingerprint: String,
    /// The stored response's status, when completed.
    pub response_status: Option<u16>,
    /// RFC 3339.
    #[serde(with = "crate::time::micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub created_at: DateTime<Utc>,
    /// RFC 3339: when the current attempt started (renewed while it runs).
    #[serde(with = "crate::time::micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub started_at: DateTime<Utc>,
    /// RFC 3339: when the key is free again.
    #[serde(with = "crate::time::micros")]
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub expires_at: DateTime<Utc>,
    /// The stored response body (only with `?body=true`, and only when completed): the text when
    /// it is UTF-8, else its bytes in hex (see `response_body_encoding`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub response_body: Option<String>,
    /// `utf-8` or `hex`: how `response_body` holds the body (only beside it).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub response_body_encoding: Option<String>,
}

/// `GET /admin/v1/records` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = RecordList))]
pub struct RecordPage {
    /// This page.
    pub records: Vec<Record>,
    /// Pass as `cursor` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page as the service writes it (`GET /admin/v1/records`): the first record completed and
    /// read with `?body=true`, the second in flight.
    const PAGE: &str = concat!(
        r#"{"records":[{"id":"0123456789abcdef0123456789abcdef","principal":"tenant-a","#,
        r#""endpoint":"POST /v1/workers","key":"k-1","state":"completed","fingerprint":"sha256:00ff","#,
        r#""response_status":201,"created_at":"2026-11-30T22:14:07.123456Z","#,
        r#""started_at":"2026-11-30T22:14:07.123456Z","expires_at":"2026-12-01T22:14:07.000000Z","#,
        r#""response_body":"{\"id\":\"wkr-1\"}","response_body_encoding":"utf-8"},"#,
        r#"{"id":"fedcba9876543210fedcba9876543210","principal":"admin","#,
        r#""endpoint":"POST /admin/v1/nodes/node-0003/firmware","key":"k-2","state":"in_flight","#,
        r#""fingerprint":"sha256:ab","response_status":null,"created_at":"2026-11-30T22:15:00.000000Z","#,
        r#""started_at":"2026-11-30T22:16:00.500000Z","expires_at":"2026-12-01T22:15:00.000000Z"}],"#,
        r#""next_cursor":"c-2"}"#
    );

    #[test]
    fn a_record_page_round_trips_byte_for_byte() {
        let page: RecordPage = serde_json::from_str(PAGE).unwrap();
        let [done, running] = &page.records[..] else { panic!("two records: {page:?}") };
        assert_eq!(done.id.as_str(), "0123456789abcdef0123456789abcdef");
        assert_eq!((done.response_status, done.response_body_encoding.as_deref()), (Some(201), Some("utf-8")));
        assert_eq!(done.created_at.timestamp_subsec_micros(), 123_456);
        assert_eq!((running.response_status, running.response_body.as_deref()), (None, None));
        assert_eq!(page.next_cursor.as_deref(), Some("c-2"));
        assert_eq!(serde_json::to_string(&page).unwrap(), PAGE);
    }

    #[test]
    fn a_record_without_body_fields_omits_them_and_a_bad_time_is_refused() {
        let mut body: serde_json::Value = serde_json::from_str(PAGE).unwrap();
        let running: Record = serde_json::from_value(body["records"][1].clone()).unwrap();
        let written = serde_json::to_value(&running).unwrap();
        assert!(written.get("response_body").is_none() && written.get("response_body_encoding").is_none());
        assert!(written["response_status"].is_null(), "response_status is always written: {written}");
        body["records"][1]["started_at"] = "2026-11-30T23:16:00.5+01:00".into();
        let shifted: Record = serde_json::from_value(body["records"][1].clone()).unwrap();
        assert_eq!(shifted.started_at, running.started_at);
        body["records"][1]["started_at"] = "x".into();
        assert!(serde_json::from_value::<Record>(body["records"][1].clone()).is_err());
    }
}
