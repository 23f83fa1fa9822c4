//! Issue 45, item 5: `WAIT` counts the writes of the connection that sends it, so a transition
//! and its `WAIT` must go over one connection. On a real cluster with a replica per primary, a
//! proxy in front of one primary cuts the connection at a transition's script
//! (`testing::CutProxy`): right after the script's reply, so that whatever follows it goes over
//! a new connection, or instead of that reply, so that the client sends the script again. Neither
//! may acknowledge a write its replica does not have, and a completion sent again is the caller's
//! own, not a newer attempt's. And the eviction policy is read again when a connection is made
//! again, not only at connect.

use std::time::{Duration, Instant};

use idempotency::{ClaimOutcome, ErrorChain, Store, StoreError};
use idempotency_redis::RedisStore;
use idempotency_redis::testing::{Cluster, Cut, start_server};

use crate::common::{request, response, scope};
use crate::failover::{key_on, not_acknowledged, store_with, wait_for_link};
use crate::support;

async fn cluster_with_replicas() -> Option<Cluster> {
    if !support::have_redis_binaries() {
        return support::skip("redis-server or redis-cli is not installed");
    }
    Some(tokio::task::spawn_blocking(|| Cluster::start_with_replicas(1)).await.expect("cluster"))
}

/// The replica of the proxied primary stops applying its stream (`CLIENT PAUSE WRITE`, a replica
/// that lags): a `WAIT` for a write it lacks can only time out with 0. The
/// connection is cut right after the claim script's reply. Before the fix the `WAIT` was a
/// request of its own, which the cluster client sent again over a new connection that had
/// written nothing, and Redis answered it at once with 1: a claim acknowledged that no replica
/// had. Now the claim fails as unavailable and leaves its key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_after_the_claim_script_acknowledges_nothing() {
    let Some(cluster) = cluster_with_replicas().await else { return };
    let proxy = tokio::task::block_in_place(|| cluster.proxy_primary(0));
    let store = store_with(&cluster.url(), &support::unique_prefix(), 1).await;
    let s = tokio::task::block_in_place(|| key_on(&cluster, &store, proxy.port));
    // Acknowledged through the proxy while the replica answers.
    let warm = tokio::task::block_in_place(|| key_on(&cluster, &store, proxy.port));
    assert!(matches!(store.claim(request(&warm)).await, Ok(ClaimOutcome::Owned(_))));

    cluster.replicas[0].pause_writes(Duration::from_secs(60));
    proxy.arm(Cut::AfterScriptReply);
    let claimed = store.claim(request(&s)).await;
    assert_eq!(proxy.cuts(), 1, "the connection was cut at the claim");
    assert!(
        matches!(claimed, Err(StoreError::Unavailable(_))),
        "a claim no replica has was answered {claimed:?}: its WAIT counted a connection that wrote nothing"
    );
    cluster.replicas[0].unpause_writes();
    wait_for_link(&cluster.replicas[0]);
    assert!(store.get(&s).await.expect("get").is_none(), "an unacknowledged claim must not hold its key");
    assert!(matches!(store.claim(request(&s)).await, Ok(ClaimOutcome::Owned(_))), "the retry owns the key");
}

/// The complete script ran and its reply was lost (the connection cut instead of it): the cluster
/// client sends it again, and the second run finds the record completed already. That is the
/// caller's own completion, not a newer attempt's: before the fix it was `Fenced`, answered
/// without any `WAIT` (the layer then answers the response as final). Now it is acknowledged
/// once the replica has it, and not acknowledged while the replica lags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_sent_again_after_its_reply_was_lost_is_the_callers_own() {
    let Some(cluster) = cluster_with_replicas().await else { return };
    let proxy = tokio::task::block_in_place(|| cluster.proxy_primary(0));
    let store = store_with(&cluster.url(), &support::unique_prefix(), 1).await;
    let (warm, a, b) = tokio::task::block_in_place(|| {
        let key = || key_on(&cluster, &store, proxy.port);
        (key(), key(), key())
    });
    // The complete script cached on the node: the cut falls on its run, not on a `NOSCRIPT`.
    let ClaimOutcome::Owned(cw) = store.claim(request(&warm)).await.expect("claim") else { panic!("owned") };
    store.complete(&cw, &response(), request(&warm).expires_at).await.expect("complete");
    let ClaimOutcome::Owned(ca) = store.claim(request(&a)).await.expect("claim a") else { panic!("owned") };
    let ClaimOutcome::Owned(cb) = store.claim(request(&b)).await.expect("claim b") else { panic!("owned") };

    proxy.arm(Cut::InsteadOfScriptReply);
    let completed = store.complete(&ca, &response(), request(&a).expires_at).await;
    assert_eq!(proxy.cuts(), 1, "the completion's reply was cut");
    assert!(completed.is_ok(), "a completion sent again was answered {completed:?}");
    let stored = store.get(&a).await.expect("get").expect("record");
    assert_eq!(stored.response, Some(response()));

    // The same while the replica lags: the completion sent again waits for it, in vain.
    cluster.replicas[0].pause_writes(Duration::from_secs(60));
    proxy.arm(Cut::InsteadOfScriptReply);
    let completed = store.complete(&cb, &response(), request(&b).expires_at).await;
    assert_eq!(proxy.cuts(), 2, "the second completion's reply was cut");
    assert!(not_acknowledged(&completed), "a completion no replica has was answered {completed:?}");
    cluster.replicas[0].unpause_writes();
}

/// A store connected to a server with `noeviction`; the policy changes to `allkeys-lru` and the
/// store's connections are killed (`CLIENT KILL`), so the client makes new ones. The first
/// transition that reaches the server again is refused, with an error that names the policy;
/// once the policy is `noeviction` again, transitions run again. Before the fix the policy was
/// read at connect only, and the claims after the reconnect ran on the evicting server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eviction_policy_is_read_again_when_a_connection_is_made_again() {
    if !support::have_redis_binaries() {
        support::skip::<()>("redis-server is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start_server(dir.path(), &["--maxmemory-policy", "noeviction"]);
    let store = RedisStore::connect(&node.url()).await.expect("noeviction is accepted");
    assert!(matches!(store.claim(request(&scope())).await, Ok(ClaimOutcome::Owned(_))));

    let mut admin = node.connection();
    let set = |con: &mut ::redis::Connection, policy: &str| {
        ::redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg(policy).exec(con).expect("config set");
    };
    set(&mut admin, "allkeys-lru");
    let killed: i64 = ::redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"][..])
        .query(&mut admin)
        .expect("client kill");
    assert!(killed >= 1, "the store's connections were killed");

    // Calls that meet the killed connection fail as unavailable; the first that reaches the
    // server on a new connection must be refused for the policy.
    let mut refusal = None;
    for _ in 0..20 {
        match store.claim(request(&scope())).await {
            Ok(outcome) => panic!("a claim ran on a server that evicts, after a new connection: {outcome:?}"),
            Err(e) if ErrorChain(&e).to_string().contains("allkeys-lru") => {
                refusal = Some(ErrorChain(&e).to_string());
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let refusal = refusal.expect("no refusal for the evicting policy after 20 claims");
    assert!(refusal.contains("noeviction"), "the refusal says what to set: {refusal}");

    set(&mut admin, "noeviction");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.claim(request(&scope())).await {
            Ok(ClaimOutcome::Owned(_)) => break,
            other => assert!(Instant::now() < deadline, "no claim 30 s after noeviction was back: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
