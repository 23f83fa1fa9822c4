//! The outcome rules of docs/protocol.md#gateway on the real binary: what the client gets, what the record
//! becomes, and how often the upstream (by its own count) executed.

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::support::{Lang, Upstream, admin, gateway, send, until_executed, until_settled, uuid_like};

/// A `--config` file with `text` in a temporary directory (kept alive by the returned guard).
fn config_file(text: &str) -> (testkit::TempDir, String) {
    let dir = testkit::tempdir().expect("tempdir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, text).expect("write the config");
    let path = path.to_str().expect("UTF-8").to_owned();
    (dir, path)
}

/// The uncertain records the admin API lists.
async fn uncertain_ids(gw: &testkit::Proc) -> Vec<String> {
    let page = admin(gw, Method::GET, "/admin/v1/records?state=uncertain", None).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let records = page.json()["records"].as_array().cloned().unwrap_or_default();
    records.iter().map(|r| r["id"].as_str().expect("an id").to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_is_down_gets_502_and_the_retry_forwards_again() {
    let gw = gateway(&testkit::closed_url(), "memory", &[]);
    let key = uuid_like();
    for attempt in 0..2 {
        let answer = send(&gw.url, "/orders", &key, "{}", &[]).await;
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY, "attempt {attempt}: {}", answer.body);
        assert_eq!(answer.problem(), "upstream-unavailable");
        assert!(answer.header("retry-after").is_some());
    }
    let stored = admin(&gw, Method::GET, "/admin/v1/records?state=completed", None).await;
    assert_eq!(stored.json()["records"], json!([]), "nothing stored");
    assert!(uncertain_ids(&gw).await.is_empty(), "never reached is not uncertain");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_5xx_is_released_and_the_retry_runs_again_with_the_same_key() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let key = uuid_like();
    let failed = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-status", "503")]).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE, "the upstream's own 5xx");
    let retried = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{}", retried.body);
    assert_eq!(retried.header("idempotent-replayed"), None, "run again, not replayed");
    let counts = upstream.counts().await;
    assert_eq!(counts["executions"], 2);
    let by_key = counts["by_key"].as_object().expect("by key");
    assert_eq!(by_key.len(), 1, "the retry carries the same derived key: {by_key:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_upstream_gets_504_then_the_retry_is_held_until_an_operator_deletes_the_record() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &["--upstream-timeout", "1s"]);
    let key = uuid_like();
    let slow = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-delay-ms", "2500")]).await;
    assert_eq!((slow.status, slow.problem().as_str()), (StatusCode::GATEWAY_TIMEOUT, "outcome-uncertain"));
    let held = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!((held.status, held.problem().as_str()), (StatusCode::CONFLICT, "outcome-uncertain"));
    let ids = uncertain_ids(&gw).await;
    assert_eq!(ids.len(), 1);
    assert!(held.json()["detail"].as_str().is_some_and(|d| d.contains(&ids[0])), "names the record: {}", held.body);
    assert_eq!(upstream.executions().await, 1, "held: never forwarded again on a guess");

    // "It did not happen": the next retry runs.
    let deleted = admin(&gw, Method::DELETE, &format!("/admin/v1/records/{}", ids[0]), None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{}", deleted.body);
    let ran = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(ran.status, StatusCode::CREATED, "{}", ran.body);
    assert_eq!(upstream.executions().await, 2);
    let metrics = crate::support::client()
        .get(format!("{}/metrics", testkit::gateway::admin_url(&gw)))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(metrics.contains("idempotency_requests_total{outcome=\"uncertain\"} 2"), "{metrics}");
    assert!(metrics.contains("idempotency_gateway_upstream_errors_total{kind=\"timeout\"} 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reset_after_the_work_is_uncertain_and_an_operators_response_is_replayed() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let key = uuid_like();
    let reset = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-reset", "1")]).await;
    assert_eq!((reset.status, reset.problem().as_str()), (StatusCode::GATEWAY_TIMEOUT, "outcome-uncertain"));
    let held = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!((held.status, held.problem().as_str()), (StatusCode::CONFLICT, "outcome-uncertain"));
    let ids = uncertain_ids(&gw).await;
    let what = json!({"status": 201, "headers": {"content-type": "application/json"}, "body": "{\"order\":1}"});
    let path = format!("/admin/v1/records/{}/response", ids[0]);
    let resolved = admin(&gw, Method::PUT, &path, Some(what.clone())).await;
    assert_eq!(resolved.status, StatusCode::NO_CONTENT, "{}", resolved.body);
    for _ in 0..2 {
        let replayed = send(&gw.url, "/orders", &key, "{}", &[]).await;
        assert_eq!((replayed.status, replayed.body.as_str()), (StatusCode::CREATED, "{\"order\":1}"));
        assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    }
    // A record that is no longer uncertain takes no response.
    let again = admin(&gw, Method::PUT, &path, Some(what)).await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
    assert_eq!(upstream.executions().await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_route_whose_5xx_may_have_acted_makes_it_uncertain() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let (_dir, file) = config_file("[[route]]\nmatch = \"POST /charges\"\nuncertain-on-5xx = true\n");
    let gw = gateway(upstream.url(), "memory", &["--config", &file]);
    let key = uuid_like();
    let failed = send(&gw.url, "/charges", &key, "{}", &[("x-upstream-status", "500")]).await;
    assert_eq!((failed.status, failed.problem().as_str()), (StatusCode::GATEWAY_TIMEOUT, "outcome-uncertain"));
    let held = send(&gw.url, "/charges", &key, "{}", &[]).await;
    assert_eq!((held.status, held.problem().as_str()), (StatusCode::CONFLICT, "outcome-uncertain"));
    assert_eq!(upstream.executions().await, 1);
    // Other routes keep the rule: a 5xx is released.
    let other = uuid_like();
    send(&gw.url, "/orders", &other, "{}", &[("x-upstream-status", "500")]).await;
    assert_eq!(send(&gw.url, "/orders", &other, "{}", &[]).await.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread")]
async fn resend_forwards_again_with_the_same_key_to_an_upstream_that_deduplicates() {
    let upstream = Upstream::start(Lang::Node, &["--dedupe"]);
    let (_dir, file) = config_file("[[route]]\nmatch = \"POST /payments\"\non-uncertain = \"resend\"\n");
    let gw = gateway(upstream.url(), "memory", &["--config", &file]);
    let key = uuid_like();
    let lost = send(&gw.url, "/payments", &key, "{}", &[("x-upstream-reset", "1")]).await;
    assert_eq!(lost.status, StatusCode::GATEWAY_TIMEOUT, "{}", lost.body);
    let resent = send(&gw.url, "/payments", &key, "{}", &[]).await;
    assert_eq!(resent.status, StatusCode::CREATED, "{}", resent.body);
    assert_eq!(resent.json()["order"], 1, "the upstream's first (deduplicated) answer");
    let counts = upstream.counts().await;
    assert_eq!(counts["executions"], 1, "the upstream deduplicated the resend: {counts}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_probe_finds_the_lost_answer_and_it_is_replayed() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let toml = "[[route]]\nmatch = \"POST /orders\"\nprobe = \"GET /orders/by-key/{key}\"\n";
    let (_dir, file) = config_file(toml);
    let gw = gateway(upstream.url(), "memory", &["--config", &file]);
    let key = uuid_like();
    let lost = send(&gw.url, "/orders", &key, r#"{"sku":"p"}"#, &[("x-upstream-reset", "1")]).await;
    assert_eq!(lost.status, StatusCode::GATEWAY_TIMEOUT, "{}", lost.body);
    for _ in 0..2 {
        let found = send(&gw.url, "/orders", &key, r#"{"sku":"p"}"#, &[]).await;
        // The probe's own status (200), where the lost answer was a 201.
        assert_eq!(found.status, StatusCode::OK, "{}", found.body);
        assert_eq!(found.json()["body"], r#"{"sku":"p"}"#, "the upstream's record of the request");
        assert_eq!(found.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(upstream.executions().await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_probe_that_finds_nothing_forwards_the_request_again() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let toml = "[[route]]\nmatch = \"POST /orders\"\nprobe = \"GET /orders/by-key/{key}\"\nuncertain-on-5xx = true\n";
    let (_dir, file) = config_file(toml);
    let gw = gateway(upstream.url(), "memory", &["--config", &file]);
    let key = uuid_like();
    // A 5xx that did nothing, on a route where a 5xx may have acted: uncertain.
    let failed = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-skip", "1"), ("x-upstream-status", "500")]).await;
    assert_eq!(failed.status, StatusCode::GATEWAY_TIMEOUT, "{}", failed.body);
    let ran = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(ran.status, StatusCode::CREATED, "{}", ran.body);
    assert_eq!(upstream.executions().await, 1, "the probe said it never happened, so it ran once");
}

/// A gateway killed while its request is at the upstream: its claim goes stale and the record
/// is uncertain (the gateway's rule), never run again on a guess.
#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_killed_mid_request_leaves_the_record_uncertain() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let dir = testkit::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let flags = ["--in-flight-ttl", "1s", "--retention", "1h"];
    let mut first = gateway(upstream.url(), &store, &flags);
    let key = uuid_like();
    let url = first.url.clone();
    let k = key.clone();
    let pending = tokio::spawn(async move {
        crate::support::client()
            .post(format!("{url}/orders"))
            .header("authorization", crate::support::TOKEN)
            .header("idempotency-key", format!("\"{k}\""))
            .header("content-type", "application/json")
            .header("x-upstream-delay-ms", "3000")
            .body("{}")
            .send()
            .await
    });
    until_executed(&upstream, 1).await;
    first.sigkill();
    assert!(pending.await.expect("the task").is_err(), "the killed gateway answers nothing");
    let second = gateway(upstream.url(), &store, &flags);
    let held = until_settled(&second.url, "/orders", &key, "{}").await;
    assert_eq!((held.status, held.problem().as_str()), (StatusCode::CONFLICT, "outcome-uncertain"), "{}", held.body);
    assert_eq!(upstream.executions().await, 1);
    let ids = uncertain_ids(&second).await;
    assert_eq!(ids.len(), 1);
    let deleted = admin(&second, Method::DELETE, &format!("/admin/v1/records/{}", ids[0]), None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{}", deleted.body);
    assert_eq!(send(&second.url, "/orders", &key, "{}", &[]).await.status, StatusCode::CREATED);
    assert_eq!(upstream.executions().await, 2, "run once more after the operator said it did not happen");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_outage_answers_503_and_forwards_nothing() {
    if !testkit::redis::have_redis_binaries() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
        eprintln!("SKIPPED: the store outage test: redis-server is not installed");
        return;
    }
    let dir = testkit::tempdir().expect("tempdir");
    let redis = testkit::redis::start_server(dir.path(), &[]);
    let upstream = Upstream::start(Lang::Node, &[]);
    let gw = gateway(upstream.url(), &redis.url(), &[]);
    assert_eq!(send(&gw.url, "/orders", &uuid_like(), "{}", &[]).await.status, StatusCode::CREATED);
    redis.kill();
    let down = send(&gw.url, "/orders", &uuid_like(), "{}", &[]).await;
    assert_eq!((down.status, down.problem().as_str()), (StatusCode::SERVICE_UNAVAILABLE, "store-unavailable"));
    assert!(down.header("retry-after").is_some());
    let ready = crate::support::client()
        .get(format!("{}/readyz", testkit::gateway::admin_url(&gw)))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE, "not ready without its store");
    assert_eq!(upstream.executions().await, 1, "nothing forwarded while the store is down");
}

/// `lbctl records` speaks to the gateway's admin listener as to leasebroker's.
#[tokio::test(flavor = "multi_thread")]
async fn lbctl_lists_and_forgets_the_gateways_records() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let key = uuid_like();
    let lost = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-reset", "1")]).await;
    assert_eq!(lost.status, StatusCode::GATEWAY_TIMEOUT, "{}", lost.body);
    let admin_url = testkit::gateway::admin_url(&gw);
    let lbctl = |args: &[&str]| {
        let out = testkit::LBCTL
            .command()
            .args(["--url", &admin_url, "--token", crate::support::ADMIN_TOKEN])
            .args(args)
            .output()
            .expect("run lbctl");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, listed, err) = lbctl(&["records", "list", "--state", "uncertain", "--quiet"]);
    assert_eq!(code, Some(0), "{err}");
    let ids: Vec<&str> = listed.lines().collect();
    assert_eq!(ids, uncertain_ids(&gw).await, "the one uncertain record");
    let (code, _, err) = lbctl(&["records", "forget", ids[0]]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(send(&gw.url, "/orders", &key, "{}", &[]).await.status, StatusCode::CREATED, "forgotten: it runs");
    assert_eq!(upstream.executions().await, 2);
}

/// An answer whose body starts and never ends: the outcome is unknown (the service acted, its
/// answer is incomplete), nothing incomplete is stored.
#[tokio::test(flavor = "multi_thread")]
async fn an_answer_that_never_ends_is_uncertain_and_nothing_partial_is_stored() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &["--upstream-timeout", "1s"]);
    let key = uuid_like();
    let stalled = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-stall", "1")]).await;
    assert_eq!((stalled.status, stalled.problem().as_str()), (StatusCode::GATEWAY_TIMEOUT, "outcome-uncertain"));
    let held = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!((held.status, held.problem().as_str()), (StatusCode::CONFLICT, "outcome-uncertain"));
    let stored = admin(&gw, Method::GET, "/admin/v1/records?state=completed", None).await;
    assert_eq!(stored.json()["records"], json!([]), "no partial answer stored");
    assert_eq!(upstream.executions().await, 1);
}
