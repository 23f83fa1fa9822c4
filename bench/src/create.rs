//! The floor under leasebroker's create: only the writes one create cannot avoid, at the same
//! concurrency, on the same schema (see bench/README.md, part 4). Four commits: the claim; the
//! attempt, the allocation, the lease and the intent with its send stamp (before the hypervisor
//! call); the worker with its VM, with the operation finished (after the call); the completion.
//!
//! On PostgreSQL the floor is a pgbench script (`create.sql`); on SQLite the same statements
//! from 16 tokio tasks here (`sqlite-create-floor`), with the store's pragmas (WAL,
//! `synchronous = FULL`) and its own claim and completion statements (through `SqliteStore`).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use idempotency::{ClaimOutcome, Store, now};
use idempotency_sqlx::SqliteStore;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};

use crate::load;
use crate::pg::{claim_request, complete, insert_or_read, response};

/// The domain's writes before the call, with `{op}`, `{alloc}`, `{lease}`, `{intent}`,
/// `{now}`, `{stamp}` and `{free}` (the free-node sub-select) to fill in. The statements are
/// leasebroker's and the effect ledger's (crates/leasebroker/src/domain/create.rs, nodes.rs;
/// crates/idempotency-effects/src/sql.rs); the attempt's row is the rollback fence and what the
/// reaper finds an abandoned create by.
const BEFORE: [&str; 4] = [
    "INSERT INTO fx_operations (op_id, kind, principal, endpoint, idem_key, record_id, mark, last_attempt_at, \
     next_check_at) VALUES ({op}, 'create', 'bench', 'POST /v1/workers', {op}, {op}, 0, {now}, {now}) \
     ON CONFLICT (op_id) DO UPDATE SET last_attempt_at = excluded.last_attempt_at, \
     next_check_at = excluded.next_check_at WHERE fx_operations.mark = 0",
    "UPDATE lb_nodes SET alloc_id = {alloc}, principal = 'bench', allocated_at = {now} \
     WHERE node_id = ({free}) RETURNING node_id",
    "INSERT INTO lb_leases (lease_id, node_id, principal, created_at) VALUES ({lease}, {node}, 'bench', {now})",
    "INSERT INTO fx_intents (intent_id, op_id, effect, keeps, state, created_at, sent_at) \
     VALUES ({intent}, {op}, 'boot', 1, 'pending', {now}, {stamp})",
];

/// The domain's writes after the call: the worker (with the VM), the operation finished (its
/// mark; its intents go).
const AFTER: [&str; 3] = [
    "INSERT INTO lb_workers (worker_id, principal, image, cpu, memory_gb, labels, node_id, lease_id, vm_id, state, \
     reboot_count, created_at) VALUES ({worker}, 'bench', 'worker-base', 1, 1, '{{}}', {node}, {lease}, {vm}, \
     'running', 0, {now})",
    "DELETE FROM fx_intents WHERE op_id = {op}",
    "UPDATE fx_operations SET mark = 3, marked_at = {now} WHERE op_id = {op} AND mark = 0",
];

const FREE_PG: &str =
    "SELECT node_id FROM lb_nodes WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1 FOR UPDATE SKIP LOCKED";
const FREE_SQLITE: &str =
    "SELECT node_id FROM lb_nodes INDEXED BY lb_nodes_free WHERE alloc_id IS NULL ORDER BY node_id LIMIT 1";

/// Fills in a statement's placeholders.
fn fill(sql: &str, vars: &[(&str, &str)]) -> String {
    let mut s = sql.replace("{{}}", "\u{0}");
    for (k, v) in vars {
        s = s.replace(&format!("{{{k}}}"), v);
    }
    s.replace('\u{0}', "{}")
}

/// `create.sql`: one create's writes as pgbench runs them (`-M prepared`: `:k`, `:nonce` and
/// `:node_id` are parameters): the claim and the completion autocommit, the domain's writes in
/// two transactions. Sub-keys are md5 digests, as random as the service's.
pub(crate) fn write_pgbench_script(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let key = "(:nonce::text || '-c-' || :client_id::text || '-' || :k::text)";
    let sub = |label: &str| format!("('sk-' || md5({key} || '{label}'))");
    let (op, alloc, lease, intent, worker, vm) =
        (sub("op"), sub("alloc"), sub("lease"), sub("boot"), sub("worker"), sub("vm"));
    let now = "(extract(epoch from clock_timestamp()) * 1000000)::bigint";
    let stamp = format!("({now} + 1000000)");
    let vars = [
        ("op", op.as_str()),
        ("alloc", alloc.as_str()),
        ("lease", lease.as_str()),
        ("intent", intent.as_str()),
        ("worker", worker.as_str()),
        ("vm", vm.as_str()),
        ("now", now),
        ("stamp", stamp.as_str()),
        ("free", FREE_PG),
        ("node", ":node_id"),
    ];
    let mut s = String::from("\\set k random(1, 9000000000000000000)\n");
    s.push_str(&insert_or_read(key));
    s.push_str("BEGIN;\n");
    for (i, sql) in BEFORE.iter().enumerate() {
        s.push_str(&fill(sql, &vars));
        // The allocation's node id feeds the lease and the worker.
        s.push_str(if i == 1 { " \\gset\n" } else { ";\n" });
    }
    s.push_str("COMMIT;\nBEGIN;\n");
    for sql in AFTER {
        s.push_str(&fill(sql, &vars));
        s.push_str(";\n");
    }
    s.push_str("COMMIT;\n");
    s.push_str(&complete(key));
    std::fs::write(dir.join("create.sql"), s)?;
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct SqliteFloorArgs {
    /// The SQLite file, migrated already (`leasebroker migrate`).
    #[arg(long)]
    database: PathBuf,
    /// Nodes to seed (those missing are added).
    #[arg(long, default_value_t = 20_000)]
    nodes: u32,
    /// Connections in the pool the tasks share.
    #[arg(long, default_value_t = 1)]
    connections: u32,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Prefix of this run's keys.
    #[arg(long, default_value = "f")]
    nonce: String,
}

/// Opens the file as leasebroker does: WAL, `synchronous = FULL`, a 10 s busy timeout.
async fn sqlite_pool(path: &Path, connections: u32) -> anyhow::Result<SqlitePool> {
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true);
    Ok(idempotency_sqlx::sqlite_pool_options(connections.max(1))
        .min_connections(connections.max(1))
        .connect_with(opts)
        .await?)
}

/// A sub-key as long as the service's: `sk-` and 64 hex digits.
fn sub_key(rng: &str, label: &str) -> String {
    format!("sk-{label:0>8}{rng:0>56}")
}

/// The SQLite floor: 16 tasks each running one create's writes back to back.
pub(crate) async fn sqlite_floor(a: SqliteFloorArgs) -> anyhow::Result<()> {
    let pool = sqlite_pool(&a.database, a.connections).await?;
    sqlx::query(
        "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < $1) \
         INSERT INTO lb_nodes (node_id, cpu, memory_gb) \
         SELECT printf('node-%04d', i), 1, 1 FROM seq WHERE true ON CONFLICT (node_id) DO NOTHING",
    )
    .bind(i64::from(a.nodes))
    .execute(&pool)
    .await?;
    let store = std::sync::Arc::new(SqliteStore::from_pool(pool.clone()));
    let before: Vec<String> = BEFORE.iter().map(|s| placeholders(s, FREE_SQLITE)).collect();
    let after: Vec<String> = AFTER.iter().map(|s| placeholders(s, "")).collect();
    let (before, after) = (std::sync::Arc::new(before), std::sync::Arc::new(after));
    let nonce = std::sync::Arc::new(a.nonce.clone());
    let stats = load::run(a.concurrency, Duration::from_secs_f64(a.seconds), move |task, i| {
        let (store, pool, before, after, nonce) =
            (store.clone(), pool.clone(), before.clone(), after.clone(), nonce.clone());
        async move {
            let key = format!("{nonce}-{task}-{i}");
            let ClaimOutcome::Owned(claim) = store.claim(claim_request(&key)?).await? else {
                return Ok(false);
            };
            let rng = format!("{:x}", rand::random::<u128>());
            let k = |label: &str| sub_key(&rng, label);
            let (op, alloc, lease, intent, worker, vm) =
                (k("op"), k("alloc"), k("lease"), k("boot"), k("worker"), k("vm"));
            let t = now().timestamp_micros();
            let mut tx = pool.begin().await?;
            // $1 op, $2 alloc, $3 lease, $4 intent, $5 worker, $6 vm, $7 now, $8 stamp, $9 node.
            let bind = |sql: &str| {
                sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .bind(op.clone())
                    .bind(alloc.clone())
                    .bind(lease.clone())
                    .bind(intent.clone())
                    .bind(worker.clone())
                    .bind(vm.clone())
                    .bind(t)
                    .bind(t + 1_000_000)
            };
            bind(&before[0]).execute(&mut *tx).await?;
            let Some(row) = bind(&before[1]).fetch_optional(&mut *tx).await? else {
                anyhow::bail!("the node pool is exhausted");
            };
            let node: String = sqlx::Row::try_get(&row, 0)?;
            bind(&before[2]).bind(node.clone()).execute(&mut *tx).await?;
            bind(&before[3]).bind(node.clone()).execute(&mut *tx).await?;
            tx.commit().await?;
            let mut tx = pool.begin().await?;
            for sql in after.iter() {
                bind(sql).bind(node.clone()).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            store.complete(&claim, &response(), now() + chrono::Duration::hours(24)).await?;
            Ok(true)
        }
    })
    .await;
    let mut out = serde_json::to_value(&stats)?;
    out["connections"] = serde_json::json!(a.connections);
    println!("{out}");
    Ok(())
}

/// A statement with numbered parameters in place of the placeholders (see `sqlite_floor`).
fn placeholders(sql: &str, free: &str) -> String {
    fill(
        sql,
        &[
            ("op", "$1"),
            ("alloc", "$2"),
            ("lease", "$3"),
            ("intent", "$4"),
            ("worker", "$5"),
            ("vm", "$6"),
            ("now", "$7"),
            ("stamp", "$8"),
            ("node", "$9"),
            ("free", free),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pgbench_script_has_four_commits_and_fills_every_placeholder() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_pgbench_script(dir.path()).expect("script");
        let s = std::fs::read_to_string(dir.path().join("create.sql")).expect("read");
        assert_eq!(s.matches("COMMIT;").count(), 2, "{s}");
        assert!(s.contains("ON CONFLICT (principal, endpoint, key) DO NOTHING"), "the claim: {s}");
        assert!(s.contains("SET state = 'completed'"), "the completion: {s}");
        assert!(s.contains("RETURNING node_id \\gset"), "{s}");
        assert!(!s.contains('{') || s.contains("'{}'"), "a placeholder left: {s}");
        assert!(!s.contains("{op}") && !s.contains("{node}"), "{s}");
    }
}
