//! The admin records API (docs/protocol.md#operating-it): list, read and forget idempotency records.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use idempotency::{
    ErrorChain, Forget, Principal, Record as StoredRecord, RecordId, RecordQuery, RecordState, StoreError,
};
use idempotency_tower::{IdempotencyContext, Problem};
use leasebroker_api::problems;
pub use leasebroker_api::{Record, RecordPage};
use serde::Deserialize;

use super::*;
use crate::audit::AuditEntry;

/// A stored record as the admin API shows it, with its response body when `body`.
pub fn admin_record(r: &StoredRecord, body: bool) -> Record {
    let (response_body, response_body_encoding) = match (&r.response, body) {
        (Some(resp), true) => match resp.body.decode() {
            Ok(bytes) => match std::str::from_utf8(&bytes) {
                Ok(text) => (Some(text.to_owned()), Some("utf-8".to_owned())),
                Err(_) => (Some(hex::encode(&bytes)), Some("hex".to_owned())),
            },
            Err(e) => {
                tracing::warn!(error = %e, record_id = %r.record_id.to_hex(), "a stored body does not decode");
                (None, None)
            }
        },
        _ => (None, None),
    };
    Record {
        id: leasebroker_api::RecordId::from_bytes(r.record_id.as_bytes()),
        principal: r.scope.principal.as_str().to_owned(),
        endpoint: r.scope.endpoint.as_str().to_owned(),
        key: r.scope.key.as_str().to_owned(),
        state: r.state.as_str().to_owned().into(),
        fingerprint: r.fingerprint.as_str().to_owned(),
        response_status: r.response.as_ref().map(|resp| resp.status),
        created_at: r.created_at,
        started_at: r.started_at,
        expires_at: r.expires_at,
        response_body,
        response_body_encoding,
    }
}

/// `GET /admin/v1/records` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RecordsQuery {
    /// `in_flight`, `failed`, `completed` or `uncertain`.
    pub state: Option<String>,
    /// Only this principal's records.
    pub principal: Option<String>,
    /// Only records whose current attempt started at least this long ago (`90s`, `10m`, `2h`,
    /// `7d`): with `state=in_flight`, the attempts that are stuck.
    pub older_than: Option<String>,
    /// Page size, 1-500 (default 100).
    #[param(minimum = 1, maximum = 500, default = 100)]
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// `GET /admin/v1/records/{id}` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RecordQueryParams {
    /// `true`: include the stored response body.
    pub body: Option<String>,
}

/// `400 invalid-query` with `detail`.
pub fn invalid_query(detail: &str) -> Response {
    Problem::new(StatusCode::BAD_REQUEST, problems::INVALID_QUERY, "Invalid query", detail.to_owned()).into_response()
}

/// `404 not-found`: no such record.
pub fn no_such_record() -> Response {
    Problem::new(StatusCode::NOT_FOUND, problems::NOT_FOUND, "No such record", "no such record").into_response()
}

/// The answer to a store error: `400` for a cursor the store refuses, else `503 store-unavailable`.
pub fn store_error(e: StoreError) -> Response {
    if matches!(e, StoreError::InvalidCursor) {
        return invalid_query("cursor is not a cursor this service gave out");
    }
    tracing::warn!(error = %ErrorChain(&e), "idempotency store unavailable (admin records)");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        idempotency::problems::STORE_UNAVAILABLE,
        "Idempotency store unavailable",
        "the record store did not answer; retry",
    )
    .with_retry_after(1)
    .into_response()
}

/// The record id in a path: 32 lowercase hex digits, else none (a 404 like an unknown id).
pub fn record_id(id: &str) -> Option<RecordId> {
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| RecordId::from_hex(id))
        .flatten()
}

/// Turns the query into a store query at `now`, or the detail of the 400 to answer.
pub fn record_query(q: RecordsQuery, now: idempotency::Timestamp) -> Result<RecordQuery, String> {
    let state = match q.state.as_deref() {
        None => None,
        Some(s) => Some(
            RecordState::from_stored(s)
                .ok_or_else(|| "state must be in_flight, failed, completed or uncertain".to_owned())?,
        ),
    };
    let principal = match q.principal {
        Some(p) if p.is_empty() || p.len() > 256 => return Err("principal must be 1 to 256 bytes".to_owned()),
        p => p.map(Principal::new),
    };
    let started_before = match q.older_than.as_deref() {
        None => None,
        Some(d) => {
            let d: Duration = humantime::parse_duration(d)
                .map_err(|_| "older_than must be a duration such as 90s, 10m, 2h or 7d".to_owned())?;
            let d = chrono::Duration::from_std(d).map_err(|_| "older_than is too long".to_owned())?;
            Some(now.checked_sub_signed(d).ok_or_else(|| "older_than is too long".to_owned())?)
        }
    };
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(format!("limit must be 1 to {MAX_PAGE}"));
    }
    if q.cursor.as_ref().is_some_and(|c| c.is_empty() || c.len() > 512) {
        return Err("cursor is not a cursor this service gave out".to_owned());
    }
    Ok(RecordQuery { state, principal, started_before, now, limit, cursor: q.cursor })
}

/// Lists idempotency records, a page at a time.
#[utoipa::path(get, path = "/admin/v1/records", tag = "admin", params(RecordsQuery),
    responses((status = 200, body = RecordPage), (status = 400, description = "A bad filter, limit or cursor"),
              (status = 401, description = "Unauthorized (tenants too)"),
              (status = 503, description = "The record store is unavailable")),
    security(("bearer" = [])))]
pub async fn list_records(
    State(state): State<AppState>,
    query: Result<Query<RecordsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    list_page(state.store.as_ref(), query).await
}

/// `GET /admin/v1/records` on `store`: the records API of any service over an idempotency store
/// (leasebroker's and the gateway's admin listener).
pub async fn list_page(
    store: &dyn idempotency::Store,
    query: Result<Query<RecordsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else { return invalid_query("limit must be a number") };
    let query = match record_query(q, idempotency::now()) {
        Ok(q) => q,
        Err(detail) => return invalid_query(&detail),
    };
    match store.list_records(&query).await {
        Ok(page) => Json(RecordPage {
            records: page.records.iter().map(|r| admin_record(r, false)).collect(),
            next_cursor: page.next_cursor,
        })
        .into_response(),
        Err(e) => store_error(e),
    }
}

/// Reads one idempotency record; its stored response body with `?body=true`.
#[utoipa::path(get, path = "/admin/v1/records/{id}", tag = "admin",
    params(("id" = String, Path, description = "Record id (32 hex digits)"), RecordQueryParams),
    responses((status = 200, body = Record), (status = 400, description = "body is not true or false"),
              (status = 401, description = "Unauthorized (tenants too)"), (status = 404, description = "No such record"),
              (status = 503, description = "The record store is unavailable")),
    security(("bearer" = [])))]
pub async fn get_record(
    State(state): State<AppState>,
    Path(id): Path<String>,
    query: Result<Query<RecordQueryParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    read_record(state.store.as_ref(), &id, query).await
}

/// `GET /admin/v1/records/{id}` on `store` (see [`list_page`]).
pub async fn read_record(
    store: &dyn idempotency::Store,
    id: &str,
    query: Result<Query<RecordQueryParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else { return invalid_query("body must be true or false") };
    let body = match q.body.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return invalid_query("body must be true or false"),
    };
    let Some(id) = record_id(id) else { return no_such_record() };
    match store.get_by_id(&id).await {
        Ok(Some(r)) if !r.is_expired(idempotency::now()) => Json(admin_record(&r, body)).into_response(),
        Ok(_) => no_such_record(),
        Err(e) => store_error(e),
    }
}

/// Forgets a completed or failed record: its key's next request runs as a new operation.
#[utoipa::path(delete, path = "/admin/v1/records/{id}", tag = "admin",
    params(("id" = String, Path, description = "Record id (32 hex digits)"),
           ("Idempotency-Key" = String, Header, description = "One key per logical operation")),
    responses((status = 204, description = "Forgotten (replayed on every retry); an audit line and row were written"),
              (status = 401, description = "Unauthorized (tenants too)"), (status = 404, description = "No such record"),
              (status = 409, description = "The record is in flight (record-in-flight), or the key was reused or is in progress",
               content_type = "application/problem+json"),
              (status = 503, description = "The record store is unavailable")),
    security(("bearer" = [])))]
pub async fn forget_record(
    State(state): State<AppState>,
    Extension(actor): Extension<Principal>,
    ctx: IdempotencyContext,
    Path(id): Path<String>,
) -> Response {
    match forget(&state, &actor, Some(ctx.key().as_str()), &id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(ForgetError::InFlight) => Problem::new(
            StatusCode::CONFLICT,
            problems::RECORD_IN_FLIGHT,
            "Record in flight",
            "the record's request is still running; wait for it to complete or fail (or for --in-flight-ttl)",
        )
        .into_response(),
        Err(ForgetError::NotFound) => no_such_record(),
        Err(ForgetError::Store(e)) => store_error(e),
    }
}

/// Why a record was not forgotten.
#[derive(Debug, thiserror::Error)]
pub enum ForgetError {
    /// No record has that id (or the id is not 32 lowercase hex digits).
    #[error("no such record")]
    NotFound,
    /// The record's request is still running: it is never forgotten.
    #[error("the record is in flight")]
    InFlight,
    /// The record store failed.
    #[error("the record store failed")]
    Store(#[source] StoreError),
}

/// Forgets the completed or failed record `id` on behalf of `actor` (whose request, if keyed,
/// had `request_key`), and writes the audit line and row: what `DELETE /admin/v1/records/{id}`
/// and the console's forget button both do. Returns the audit entry written.
pub async fn forget(
    state: &AppState,
    actor: &Principal,
    request_key: Option<&str>,
    id: &str,
) -> Result<AuditEntry, ForgetError> {
    let id = record_id(id).ok_or(ForgetError::NotFound)?;
    match state.store.forget(&id).await.map_err(ForgetError::Store)? {
        Forget::Forgotten(record) => {
            let entry = AuditEntry::forget(actor.as_str(), request_key, &record);
            if let Err(e) = state.audit.record(&entry).await {
                // The record is gone and the log has the audit line; a retry would find nothing
                // to forget, so the answer stays a success.
                tracing::error!(error = %ErrorChain(&e), record_id = %entry.record_id, "cannot write the audit row");
            }
            Ok(entry)
        }
        Forget::InFlight(_) => Err(ForgetError::InFlight),
        Forget::Absent => Err(ForgetError::NotFound),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(state: Option<&str>, older_than: Option<&str>, limit: Option<u32>) -> RecordsQuery {
        RecordsQuery {
            state: state.map(str::to_owned),
            principal: None,
            older_than: older_than.map(str::to_owned),
            limit,
            cursor: None,
        }
    }

    #[test]
    fn queries_are_checked_and_translated() {
        let now = idempotency::now();
        let ok = record_query(q(Some("in_flight"), Some("10m"), Some(5)), now).expect("valid");
        assert_eq!(ok.state, Some(RecordState::InFlight));
        let unsure = record_query(q(Some("uncertain"), None, None), now).expect("valid");
        assert_eq!(unsure.state, Some(RecordState::Uncertain));
        assert_eq!(ok.started_before, Some(now - chrono::Duration::minutes(10)));
        assert_eq!(ok.limit, 5);
        for bad in [
            q(Some("running"), None, None),
            q(None, Some("ten minutes"), None),
            q(None, Some("1000000000y"), None),
            q(None, None, Some(0)),
            q(None, None, Some(MAX_PAGE + 1)),
        ] {
            assert!(record_query(bad, now).is_err());
        }
    }

    #[test]
    fn record_ids_are_32_lowercase_hex_digits() {
        let id = RecordId::random();
        assert_eq!(record_id(&id.to_hex()), Some(id));
        for bad in ["", "abc", &id.to_hex().to_uppercase(), &format!("{}0", id.to_hex()), "zz".repeat(16).as_str()] {
            assert_eq!(record_id(bad), None, "{bad}");
        }
    }
}
