//! Issue 45, item 4: a partial outage of a Redis Cluster stays partial. With a replica per
//! primary and `replicas(1)`, one shard that cannot acknowledge (its replica paused) or cannot
//! answer (its primary killed, no failover yet) fails its own keys only, while other tasks keep
//! sending it transitions: claims and completions on the other shards, the principal's record
//! count and `ping` answer within the bound the layer puts on a store call (3 s).
//!
//! The shard that fails is the one holding the principal's record index (the sorted set that
//! `count_records` reads and each claim adds to), the worst case for the keys elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency::{ClaimOutcome, Principal, Scope, Store, now};
use idempotency_redis::RedisStore;
use idempotency_redis::testing::Cluster;

use crate::common::{request, response, scope};
use crate::failover::{key_on, store_with};
use crate::support;

/// What the layer allows a store call (`idempotency_tower::DEFAULT_STORE_TIMEOUT`).
const BOUND: Duration = Duration::from_secs(3);

/// A cluster with a replica per primary, a store on it with `replicas(1)`, which primary holds
/// the test principal's record index, and keys on that primary (`near`) and elsewhere (`far`).
struct Setup {
    cluster: Arc<Cluster>,
    store: Arc<RedisStore>,
    victim: usize,
    near: Vec<Scope>,
    far: Vec<Scope>,
}

async fn setup() -> Option<Setup> {
    if !support::have_redis_binaries() {
        return support::skip("redis-server or redis-cli is not installed");
    }
    let cluster = Arc::new(tokio::task::spawn_blocking(|| Cluster::start_with_replicas(1)).await.expect("cluster"));
    let prefix = support::unique_prefix();
    let store = Arc::new(store_with(&cluster.url(), &prefix, 1).await);
    assert!(matches!(store.claim(request(&scope())).await, Ok(ClaimOutcome::Owned(_))), "the index is made");
    let victim = cluster
        .nodes
        .iter()
        .position(|n| {
            let keys: Vec<String> =
                ::redis::cmd("KEYS").arg(format!("{prefix}principal:*")).query(&mut n.connection()).expect("keys");
            !keys.is_empty()
        })
        .expect("a primary holds the principal's index");
    let port = cluster.nodes[victim].port;
    let (near, far) = tokio::task::block_in_place(|| {
        let near: Vec<Scope> = (0..16).map(|_| key_on(&cluster, &store, port)).collect();
        let mut far = vec![];
        while far.len() < 8 {
            let s = scope();
            if cluster.owner_of(&store.key_of(&s)) != port {
                far.push(s);
            }
        }
        (near, far)
    });
    Some(Setup { cluster, store, victim, near, far })
}

/// Eight tasks that claim and complete the victim's keys without pause, each call dropped after
/// [`BOUND`] as the layer drops it, until `stop`; `ended` counts their calls that ended.
fn keep_busy(s: &Setup, stop: &Arc<AtomicBool>, ended: &Arc<AtomicUsize>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..8)
        .map(|i| {
            let (store, stop, ended) = (s.store.clone(), stop.clone(), ended.clone());
            let keys: Vec<Scope> = s.near.iter().skip(i).step_by(8).cloned().collect();
            tokio::spawn(async move {
                for k in keys.iter().cycle() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let claimed = tokio::time::timeout(BOUND, store.claim(request(k))).await;
                    if let Ok(Ok(ClaimOutcome::Owned(c))) = claimed {
                        let _ =
                            tokio::time::timeout(BOUND, store.complete(&c, &response(), request(k).expires_at)).await;
                    }
                    ended.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect()
}

/// With the victim shard out and kept busy: every key elsewhere is claimed and completed within
/// [`BOUND`], the principal is counted (or not, but answered) and `ping` answers ready; a key
/// on the victim is not owned.
async fn the_other_shards_answer(s: &Setup) {
    let (stop, ended) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let load = keep_busy(s, &stop, &ended);
    let deadline = Instant::now() + Duration::from_secs(60);
    while ended.load(Ordering::Relaxed) < 8 {
        assert!(Instant::now() < deadline, "the load on the victim shard did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for k in &s.far {
        let claimed = tokio::time::timeout(BOUND, s.store.claim(request(k))).await;
        let Ok(Ok(ClaimOutcome::Owned(c))) = claimed else {
            panic!("a key on a healthy shard was not claimed within {BOUND:?}: {claimed:?}")
        };
        let completed = tokio::time::timeout(BOUND, s.store.complete(&c, &response(), request(k).expires_at)).await;
        assert!(matches!(completed, Ok(Ok(()))), "a key on a healthy shard was not completed: {completed:?}");
    }
    let counted = tokio::time::timeout(BOUND, s.store.count_records(&Principal::new("team-a"), now())).await;
    assert!(matches!(counted, Ok(Ok(_))), "the principal's count failed every key of it: {counted:?}");
    let ping = tokio::time::timeout(BOUND, s.store.ping()).await;
    assert!(matches!(ping, Ok(Ok(()))), "two of three shards answer, yet not ready: {ping:?}");
    let mine = tokio::time::timeout(BOUND, s.store.claim(request(&s.near[0]))).await;
    assert!(!matches!(mine, Ok(Ok(ClaimOutcome::Owned(_)))), "a key of the broken shard was owned: {mine:?}");
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.expect("load task");
    }
}

/// The replica of the shard that holds the principal's index is paused (`SIGSTOP`): its
/// transitions are not acknowledged, each after a `WAIT` that blocks its connection for the
/// replica timeout. The other shards' keys, the count and `ping` are not held up by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_whose_replica_is_paused_fails_only_its_own_keys() {
    let Some(s) = setup().await else { return };
    s.cluster.replicas[s.victim].pause();
    the_other_shards_answer(&s).await;
    s.cluster.replicas[s.victim].resume();
}

/// The primary that holds the principal's index is killed and its replica told not to take
/// over (`cluster-replica-no-failover`): its keys fail as unavailable, the others answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_whose_primary_is_down_fails_only_its_own_keys() {
    let Some(s) = setup().await else { return };
    ::redis::cmd("CONFIG")
        .arg(&["SET", "cluster-replica-no-failover", "yes"][..])
        .exec(&mut s.cluster.replicas[s.victim].connection())
        .expect("config set");
    s.cluster.nodes[s.victim].kill();
    the_other_shards_answer(&s).await;
}
