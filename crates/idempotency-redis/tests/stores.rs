//! The Redis store: the shared conformance suite on one server (`::redis::*`) and on a real Redis
//! Cluster of three primaries that each test starts itself (`redis_cluster::*`), then what is
//! specific to Redis: the script-cache fallback, the eviction-policy check, keys spread over
//! every primary, and a primary killed mid-run.
//!
//! The one-server tests use `TEST_REDIS_URL` (default `redis://127.0.0.1:6379`), each with a key
//! prefix of its own, and delete their keys afterwards. The cluster tests need `redis-server`
//! and `redis-cli` on the PATH. Without them the tests print a loud SKIPPED line and pass,
//! unless `CI=true`, where they fail.
//!
//! Each cluster test starts its own cluster (three `redis-server` processes in a temp dir) and
//! a guard kills them and removes the dir when the test ends. Not one cluster per process in a
//! static: statics are never dropped, so its processes would outlive the test run; and nextest
//! runs each test in a process of its own, where a static would start one cluster per test
//! anyway. Starting one takes about a second.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{ClaimOutcome, ReclaimRequest, Store, StoreError};
use idempotency_redis::{ConnectError, RedisStore, RedisStoreOptions, UnverifiedPolicy};

mod support {
    use std::io::Write;
    use std::sync::Arc;
    use std::time::Duration;

    use idempotency::conformance::Fixture;
    pub(crate) use idempotency_redis::testing::{Cluster, have_redis_binaries, start_server};
    use idempotency_redis::{RedisStore, RedisStoreOptions};

    pub(crate) const TEST_REDIS_URL: &str = "TEST_REDIS_URL";

    fn in_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
    }

    /// Under `CI=true` a skip is a failure; otherwise it prints a loud line and returns `None`.
    pub(crate) fn skip<T>(why: &str) -> Option<T> {
        let test = std::thread::current().name().unwrap_or("<unnamed>").to_owned();
        if in_ci() {
            panic!("{test}: {why}, and CI=true: the Redis tests must run in CI");
        }
        // Straight to the stderr handle: the harness captures `eprintln!` of passing tests.
        let _ = writeln!(std::io::stderr(), "SKIPPED: {test}: the Redis test did not run because {why}");
        None
    }

    pub(crate) fn server_url() -> String {
        std::env::var(TEST_REDIS_URL)
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned())
    }

    pub(crate) fn unique_prefix() -> String {
        format!("test-{}:", idempotency::RecordId::random().to_hex())
    }

    pub(crate) type Holding<G> = idempotency::conformance::Holding<RedisStore, G>;

    /// Deletes every key under a prefix on the shared server when dropped.
    pub(crate) struct PrefixCleanup {
        pub(crate) url: String,
        pub(crate) prefix: String,
    }

    impl Drop for PrefixCleanup {
        fn drop(&mut self) {
            let cleaned = (|| -> ::redis::RedisResult<()> {
                let mut con = ::redis::Client::open(self.url.as_str())?.get_connection()?;
                let keys: Vec<String> = ::redis::cmd("KEYS").arg(format!("{}*", self.prefix)).query(&mut con)?;
                for chunk in keys.chunks(500) {
                    ::redis::cmd("DEL").arg(chunk).exec(&mut con)?;
                }
                Ok(())
            })();
            if let Err(e) = cleaned {
                eprintln!("WARNING: could not delete the test keys under {}: {e}", self.prefix);
            }
        }
    }

    /// A store on the shared server with a prefix of its own; `None` (skipped) when the server
    /// does not answer.
    pub(crate) async fn server_store() -> Option<(RedisStore, Arc<PrefixCleanup>)> {
        let url = server_url();
        let prefix = unique_prefix();
        let options = RedisStoreOptions::default().prefix(prefix.clone()).connect_timeout(Duration::from_secs(2));
        let store = match RedisStore::connect_with(&url, options).await {
            Ok(store) => store,
            Err(idempotency_redis::ConnectError::Unreachable(e)) => {
                return skip(&format!("no Redis answers at {TEST_REDIS_URL}={url} ({e})"));
            }
            Err(e) => panic!("cannot use the Redis server at {url}: {e}"),
        };
        Some((store, Arc::new(PrefixCleanup { url, prefix })))
    }

    /// `store` and `peer` are two connections (two connection managers) to the shared server,
    /// as two replicas of a service would have.
    pub(crate) async fn server_fixture() -> Option<Fixture> {
        let (store, cleanup) = server_store().await?;
        let options = RedisStoreOptions::default().prefix(store.prefix());
        let peer = RedisStore::connect_with(&cleanup.url, options).await.expect("connect the peer");
        Some(Fixture {
            store: Arc::new(Holding::new(store, cleanup.clone())),
            peer: Arc::new(Holding::new(peer, cleanup)),
        })
    }

    /// A cluster of its own; `None` (skipped) without the Redis binaries. Checked here, on
    /// the test's thread, so that the SKIPPED line names the test.
    pub(crate) async fn cluster() -> Option<Arc<Cluster>> {
        if !have_redis_binaries() {
            return skip("redis-server or redis-cli is not installed");
        }
        Some(Arc::new(tokio::task::spawn_blocking(Cluster::start).await.expect("start the cluster")))
    }

    pub(crate) async fn cluster_store(cluster: &Cluster, prefix: &str) -> RedisStore {
        let options = RedisStoreOptions::default().prefix(prefix).response_timeout(Duration::from_secs(2));
        RedisStore::connect_with(&cluster.url(), options).await.expect("connect to the cluster")
    }

    /// `store` and `peer` are two cluster clients (each with its own connections) on a fresh
    /// cluster.
    pub(crate) async fn cluster_fixture() -> Option<Fixture> {
        let cluster = cluster().await?;
        let prefix = unique_prefix();
        let store = cluster_store(&cluster, &prefix).await;
        let peer = cluster_store(&cluster, &prefix).await;
        Some(Fixture {
            store: Arc::new(Holding::new(store, cluster.clone())),
            peer: Arc::new(Holding::new(peer, cluster)),
        })
    }
}

idempotency::store_conformance_suite!(redis, self_expiring optional support::server_fixture());
idempotency::store_conformance_suite!(redis_cluster, self_expiring optional support::cluster_fixture());

/// Two processes, each behind a replay cache: a forget on one reaches the other's copy (PUBLISH).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_replay_cache_is_coherent_across_replicas() {
    let Some(fx) = support::server_fixture().await else { return };
    idempotency::conformance::replay_cache_is_coherent_across_replicas(fx).await;
}

/// The same on a cluster: the forget's announcement reaches a subscriber on any node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_replay_cache_is_coherent_across_replicas() {
    let Some(fx) = support::cluster_fixture().await else { return };
    idempotency::conformance::replay_cache_is_coherent_across_replicas(fx).await;
}

/// Requests and responses for the Redis-specific tests.
mod common {
    use bytes::Bytes;
    use idempotency::{
        ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordId, Scope, StoredBody, StoredResponse,
        now,
    };

    pub(crate) fn scope() -> Scope {
        let key = IdempotencyKey::try_from(RecordId::random().to_hex().as_str()).expect("key");
        Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"), key)
    }

    pub(crate) fn request(scope: &Scope) -> ClaimRequest {
        let t = now();
        ClaimRequest {
            scope: scope.clone(),
            fingerprint: Fingerprint::from_stored("sha256:aa"),
            now: t,
            in_flight_ttl: std::time::Duration::from_secs(300),
            expires_at: t + chrono::Duration::hours(1),
        }
    }

    pub(crate) fn response() -> StoredResponse {
        StoredResponse { status: 201, headers: vec![], body: StoredBody::encode(Bytes::from_static(b"{}"), 1024) }
    }
}

use common::{request, response, scope};

#[path = "stores/failover.rs"]
mod failover;
#[path = "stores/partial.rs"]
mod partial;
#[path = "stores/wait.rs"]
mod wait;

fn cached_scripts(con: &mut ::redis::Connection) -> u64 {
    let info: String = ::redis::cmd("INFO").arg("memory").query(con).expect("info");
    info.lines()
        .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("number_of_cached_scripts in INFO memory")
}

/// After `SCRIPT FLUSH` every transition still works: `EVALSHA` answers `NOSCRIPT` and the store
/// falls back to `EVAL`, which caches the script again.
#[tokio::test]
async fn server_script_cache_loss_falls_back_to_eval() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let s = scope();
    let ClaimOutcome::Owned(claim) = store.claim(request(&s)).await.expect("claim") else { panic!("owned") };
    let mut con = ::redis::Client::open(cleanup.url.as_str()).expect("url").get_connection().expect("connect");
    ::redis::cmd("SCRIPT").arg("FLUSH").exec(&mut con).expect("script flush");
    store.complete(&claim, &response(), request(&s).expires_at).await.expect("complete after SCRIPT FLUSH");
    ::redis::cmd("SCRIPT").arg("FLUSH").exec(&mut con).expect("script flush");
    let again = store.claim(request(&s)).await.expect("claim after SCRIPT FLUSH");
    assert!(matches!(again, ClaimOutcome::Existing(r) if r.response == Some(response())));
    assert!(cached_scripts(&mut con) >= 1, "EVAL cached the script again");
}

/// On a cluster the fallback runs on the key's own primary: after `SCRIPT FLUSH` on every node
/// a claim works and leaves exactly its one script cached on exactly the key's primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_script_cache_loss_falls_back_to_eval() {
    let Some(cluster) = support::cluster().await else { return };
    let store = support::cluster_store(&cluster, &support::unique_prefix()).await;
    // Load the claim script on every primary first.
    let mut by_port: HashMap<u16, idempotency::Scope> = HashMap::new();
    while by_port.len() < 3 {
        let s = scope();
        store.claim(request(&s)).await.expect("claim");
        by_port.insert(cluster.owner_of(&store.key_of(&s)), s);
    }
    for n in &cluster.nodes {
        let mut con = n.connection();
        assert_eq!(cached_scripts(&mut con), 1, "the claim script is cached on every primary");
        ::redis::cmd("SCRIPT").arg("FLUSH").exec(&mut con).expect("script flush");
        assert_eq!(cached_scripts(&mut con), 0);
    }
    let s = scope();
    let owner = cluster.owner_of(&store.key_of(&s));
    assert!(matches!(store.claim(request(&s)).await.expect("claim after SCRIPT FLUSH"), ClaimOutcome::Owned(_)));
    for n in &cluster.nodes {
        let expected = u64::from(n.port == owner);
        assert_eq!(cached_scripts(&mut n.connection()), expected, "node {}", n.port);
    }
}

/// Records spread over all three primaries: each holds some, and together they hold all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_spread_over_every_primary() {
    let Some(cluster) = support::cluster().await else { return };
    let prefix = support::unique_prefix();
    let store = support::cluster_store(&cluster, &prefix).await;
    let n = 300;
    for _ in 0..n {
        let s = scope();
        let ClaimOutcome::Owned(c) = store.claim(request(&s)).await.expect("claim") else { panic!("owned") };
        store.complete(&c, &response(), request(&s).expires_at).await.expect("complete");
    }
    let mut counts = BTreeMap::new();
    for node in &cluster.nodes {
        let keys: Vec<String> =
            ::redis::cmd("KEYS").arg(format!("{prefix}*")).query(&mut node.connection()).expect("keys");
        // Records only, not the principals' indexes (`count_records`).
        counts.insert(node.port, keys.iter().filter(|k| !k.contains("principal:")).count());
    }
    assert!(counts.values().all(|&c| c >= n / 10), "every primary holds records: {counts:?}");
    assert_eq!(counts.values().sum::<usize>(), n, "{counts:?}");
}

/// A primary killed mid-run: every call for a record it holds fails (never "you own this
/// request"), records on the other two keep working, and `ping` reports the cluster ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_dead_primary_fails_its_keys_and_spares_the_others() {
    let Some(cluster) = support::cluster().await else { return };
    let prefix = support::unique_prefix();
    let store = Arc::new(support::cluster_store(&cluster, &prefix).await);
    let victim = cluster.nodes[0].port;

    // Records completed before the kill, spread over all three.
    let mut before = vec![];
    for _ in 0..30 {
        let s = scope();
        let ClaimOutcome::Owned(c) = store.claim(request(&s)).await.expect("claim") else { panic!("owned") };
        store.complete(&c, &response(), request(&s).expires_at).await.expect("complete");
        let owner = cluster.owner_of(&store.key_of(&s));
        before.push((s, owner));
    }
    let fresh: Vec<_> = (0..30)
        .map(|_| {
            let s = scope();
            let owner = cluster.owner_of(&store.key_of(&s));
            (s, owner)
        })
        .collect();

    store.ping().await.expect("every primary answers before the kill");

    // Claims keep running on four tasks while the primary dies.
    let killer = {
        let cluster = cluster.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            cluster.nodes[0].kill();
        })
    };
    let work: Vec<_> = before
        .iter()
        .map(|(s, o)| (s.clone(), *o, true))
        .chain(fresh.iter().map(|(s, o)| (s.clone(), *o, false)))
        .collect();
    let chunks: Vec<Vec<_>> = work.chunks(15).map(<[_]>::to_vec).collect();
    let tasks: Vec<_> = chunks
        .into_iter()
        .map(|chunk| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut seen = vec![];
                for (s, owner, existed) in chunk {
                    // Twice: once likely before the kill, once surely after.
                    for _ in 0..2 {
                        seen.push((owner, existed, store.claim(request(&s)).await));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                seen
            })
        })
        .collect();
    killer.await.expect("kill");
    let mut outcomes = vec![];
    for t in tasks {
        outcomes.extend(t.await.expect("task"));
    }
    // And once more for every record, now that the primary is surely dead.
    for (s, owner, existed) in &work {
        outcomes.push((*owner, *existed, store.claim(request(s)).await));
    }

    let (mut dead_errors, mut live_ok) = (0, 0);
    for (owner, existed, outcome) in &outcomes {
        match (owner == &victim, existed, outcome) {
            (true, _, Err(StoreError::Unavailable(_))) => dead_errors += 1,
            // Before the kill: what any claim gets. A fresh key has one owner only.
            (true, true, Ok(ClaimOutcome::Existing(_))) | (true, false, Ok(_)) => {}
            (false, true, Ok(ClaimOutcome::Existing(r))) => {
                assert_eq!(r.response, Some(response()));
                live_ok += 1;
            }
            (false, false, Ok(_)) => live_ok += 1,
            (dead, existed, outcome) => panic!("dead={dead} existed={existed}: {outcome:?}"),
        }
    }
    // The last round ran after the kill: each of the dead primary's keys failed then.
    let last = &outcomes[outcomes.len() - work.len()..];
    for (owner, _, outcome) in last {
        if *owner == victim {
            assert!(matches!(outcome, Err(StoreError::Unavailable(_))), "{outcome:?}");
        } else {
            assert!(outcome.is_ok(), "{outcome:?}");
        }
    }
    // A fresh key on the dead primary is never owned twice: at most one Owned per scope.
    for (s, _) in &fresh {
        let owned = outcomes
            .iter()
            .filter(|(_, existed, o)| !existed && matches!(o, Ok(ClaimOutcome::Owned(c)) if c.scope() == s))
            .count();
        assert!(owned <= 1, "{owned} owners of one key");
    }
    let on_victim = work.iter().filter(|(_, o, _)| *o == victim).count();
    assert!(on_victim > 0 && on_victim < work.len(), "{on_victim} of {} keys on the victim", work.len());
    assert!(dead_errors >= on_victim, "{dead_errors} errors for {on_victim} keys on the dead primary");
    assert!(live_ok >= 2 * (work.len() - on_victim), "{live_ok} successes on the live primaries");
    // Two primaries of three serve their keys: the store answers, and a readiness probe that
    // took the service out of its load balancer would stop those keys too (issue 45, item 4).
    store.ping().await.expect("ready while other primaries answer");
}

/// A server that may evict keys is refused, with an error naming its policy: read with `CONFIG
/// GET`, or from `INFO` where `CONFIG` is renamed away.
#[tokio::test]
async fn evicting_policies_are_refused() {
    if !support::have_redis_binaries() {
        support::skip::<()>("redis-server is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let lru = support::start_server(dir.path(), &["--maxmemory-policy", "allkeys-lru"]);
    let no_config =
        support::start_server(dir.path(), &["--maxmemory-policy", "volatile-ttl", "--rename-command", "CONFIG", ""]);
    let fine = support::start_server(dir.path(), &["--maxmemory-policy", "noeviction"]);
    for (node, policy) in [(&lru, "allkeys-lru"), (&no_config, "volatile-ttl")] {
        match RedisStore::connect(&node.url()).await {
            Err(e @ ConnectError::EvictingPolicy { .. }) => {
                let text = e.to_string();
                assert!(text.contains(policy) && text.contains("noeviction"), "{text}");
            }
            other => panic!("{policy}: expected a refusal, got {other:?}"),
        }
    }
    RedisStore::connect(&fine.url()).await.expect("noeviction is accepted");
}

/// A user that may run neither `CONFIG` nor `INFO` cannot verify the policy: refused by
/// default, accepted with a warning when the caller says so.
#[tokio::test]
async fn unverifiable_policy_is_refused_unless_allowed() {
    if !support::have_redis_binaries() {
        support::skip::<()>("redis-server is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = support::start_server(dir.path(), &[]);
    ::redis::cmd("ACL")
        .arg(&["SETUSER", "blind", "on", ">secret", "~*", "&*", "+@all", "-config", "-info"][..])
        .exec(&mut node.connection())
        .expect("acl setuser");
    let url = format!("redis://blind:secret@127.0.0.1:{}", node.port);
    match RedisStore::connect(&url).await {
        Err(e @ ConnectError::UnverifiedPolicy { .. }) => {
            let text = e.to_string();
            assert!(text.contains("CONFIG") && text.contains("INFO"), "{text}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let store =
        RedisStore::connect_with(&url, RedisStoreOptions::default().on_unverified_policy(UnverifiedPolicy::Warn))
            .await
            .expect("allowed with a warning");
    let s = scope();
    assert!(matches!(store.claim(request(&s)).await.expect("claim"), ClaimOutcome::Owned(_)));
}

/// A prefix with a hash tag brace is refused before connecting; a value of the wrong type at a
/// record's key is corruption, not unavailability and never ownership.
#[tokio::test]
async fn bad_prefix_and_foreign_values() {
    assert!(matches!(
        RedisStore::connect_with("redis://127.0.0.1:1", RedisStoreOptions::default().prefix("a{b}")).await,
        Err(ConnectError::InvalidPrefix(_))
    ));
    let Some((store, cleanup)) = support::server_store().await else { return };
    let (s, h) = (scope(), scope());
    let mut con = ::redis::Client::open(cleanup.url.as_str()).expect("url").get_connection().expect("connect");
    ::redis::cmd("SET").arg(store.key_of(&s)).arg("not a hash").exec(&mut con).expect("set");
    ::redis::cmd("HSET").arg(store.key_of(&h)).arg("x").arg("1").exec(&mut con).expect("hset");
    for scope in [&s, &h] {
        let claimed = store.claim(request(scope)).await;
        assert!(matches!(claimed, Err(StoreError::Corrupt(_))), "{claimed:?}");
    }
    assert!(matches!(store.get(&s).await, Err(StoreError::Corrupt(_))));
    assert!(matches!(store.get(&h).await, Err(StoreError::Corrupt(_))));
}

/// The key's own expiry follows the record's `expires_at`, rounded up to the millisecond: set
/// by the claim, moved later (never earlier) by a reclaim, set by `complete`.
#[tokio::test]
async fn key_expiry_follows_the_record() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let mut con = ::redis::Client::open(cleanup.url.as_str()).expect("url").get_connection().expect("connect");
    let s = scope();
    let key = store.key_of(&s);
    let mut expiry = || -> i64 { ::redis::cmd("PEXPIRETIME").arg(&key).query(&mut con).expect("pexpiretime") };
    let millis = |t: idempotency::Timestamp| {
        let us = t.timestamp_micros();
        us.div_euclid(1000) + i64::from(us.rem_euclid(1000) != 0)
    };
    let req = request(&s);
    let ClaimOutcome::Owned(first) = store.claim(req.clone()).await.expect("claim") else { panic!("owned") };
    assert_eq!(expiry(), millis(req.expires_at));

    store.fail(&first).await.expect("fail");
    let failed = store.get(&s).await.expect("get").expect("record");
    let ttl = Duration::from_secs(300);
    let later = req.expires_at + chrono::Duration::hours(1);
    let second = store
        .reclaim(ReclaimRequest { record: &failed, now: req.now, in_flight_ttl: ttl, expires_at: later })
        .await
        .expect("reclaim")
        .expect("failed is reclaimable");
    assert_eq!(expiry(), millis(later), "a reclaim extends the key's expiry");

    // A stale reclaim with an earlier expiry leaves the key's expiry alone.
    let stale = req.now + chrono::Duration::seconds(301);
    let third = store
        .reclaim(ReclaimRequest { record: second.record(), now: stale, in_flight_ttl: ttl, expires_at: req.now })
        .await
        .expect("reclaim")
        .expect("stale");
    assert_eq!(expiry(), millis(later), "an earlier expiry never shortens the key's");

    let done = req.now + chrono::Duration::minutes(10);
    store.complete(&third, &response(), done).await.expect("complete");
    assert_eq!(expiry(), millis(done), "complete sets the retention window's end");
}

/// On a cluster the policy is read on every primary: one evicting primary is refused by name,
/// and a primary that does not answer leaves the policy unverified (refused unless allowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_policy_is_checked_on_every_primary() {
    let Some(cluster) = support::cluster().await else { return };
    let url = cluster.url();
    RedisStore::connect(&url).await.expect("every primary has noeviction");

    let (evicting, dead) = (&cluster.nodes[2], &cluster.nodes[1]);
    let set = |policy: &str| {
        ::redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .exec(&mut evicting.connection())
            .expect("config set")
    };
    set("allkeys-random");
    match RedisStore::connect(&url).await {
        Err(ConnectError::EvictingPolicy { node, policy }) => {
            assert!(node.ends_with(&format!(":{}", evicting.port)), "{node}");
            assert_eq!(policy, "allkeys-random");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    set("noeviction");

    dead.kill();
    match RedisStore::connect(&url).await {
        Err(ConnectError::UnverifiedPolicy { node, .. }) => {
            assert!(node.ends_with(&format!(":{}", dead.port)), "{node}");
        }
        other => panic!("expected an unverified policy, got {other:?}"),
    }
    let options = RedisStoreOptions::default().on_unverified_policy(UnverifiedPolicy::Warn);
    RedisStore::connect_with(&url, options).await.expect("allowed with a warning");
}

/// The script calls the store exports for the benchmark's floor are the store's own: sent as
/// raw `EVALSHA` on another connection, the claim call creates the very record the store would
/// (read back through the store), a second send of it reads that record instead, the complete
/// call completes it with the response, and a complete call for another claim is fenced.
#[tokio::test]
async fn exported_script_calls_are_the_stores() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let mut con = ::redis::Client::open(cleanup.url.as_str()).expect("url").get_connection().expect("connect");
    let send = |con: &mut ::redis::Connection, call: &idempotency_redis::testing::ScriptCall| -> ::redis::Value {
        let sha: String = ::redis::cmd("SCRIPT").arg("LOAD").arg(call.source).query(con).expect("script load");
        assert_eq!(sha, call.sha1, "the digest EVALSHA names is the source's");
        let mut cmd = ::redis::Cmd::new();
        for a in call.evalsha() {
            cmd.arg(a);
        }
        cmd.query(con).expect("evalsha")
    };
    let s = scope();
    let req = request(&s);
    let fresh = req.new_record();
    let claim = store.claim_call(&req, &fresh);
    assert_eq!(claim.key, store.key_of(&s));
    assert_eq!(send(&mut con, &claim), ::redis::Value::Int(1), "a free key is claimed");
    assert_eq!(store.get(&s).await.expect("get"), Some(fresh.clone()), "the record the store would insert");
    assert!(matches!(send(&mut con, &claim), ::redis::Value::Array(_)), "a live key is read, not claimed");

    let owned = idempotency::Claim::new(fresh.clone());
    let mut other = fresh;
    other.record_id = idempotency::RecordId::random();
    let fenced = store.complete_call(&idempotency::Claim::new(other), &response(), req.expires_at);
    assert_eq!(send(&mut con, &fenced), ::redis::Value::Int(0), "another record id is fenced");
    let complete = store.complete_call(&owned, &response(), req.expires_at);
    assert_eq!(send(&mut con, &complete), ::redis::Value::Int(1));
    let done = store.get(&s).await.expect("get").expect("record");
    assert_eq!((done.state, done.response), (idempotency::RecordState::Completed, Some(response())));
    assert_eq!(send(&mut con, &complete), ::redis::Value::Int(0), "a completed record is fenced");
}

/// Issue 24, hole 6: the claim script ran and inserted this call's record, its answer was lost
/// to an I/O error, and the client sent the script again (what the Cluster client does on a
/// retry). The second run finds the record this very call created: the call owns it, and does
/// not answer `Existing` (a `409` to the request that made it, for a whole TTL). Another
/// request for the key still finds it taken.
#[tokio::test]
async fn a_claim_script_run_twice_by_one_call_owns_its_record() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let s = scope();
    let req = request(&s);
    let fresh = req.new_record();
    let call = store.claim_call(&req, &fresh);
    let mut con = ::redis::Client::open(cleanup.url.as_str()).expect("url").get_connection().expect("connect");
    let mut first = ::redis::cmd("EVAL");
    first.arg(call.source).arg(1).arg(&call.key);
    for a in &call.args {
        first.arg(a.as_slice());
    }
    let inserted: i64 = first.query(&mut con).expect("the first run");
    assert_eq!(inserted, 1, "the first run inserted the record; its answer is lost");
    let again = store.claim_as(&req, fresh.clone()).await.expect("the run sent again");
    match again {
        ClaimOutcome::Owned(claim) => assert_eq!(claim.record().record_id, fresh.record_id),
        ClaimOutcome::Existing(r) => panic!("this call's own record seen as existing: {r:?}"),
    }
    let other = store.claim(request(&s)).await.expect("another request");
    assert!(matches!(other, ClaimOutcome::Existing(ref r) if r.record_id == fresh.record_id), "{other:?}");
}

/// Waits until `channel` has a subscriber on the node `url` names (`PUBSUB NUMSUB`).
async fn until_subscribed(url: &str, channel: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut con = ::redis::Client::open(url).expect("url").get_connection().expect("connect");
    loop {
        let (_, n): (String, i64) = ::redis::cmd("PUBSUB").arg("NUMSUB").arg(channel).query(&mut con).expect("numsub");
        if n >= 1 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "nobody subscribed to {channel}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `waiter`'s announcements of `scope`'s record: armed now, so one sent from here on counts.
async fn announced_within(
    changes: &Arc<idempotency::RecordChanges>,
    s: &idempotency::Scope,
    work: impl std::future::Future,
) {
    let sub = changes.subscribe(s);
    let mut heard = std::pin::pin!(sub.notify().notified());
    heard.as_mut().enable();
    work.await;
    // A deadline for the condition, not a measure of speed: without the announcement nothing
    // would ever wake it.
    tokio::time::timeout(Duration::from_secs(30), heard).await.expect("the change was announced");
}

/// Across processes on one server: a record completed or failed by one store is announced to the
/// other's waiters (`PUBLISH` on the prefix's channel), and only that record's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_completion_and_failure_are_announced_to_another_process() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let options = idempotency_redis::RedisStoreOptions::default().prefix(store.prefix());
    let other = idempotency_redis::RedisStore::connect_with(&cleanup.url, options).await.expect("connect the peer");
    let changes = other.changes().expect("a Redis store announces changes");
    until_subscribed(&cleanup.url, &idempotency_redis::changes_channel(store.prefix())).await;

    let (done, failed, untouched) = (scope(), scope(), scope());
    announced_within(&changes, &done, async {
        let ClaimOutcome::Owned(c) = store.claim(request(&done)).await.expect("claim") else { panic!("owned") };
        store.complete(&c, &response(), request(&done).expires_at).await.expect("complete");
    })
    .await;
    // Armed once an announcement came through: the wake-up every new subscription gives all
    // waiters is behind us, so only an announcement could wake this one.
    let quiet = changes.subscribe(&untouched);
    let mut not_heard = std::pin::pin!(quiet.notify().notified());
    not_heard.as_mut().enable();
    announced_within(&changes, &failed, async {
        let ClaimOutcome::Owned(c) = store.claim(request(&failed)).await.expect("claim") else { panic!("owned") };
        store.fail(&c).await.expect("fail");
    })
    .await;
    assert!(futures::poll!(not_heard.as_mut()).is_pending(), "another record's waiter was not woken");
}

/// A record marked uncertain by its claim, and a stale one marked uncertain by a retry, are
/// announced to another process's waiters like a completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_uncertain_marks_are_announced_to_another_process() {
    let Some((store, cleanup)) = support::server_store().await else { return };
    let options = idempotency_redis::RedisStoreOptions::default().prefix(store.prefix());
    let other = idempotency_redis::RedisStore::connect_with(&cleanup.url, options).await.expect("connect the peer");
    let changes = other.changes().expect("a Redis store announces changes");
    until_subscribed(&cleanup.url, &idempotency_redis::changes_channel(store.prefix())).await;

    let (lost, stale) = (scope(), scope());
    announced_within(&changes, &lost, async {
        let ClaimOutcome::Owned(c) = store.claim(request(&lost)).await.expect("claim") else { panic!("owned") };
        store.mark_uncertain(&c).await.expect("mark uncertain");
    })
    .await;
    let ClaimOutcome::Owned(c) = store.claim(request(&stale)).await.expect("claim") else { panic!("owned") };
    let read = c.record().clone();
    announced_within(&changes, &stale, async {
        let later = read.started_at + chrono::Duration::hours(1);
        let req = idempotency::ReclaimRequest {
            record: &read,
            now: later,
            in_flight_ttl: Duration::from_secs(300),
            expires_at: later + chrono::Duration::hours(24),
        };
        store.mark_stale_uncertain(req).await.expect("mark stale uncertain").expect("stale");
    })
    .await;
    assert_eq!(other.get(&stale).await.expect("get").expect("row").state, idempotency::RecordState::Uncertain);
}

/// On a cluster, one subscription (to a node of the URL) hears the announcements of records on
/// every primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_announcements_from_every_primary_reach_one_subscription() {
    let Some(cluster) = support::cluster().await else { return };
    let prefix = support::unique_prefix();
    let store = support::cluster_store(&cluster, &prefix).await;
    let other = support::cluster_store(&cluster, &prefix).await;
    let changes = other.changes().expect("a Redis store announces changes");
    let channel = idempotency_redis::changes_channel(&prefix);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !{
        let mut subscribed = 0;
        for n in &cluster.nodes {
            let (_, c): (String, i64) =
                ::redis::cmd("PUBSUB").arg("NUMSUB").arg(&channel).query(&mut n.connection()).expect("numsub");
            subscribed += c;
        }
        subscribed >= 1
    } {
        assert!(std::time::Instant::now() < deadline, "nobody subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut owners = std::collections::BTreeSet::new();
    while owners.len() < cluster.nodes.len() {
        let s = scope();
        if !owners.insert(cluster.owner_of(&store.key_of(&s))) {
            continue;
        }
        announced_within(&changes, &s, async {
            let ClaimOutcome::Owned(c) = store.claim(request(&s)).await.expect("claim") else { panic!("owned") };
            store.complete(&c, &response(), request(&s).expires_at).await.expect("complete");
        })
        .await;
    }
}
