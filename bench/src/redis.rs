//! Redis measurements: `RedisStore` driven directly, and the calls of its own scripts that
//! `redis-benchmark` sends as the floor it is compared with.
//!
//! Every key lives under one prefix of the run's own (`bench/run` passes
//! `idem-bench:<pid>:`), and `redis-clean` deletes them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use idempotency::{Claim, ClaimOutcome, RecordId, RecordState, Store, now};
use idempotency_redis::testing::ScriptCall;
use idempotency_redis::{RedisStore, RedisStoreOptions};
use redis::AsyncCommands;
use serde_json::json;

use crate::load;
use crate::pg::{claim_request, response};

/// The key every replay reads, through the store and through `redis-benchmark`.
const REPLAY_KEY: &str = "r-0";

/// The record id of the records the floor claims and completes. One for all of them: the
/// floor's complete call must name the id its fill claimed, and the ids are never compared
/// across keys.
const FLOOR_RECORD_ID: &str = "000102030405060708090a0b0c0d0e0f";

/// What `redis-benchmark -r` replaces with 12 random digits.
const RAND: &str = "__rand_int__";

/// The floor's first-execution claims go to `{prefix}fc:...`, its completions to
/// `{prefix}fk:...`: after the prefix, as long as the store's own keys (a 64-digit hex
/// SHA-256), `RAND` at the end.
fn floor_key(prefix: &str, tag: &str) -> String {
    format!("{prefix}{tag}:{}{RAND}", "x".repeat(64 - tag.len() - 1 - 12))
}

#[derive(Debug, Args)]
pub(crate) struct Conn {
    /// The Redis server.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    url: String,
    /// Every key this run writes starts with it.
    #[arg(long)]
    prefix: String,
}

impl Conn {
    async fn store(&self) -> anyhow::Result<RedisStore> {
        Ok(RedisStore::connect_with(&self.url, RedisStoreOptions::default().prefix(&self.prefix)).await?)
    }

    async fn raw(&self) -> anyhow::Result<redis::aio::MultiplexedConnection> {
        Ok(redis::Client::open(self.url.as_str())?.get_multiplexed_async_connection().await?)
    }
}

/// The floor's claim of a fresh key and its completion, as the store would send them for a
/// record whose id is [`FLOOR_RECORD_ID`], with `{key}` standing for the key.
fn floor_calls(store: &RedisStore, key: &str) -> anyhow::Result<(ScriptCall, ScriptCall)> {
    let req = claim_request(key)?;
    let mut fresh = req.new_record();
    fresh.record_id = RecordId::from_hex(FLOOR_RECORD_ID).ok_or_else(|| anyhow::anyhow!("a bad record id"))?;
    let claim = store.claim_call(&req, &fresh);
    let complete = store.complete_call(&Claim::new(fresh), &response(), req.expires_at);
    Ok((claim, complete))
}

#[derive(Debug, Args)]
pub(crate) struct PrepareArgs {
    #[command(flatten)]
    conn: Conn,
    /// Where to write `claim.lua`, `complete.lua` and the `redis-benchmark` argument lists
    /// (`replay.args`, `first-claim.args`, `first-complete.args`: NUL-separated).
    #[arg(long)]
    dir: PathBuf,
}

fn write_args(path: &Path, argv: &[Vec<u8>]) -> anyhow::Result<()> {
    let mut out = Vec::new();
    for a in argv {
        anyhow::ensure!(!a.contains(&0), "an argument with a NUL byte cannot go through the shell");
        out.extend_from_slice(a);
        out.push(0);
    }
    Ok(std::fs::write(path, out)?)
}

/// Completes the record every replay reads (through the store) and writes the floor's files.
pub(crate) async fn prepare(a: PrepareArgs) -> anyhow::Result<()> {
    let store = a.conn.store().await?;
    let req = claim_request(REPLAY_KEY)?;
    let replay_key = store.key_of(&req.scope);
    match store.claim(req.clone()).await? {
        ClaimOutcome::Owned(claim) => store.complete(&claim, &response(), req.expires_at).await?,
        ClaimOutcome::Existing(r) => {
            anyhow::ensure!(r.state == RecordState::Completed, "{replay_key} is {:?}", r.state)
        }
    }
    // The replay's call: a claim of the completed key (its fresh record is never written).
    let replay = store.claim_call(&req, &req.new_record());
    let (first_claim, first_complete) = floor_calls(&store, "floor")?;
    let with_key = |call: &ScriptCall, key: String| ScriptCall { key, ..call.clone() };
    std::fs::create_dir_all(&a.dir)?;
    std::fs::write(a.dir.join("claim.lua"), replay.source)?;
    std::fs::write(a.dir.join("complete.lua"), first_complete.source)?;
    write_args(&a.dir.join("replay.args"), &replay.evalsha())?;
    write_args(&a.dir.join("first-claim.args"), &with_key(&first_claim, floor_key(&a.conn.prefix, "fc")).evalsha())?;
    write_args(
        &a.dir.join("first-complete.args"),
        &with_key(&first_complete, floor_key(&a.conn.prefix, "fk")).evalsha(),
    )?;
    println!(
        "{}",
        json!({
            "replay_key": replay_key, "claim_sha1": replay.sha1, "complete_sha1": first_complete.sha1,
            "complete_keys": floor_key(&a.conn.prefix, "fk"),
        })
    );
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct FillArgs {
    #[command(flatten)]
    conn: Conn,
    /// In-flight records to create, keyed as `first-complete.args` names them with `-r COUNT`.
    #[arg(long)]
    count: u64,
}

/// Creates `--count` in-flight records for the floor's completions to complete, with the
/// store's claim script (pipelined, 1,000 calls a round trip): `redis-benchmark -r COUNT`
/// picks among exactly these keys.
pub(crate) async fn fill(a: FillArgs) -> anyhow::Result<()> {
    let store = a.conn.store().await?;
    let mut con = a.conn.raw().await?;
    let (claim, _) = floor_calls(&store, "floor")?;
    let _: String = redis::cmd("SCRIPT").arg("LOAD").arg(claim.source).query_async(&mut con).await?;
    let template = floor_key(&a.conn.prefix, "fk");
    let t = Instant::now();
    let mut created = 0u64;
    let mut i = 0u64;
    while i < a.count {
        let mut pipe = redis::pipe();
        for j in i..(i + 1000).min(a.count) {
            let cmd = pipe.cmd("EVALSHA").arg(&claim.sha1).arg(1).arg(template.replace(RAND, &format!("{j:012}")));
            for arg in &claim.args {
                cmd.arg(arg.as_slice());
            }
        }
        let replies: Vec<redis::Value> = pipe.query_async(&mut con).await?;
        created += replies.iter().filter(|v| matches!(v, redis::Value::Int(1))).count() as u64;
        i += 1000;
    }
    anyhow::ensure!(created == a.count, "{} of the {} keys were not free", a.count - created, a.count);
    println!("{}", json!({ "created": created, "seconds": t.elapsed().as_secs_f64() }));
    Ok(())
}

#[derive(Debug, Args)]
pub(crate) struct CleanArgs {
    #[command(flatten)]
    conn: Conn,
    /// What to delete after the prefix (a `SCAN MATCH` pattern).
    #[arg(long, default_value = "*")]
    pattern: String,
    /// A key to leave (the replay's record).
    #[arg(long)]
    keep: Option<String>,
}

/// Deletes the keys under the prefix that match `--pattern`, and counts them by their record
/// state (`st`) on the way.
pub(crate) async fn clean(a: CleanArgs) -> anyhow::Result<()> {
    let mut con = a.conn.raw().await?;
    let pattern = format!("{}{}", a.conn.prefix, a.pattern);
    let mut keys: Vec<String> = {
        let mut iter: redis::AsyncIter<'_, String> = con.scan_match(&pattern).await?;
        let mut keys = Vec::new();
        while let Some(k) = iter.next_item().await {
            keys.push(k?);
        }
        keys
    };
    keys.retain(|k| Some(k) != a.keep.as_ref());
    keys.sort_unstable();
    keys.dedup();
    let (mut completed, mut in_flight, mut other) = (0u64, 0u64, 0u64);
    for batch in keys.chunks(1000) {
        // Records are hashes; the store also keeps other keys under the prefix (a principal's
        // count of records), which have no state to read.
        let mut types = redis::pipe();
        for k in batch {
            types.cmd("TYPE").arg(k);
        }
        let types: Vec<String> = types.query_async(&mut con).await?;
        let mut pipe = redis::pipe();
        for (k, t) in batch.iter().zip(&types) {
            if t == "hash" {
                pipe.hget(k, "st");
            }
        }
        let states: Vec<Option<String>> = pipe.query_async(&mut con).await?;
        other += types.iter().filter(|t| *t != "hash").count() as u64;
        for s in states {
            match s.as_deref() {
                Some("completed") => completed += 1,
                Some("in_flight") => in_flight += 1,
                _ => other += 1,
            }
        }
        let _: () = redis::cmd("UNLINK").arg(batch).query_async(&mut con).await?;
    }
    println!("{}", json!({ "deleted": keys.len(), "completed": completed, "in_flight": in_flight, "other": other }));
    Ok(())
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Op {
    /// Claim a fresh key, then complete it: two scripts, two round trips.
    First,
    /// Claim the completed key: one script, one round trip.
    Replay,
}

#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    #[command(flatten)]
    conn: Conn,
    #[arg(long, value_enum)]
    op: Op,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Makes first-execution keys unique across runs.
    #[arg(long, default_value = "s")]
    nonce: String,
    /// Stores (each with its own multiplexed connection) the tasks are spread over; a service
    /// uses one.
    #[arg(long, default_value_t = 1)]
    connections: usize,
}

/// Drives `RedisStore` from `--concurrency` tasks on the store's one (multiplexed) connection,
/// or spread over `--connections` stores.
pub(crate) async fn drive_store(a: StoreArgs) -> anyhow::Result<()> {
    let mut stores = Vec::new();
    for _ in 0..a.connections.max(1) {
        stores.push(a.conn.store().await?);
    }
    // Loads the scripts (the first call falls back to EVAL when the server lacks them).
    for store in &stores {
        let _ = store.claim(claim_request(REPLAY_KEY)?).await?;
    }
    let (op, nonce) = (a.op, Arc::new(a.nonce.clone()));
    let stores = Arc::new(stores);
    let stats = load::run(a.concurrency, Duration::from_secs_f64(a.seconds), move |task, i| {
        let (store, nonce) = (stores[task % stores.len()].clone(), nonce.clone());
        async move {
            match op {
                Op::First => {
                    let req = claim_request(&format!("{nonce}-{task}-{i}"))?;
                    let ClaimOutcome::Owned(claim) = store.claim(req).await? else { return Ok(false) };
                    store.complete(&claim, &response(), now() + chrono::Duration::hours(24)).await?;
                    Ok(true)
                }
                Op::Replay => {
                    let outcome = store.claim(claim_request(REPLAY_KEY)?).await?;
                    Ok(matches!(outcome, ClaimOutcome::Existing(r) if r.state == RecordState::Completed))
                }
            }
        }
    })
    .await;
    println!("{}", serde_json::to_value(&stats)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_keys_are_as_long_as_the_stores() {
        let k = floor_key("p:", "fc");
        assert_eq!(k.len(), "p:".len() + 64 - 12 + RAND.len());
        assert!(k.starts_with("p:fc:") && k.ends_with(RAND));
    }
}
