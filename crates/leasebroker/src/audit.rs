//! The audit trail of what operators did to idempotency records (docs/protocol.md#operating-it): every forget is a line
//! in the log (target `leasebroker::audit`) and a row in `lb_record_audit`.

use idempotency::Record;
use serde::Serialize;

use crate::db::{Db, with_pool};

/// One audited action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// When, in µs since the epoch.
    pub at: i64,
    /// Who: the principal of the admin request.
    pub actor: String,
    /// What: `forget`.
    pub action: String,
    /// The admin request's own `Idempotency-Key`.
    pub request_key: Option<String>,
    /// The record's id.
    pub record_id: String,
    /// The record's scope: principal.
    pub principal: String,
    /// The record's scope: endpoint.
    pub endpoint: String,
    /// The record's scope: key.
    pub key: String,
    /// The record's state when the action took it.
    pub state: String,
}

impl AuditEntry {
    /// `actor` forgot `record` now, with the request keyed `request_key`.
    pub fn forget(actor: &str, request_key: Option<&str>, record: &Record) -> Self {
        Self {
            at: idempotency::now().timestamp_micros(),
            actor: actor.to_owned(),
            action: "forget".to_owned(),
            request_key: request_key.map(str::to_owned),
            record_id: record.record_id.to_hex(),
            principal: record.scope.principal.as_str().to_owned(),
            endpoint: record.scope.endpoint.as_str().to_owned(),
            key: record.scope.key.as_str().to_owned(),
            state: record.state.as_str().to_owned(),
        }
    }
}

/// The audit table, on leasebroker's database.
#[derive(Debug, Clone)]
pub struct Audit {
    db: Db,
}

const INSERT: &str = "INSERT INTO lb_record_audit \
    (at, actor, action, request_key, record_id, principal, endpoint, key, state) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";

const RECENT: &str = "SELECT at, actor, action, request_key, record_id, principal, endpoint, key, state \
    FROM lb_record_audit ORDER BY audit_id DESC LIMIT $1";

impl Audit {
    /// The audit trail on `db`.
    pub fn new(db: Db) -> Self {
        Self { db }
    }

    /// Logs `entry` (always, first) and writes its row. An error here is the row's: the log
    /// line was written.
    pub async fn record(&self, entry: &AuditEntry) -> Result<(), sqlx::Error> {
        tracing::info!(
            target: "leasebroker::audit",
            actor = %entry.actor,
            action = %entry.action,
            request_key = entry.request_key.as_deref().unwrap_or(""),
            record_id = %entry.record_id,
            principal = %entry.principal,
            endpoint = %entry.endpoint,
            key = %entry.key,
            state = %entry.state,
            "audit: an operator forgot an idempotency record"
        );
        with_pool!(&self.db, pool => {
            sqlx::query(INSERT)
                .bind(entry.at)
                .bind(&entry.actor)
                .bind(&entry.action)
                .bind(entry.request_key.as_deref())
                .bind(&entry.record_id)
                .bind(&entry.principal)
                .bind(&entry.endpoint)
                .bind(&entry.key)
                .bind(&entry.state)
                .execute(pool)
                .await
                .map(|_| ())
        })
    }

    /// The latest `limit` entries, newest first.
    pub async fn recent(&self, limit: i64) -> Result<Vec<AuditEntry>, sqlx::Error> {
        use sqlx::Row;
        with_pool!(&self.db, pool => {
            let rows = sqlx::query(RECENT).bind(limit).fetch_all(pool).await?;
            rows.iter()
                .map(|r| {
                    Ok(AuditEntry {
                        at: r.try_get(0)?,
                        actor: r.try_get(1)?,
                        action: r.try_get(2)?,
                        request_key: r.try_get(3)?,
                        record_id: r.try_get(4)?,
                        principal: r.try_get(5)?,
                        endpoint: r.try_get(6)?,
                        key: r.try_get(7)?,
                        state: r.try_get(8)?,
                    })
                })
                .collect()
        })
    }
}
