//! The rows as the ledger reads them: the columns it selects and how each becomes an
//! [`Intent`](crate::Intent) or an [`OperationRow`](crate::OperationRow). The readers are macros,
//! so one text reads a row of either driver; a caller has `sqlx::Row`, `Intent`, `IntentState`,
//! `OperationRow`, `Mark` and `LedgerError` in scope.

pub(super) const INTENT_COLUMNS: &str =
    "intent_id, op_id, effect, keeps, state, resource_id, created_at, sent_at, watcher, watch_until";
pub(super) const OP_COLUMNS: &str =
    "op_id, kind, principal, endpoint, idem_key, record_id, subject, mark, last_attempt_at, next_check_at";

macro_rules! read_intent {
    ($row:expr) => {{
        let row = $row;
        let state: String = row.try_get("state")?;
        Intent {
            intent_id: row.try_get("intent_id")?,
            op_id: row.try_get("op_id")?,
            effect: row.try_get("effect")?,
            keeps: row.try_get::<i64, _>("keeps")? != 0,
            state: IntentState::from_stored(&state)
                .ok_or_else(|| LedgerError::Corrupt(format!("intent state {state:?}")))?,
            resource_id: row.try_get("resource_id")?,
            created_at: row.try_get("created_at")?,
            sent_at: row.try_get("sent_at")?,
            watcher: row.try_get("watcher")?,
            watch_until: row.try_get("watch_until")?,
        }
    }};
}

macro_rules! read_op {
    ($row:expr) => {{
        let row = $row;
        let mark: i64 = row.try_get("mark")?;
        OperationRow {
            op_id: row.try_get("op_id")?,
            kind: row.try_get("kind")?,
            principal: row.try_get("principal")?,
            endpoint: row.try_get("endpoint")?,
            idem_key: row.try_get("idem_key")?,
            record_id: row.try_get("record_id")?,
            subject: row.try_get("subject")?,
            mark: Mark::from_i64(mark).ok_or_else(|| LedgerError::Corrupt(format!("operation mark {mark}")))?,
            last_attempt_at: row.try_get("last_attempt_at")?,
            next_check_at: row.try_get("next_check_at")?,
        }
    }};
}

pub(super) use {read_intent, read_op};
