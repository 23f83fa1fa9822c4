//! "Nothing acknowledged is lost": the state of every record the service holds against the keys
//! a success was answered for, the invariant, and the records `--drop-acknowledged` deletes
//! behind the service's back to check the checker.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, anyhow};
use idempotency_sqlx::DatabaseUrl;

use super::{Damage, Invariant, Reader};
use crate::cluster::ADMIN_TOKEN;
use crate::workload::StoredAnswer;
use leasebroker_api::RecordState;

impl Reader {
    /// The state of every record the service holds, by key (`GET /admin/v1/records`, page by
    /// page, every principal's).
    pub async fn record_states(&self) -> anyhow::Result<HashMap<String, RecordState>> {
        Ok(self.all_records().await?.into_iter().map(|r| (r.key, r.state)).collect())
    }

    /// What the service holds for each of `keys` that it has a record of: the record's state
    /// and, when completed, its stored response (`GET /admin/v1/records/{id}?body=true`).
    pub async fn stored_answers(&self, keys: &[String]) -> anyhow::Result<HashMap<String, StoredAnswer>> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let mut out = HashMap::new();
        for record in self.all_records().await?.into_iter().filter(|r| keys.contains(&r.key)) {
            let url = format!("{}/admin/v1/records/{}?body=true", self.replicas[0], record.id);
            let full: leasebroker_client::Record = self.get(&url, ADMIN_TOKEN).await?.unwrap_or(record);
            let hex = full.response_body_encoding.as_deref() == Some("hex");
            let answer =
                StoredAnswer { state: full.state.into(), status: full.response_status, body: full.response_body, hex };
            out.insert(full.key, answer);
        }
        Ok(out)
    }

    /// Every record the service holds (`GET /admin/v1/records`, page by page, every
    /// principal's).
    pub(super) async fn all_records(&self) -> anyhow::Result<Vec<leasebroker_client::Record>> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..100_000 {
            let mut url = format!("{}/admin/v1/records?limit=500", self.replicas[0]);
            if let Some(c) = &cursor {
                url.push_str("&cursor=");
                url.push_str(c);
            }
            let page: leasebroker_client::RecordPage =
                self.get(&url, ADMIN_TOKEN).await?.ok_or_else(|| anyhow!("listing records answered 404"))?;
            all.extend(page.records);
            match page.next_cursor {
                Some(next) if cursor.as_ref() != Some(&next) => cursor = Some(next),
                _ => break,
            }
        }
        Ok(all)
    }
}

/// The acknowledged keys (a `2xx` was answered for each) whose record the service no longer
/// holds completed, as `key (what): gone` or `key (what): <state>`, sorted: what a failover (or
/// anything else) lost after it was acknowledged. A retry of such a key runs again.
pub fn records_lost(
    acknowledged: &[crate::workload::Acknowledged],
    states: &HashMap<String, RecordState>,
) -> Vec<String> {
    let mut out: Vec<String> = acknowledged
        .iter()
        .filter_map(|a| match states.get(&a.key) {
            Some(RecordState::Completed) => None,
            Some(state) => Some(format!("{} ({}): {state}", a.key, a.what)),
            None => Some(format!("{} ({}): gone", a.key, a.what)),
        })
        .collect();
    out.sort();
    out
}

/// The invariant "nothing acknowledged is lost": every key a success was answered for still has
/// its completed record; every worker a client holds is still listed; every accepted flash
/// operation can still be read.
pub fn check_acknowledged(
    records_lost: u64,
    flash_ops_lost: u64,
    damage: &mut Damage,
    invariants: &mut Vec<Invariant>,
) {
    damage.acknowledged_records_lost = records_lost;
    damage.acknowledged_flash_ops_lost = flash_ops_lost;
    for (name, actual) in [
        (ACKNOWLEDGED_RECORDS_LOST, records_lost),
        ("acknowledged flash operations lost (accepted, no longer found)", flash_ops_lost),
    ] {
        invariants.push(Invariant { name: name.to_owned(), expected: 0, actual, at_most: false, ok: actual == 0 });
    }
}

/// The name of the invariant on acknowledged records.
pub const ACKNOWLEDGED_RECORDS_LOST: &str = "acknowledged records lost (2xx answered, record gone or not completed)";

/// Deletes the records of `keys` straight from the database at `database`, behind the service's
/// back (`--drop-acknowledged`). Returns how many rows went.
pub async fn drop_records(database: &DatabaseUrl, keys: &[String]) -> anyhow::Result<u64> {
    const DELETE: &str = "DELETE FROM idempotency_records WHERE key = $1";
    let mut dropped = 0;
    match database {
        DatabaseUrl::Sqlite(url) => {
            let options: sqlx::sqlite::SqliteConnectOptions = url.parse().context("the SQLite URL")?;
            let pool = sqlx::SqlitePool::connect_with(options.busy_timeout(Duration::from_secs(10))).await?;
            for key in keys {
                dropped += sqlx::query(DELETE).bind(key).execute(&pool).await?.rows_affected();
            }
            pool.close().await;
        }
        DatabaseUrl::Postgres(url) => {
            let pool = sqlx::PgPool::connect(url).await.context("connecting to PostgreSQL")?;
            for key in keys {
                dropped += sqlx::query(DELETE).bind(key).execute(&pool).await?.rows_affected();
            }
            pool.close().await;
        }
        _ => anyhow::bail!("no records to drop in {database}: not a database faultline knows"),
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledged_key_whose_record_is_gone_or_not_completed_is_lost() {
        use crate::workload::Acknowledged;
        let ack = |key: &str| Acknowledged { key: key.to_owned(), what: format!("create op {key}") };
        let acknowledged = [ack("k1"), ack("k2"), ack("k3"), ack("k4")];
        let states: HashMap<String, RecordState> = [("k1", "completed"), ("k3", "in_flight"), ("k4", "completed")]
            .into_iter()
            .map(|(k, s)| (k.to_owned(), s.to_owned().into()))
            .collect();
        let lost = records_lost(&acknowledged, &states);
        assert_eq!(lost, ["k2 (create op k2): gone", "k3 (create op k3): in_flight"]);

        let (mut damage, mut invariants) = (Damage::default(), Vec::new());
        check_acknowledged(lost.len() as u64, 0, &mut damage, &mut invariants);
        assert_eq!((damage.acknowledged_records_lost, damage.acknowledged_flash_ops_lost), (2, 0));
        assert_eq!(invariants.iter().map(|i| (i.actual, i.ok)).collect::<Vec<_>>(), [(2, false), (0, true)]);
        assert!(
            records_lost(
                &acknowledged,
                &[("k2", "completed"), ("k3", "completed")]
                    .into_iter()
                    .chain([("k1", "completed"), ("k4", "completed")])
                    .map(|(k, s)| (k.to_owned(), s.to_owned().into()))
                    .collect()
            )
            .is_empty()
        );
    }
}
