//! Forwarding and the protocol through the real gateway, counted by the upstreams themselves.

use futures::future::join_all;
use reqwest::StatusCode;

use crate::support::{Answer, Lang, TOKEN, Upstream, client, gateway, post, send, uuid_like};

/// 32 identical keyed requests at once through one gateway: the upstream executes one, and every
/// client gets its answer (the others replayed).
async fn thirty_two_at_once_execute_once(lang: Lang) {
    let upstream = Upstream::start(lang, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let key = uuid_like();
    let slow = [("x-upstream-delay-ms", "300"), ("prefer", "wait=30")];
    let answers = join_all((0..32).map(|_| post(&gw.url, "/orders", &key, r#"{"sku":"a"}"#, &slow))).await;
    let answers = join_all(answers.into_iter().map(Answer::of)).await;
    assert_eq!(upstream.executions().await, 1, "{lang:?}: one execution for one key");
    let first = &answers[0].body;
    for a in &answers {
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        assert_eq!(&a.body, first, "every client gets the one answer");
    }
    let replayed = answers.iter().filter(|a| a.header("idempotent-replayed") == Some("true")).count();
    assert_eq!(replayed, 31);
}

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_identical_requests_run_once_in_python() {
    thirty_two_at_once_execute_once(Lang::Python).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn thirty_two_identical_requests_run_once_in_node() {
    thirty_two_at_once_execute_once(Lang::Node).await;
}

/// Two gateway replicas on the store at `store`: 32 identical keyed requests spread over both
/// execute once, and every client gets the answer.
async fn two_replicas_run_a_key_once(store: &str) {
    let upstream = Upstream::start(Lang::Python, &[]);
    let a = gateway(upstream.url(), store, &[]);
    let b = gateway(upstream.url(), store, &[]);
    let key = uuid_like();
    let slow = [("x-upstream-delay-ms", "300"), ("prefer", "wait=30")];
    let sent = (0..32).map(|i| {
        let url = if i % 2 == 0 { &a.url } else { &b.url };
        post(url, "/orders", &key, "{}", &slow)
    });
    let answers = join_all(join_all(sent).await.into_iter().map(Answer::of)).await;
    assert_eq!(upstream.executions().await, 1, "two replicas on {store} behave as one gateway");
    assert!(answers.iter().all(|a| a.status == StatusCode::CREATED), "every client gets the answer");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_on_one_postgres_run_a_key_once() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    two_replicas_run_a_key_once(pg.url()).await;
}

/// Two replicas on one PostgreSQL, each with its replay cache (on by default): replays on the
/// second come from its copy, and a forget through the first's admin listener reaches that copy
/// within a second: the key then runs again on the second, where a stale copy would replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_forget_on_one_replica_reaches_the_replay_cache_of_another() {
    let Some(pg) = testkit::postgres::TestDatabase::create().await else { return };
    let upstream = Upstream::start(Lang::Python, &[]);
    let (a, b) = (gateway(upstream.url(), pg.url(), &[]), gateway(upstream.url(), pg.url(), &[]));
    let key = uuid_like();
    let first = send(&a.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    for _ in 0..5 {
        let replayed = send(&b.url, "/orders", &key, "{}", &[]).await;
        assert_eq!((replayed.status, replayed.header("idempotent-replayed")), (StatusCode::CREATED, Some("true")));
    }
    assert_eq!(upstream.executions().await, 1);
    let listed = crate::support::admin(&a, reqwest::Method::GET, "/admin/v1/records?state=completed", None).await;
    let records = listed.json()["records"].as_array().expect("records").clone();
    let id = records.iter().find(|r| r["key"] == key.as_str()).expect("the key's record")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let forgot = crate::support::admin(&a, reqwest::Method::DELETE, &format!("/admin/v1/records/{id}"), None).await;
    assert!(forgot.status.is_success(), "{} {}", forgot.status, forgot.body);

    // The bound on a forget reaching another replica's copy.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let again = send(&b.url, "/orders", &key, "{}", &[]).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (StatusCode::CREATED, None), "{}", again.body);
    assert_eq!(upstream.executions().await, 2, "the forgotten key ran again on the other replica");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_upstream_gets_the_request_as_a_proxy_sends_it() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let key = uuid_like();
    let extra = [("connection", "x-hop"), ("x-hop", "1"), ("x-kept", "yes")];
    let answer = send(&gw.url, "/orders?x=1", &key, "{}", &extra).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
    assert_eq!(answer.json()["path"], "/orders?x=1");
    let counts = upstream.counts().await;
    let last = &counts["last"];
    assert_eq!(last["authorization"], TOKEN, "Authorization is passed on");
    assert_eq!(last["x-kept"], "yes");
    assert!(last.get("x-hop").is_none(), "a header named by Connection is hop-by-hop: {last}");
    assert_eq!(last["x-forwarded-for"], "127.0.0.1");
    assert_eq!(last["x-forwarded-proto"], "http");
    assert!(last["forwarded"].as_str().is_some_and(|f| f.starts_with("for=127.0.0.1;proto=http")), "{last}");
    let forwarded = last["idempotency-key"].as_str().expect("a forwarded key");
    assert!(forwarded.starts_with("\"sk-") && !forwarded.contains(&key), "derived, not the client's: {forwarded}");

    // The same key under other credentials is another record, and another forwarded key.
    let other = client()
        .post(format!("{}/orders?x=1", gw.url))
        .header("authorization", "Bearer client-b")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("answer");
    assert_eq!(other.status(), StatusCode::CREATED);
    let counts = upstream.counts().await;
    assert_eq!(counts["executions"], 2, "two principals never share a record");
    assert_ne!(counts["last"]["idempotency-key"].as_str(), Some(forwarded));
}

#[tokio::test(flavor = "multi_thread")]
async fn forward_key_original_and_none() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let original = gateway(upstream.url(), "memory", &["--forward-key", "original"]);
    let key = uuid_like();
    send(&original.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(upstream.counts().await["last"]["idempotency-key"], format!("\"{key}\""));
    let none = gateway(upstream.url(), "memory", &["--forward-key", "none"]);
    send(&none.url, "/orders", &key, "{}", &[]).await;
    let counts = upstream.counts().await;
    assert!(counts["last"].get("idempotency-key").is_none(), "{counts}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_protocol_answers_before_anything_is_forwarded() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);

    // No key: 400, not forwarded.
    let res = client().post(format!("{}/orders", gw.url)).header("authorization", TOKEN).body("{}").send().await;
    let missing = Answer::of(res.expect("answer")).await;
    assert_eq!((missing.status, missing.problem().as_str()), (StatusCode::BAD_REQUEST, "idempotency-key-missing"));

    // No principal: 401, not forwarded.
    let res = client().post(format!("{}/orders", gw.url)).header("idempotency-key", "\"k\"").body("{}").send().await;
    let anonymous = Answer::of(res.expect("answer")).await;
    assert_eq!((anonymous.status, anonymous.problem().as_str()), (StatusCode::UNAUTHORIZED, "principal-missing"));
    assert_eq!(upstream.executions().await, 0, "nothing was forwarded");

    // The same key with another body: 409 idempotency-key-reused, not forwarded.
    let key = uuid_like();
    assert_eq!(send(&gw.url, "/orders", &key, r#"{"n":1}"#, &[]).await.status, StatusCode::CREATED);
    let reused = send(&gw.url, "/orders", &key, r#"{"n":2}"#, &[]).await;
    assert_eq!((reused.status, reused.problem().as_str()), (StatusCode::CONFLICT, "idempotency-key-reused"));
    // The same request again: replayed.
    let again = send(&gw.url, "/orders", &key, r#"{"n":1}"#, &[]).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert!(again.header("idempotency-key-expires").is_some());
    assert_eq!(upstream.executions().await, 1);

    // GET passes through untouched, keyless.
    let get = client().get(format!("{}/orders/by-key/nothing", gw.url)).send().await.expect("answer");
    assert_eq!(get.status(), StatusCode::NOT_FOUND, "the upstream's own answer");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_response_is_streamed_and_replayed_without_its_body() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let gw = gateway(upstream.url(), "memory", &["--max-stored-response", "1KiB"]);
    let key = uuid_like();
    let first = send(&gw.url, "/orders", &key, "{}", &[("x-upstream-size", "200000")]).await;
    assert_eq!((first.status, first.body.len()), (StatusCode::CREATED, 200_000), "the whole body, streamed");
    let replay = send(&gw.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.header("idempotency-body-omitted"), Some("true"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert!(replay.header("location").is_some_and(|l| l.starts_with("/orders/")), "replayable headers kept");
    assert_eq!(replay.body, "");
    assert_eq!(upstream.executions().await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn http2_clients_are_served() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    let h2 = reqwest::Client::builder().http2_prior_knowledge().build().expect("client");
    let res = h2
        .post(format!("{}/orders", gw.url))
        .header("authorization", TOKEN)
        .header("idempotency-key", format!("\"{}\"", uuid_like()))
        .body("{}")
        .send()
        .await
        .expect("an HTTP/2 answer");
    assert_eq!((res.version(), res.status()), (reqwest::Version::HTTP_2, StatusCode::CREATED));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_admin_listener_reports_health_and_metrics() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &[]);
    send(&gw.url, "/orders", &uuid_like(), "{}", &[]).await;
    let admin = testkit::gateway::admin_url(&gw);
    for path in ["/healthz", "/readyz"] {
        let res = client().get(format!("{admin}{path}")).send().await.expect("answer");
        assert_eq!(res.status(), StatusCode::OK, "{path}");
    }
    let metrics = client().get(format!("{admin}/metrics")).send().await.expect("answer").text().await.expect("text");
    assert!(metrics.contains("idempotency_requests_total{outcome=\"executed\"} 1"), "{metrics}");
    assert!(metrics.contains("idempotency_gateway_upstream_duration_seconds"), "{metrics}");
    // The records API needs the token.
    let res = client().get(format!("{admin}/admin/v1/records")).send().await.expect("answer");
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    // Nothing is proxied on the admin listener.
    let res = client().post(format!("{admin}/orders")).send().await.expect("answer");
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
}

/// A CA and a server certificate for 127.0.0.1 it issued, as PEM files in `dir`: (CA, cert, key).
fn ca_and_server_cert(dir: &std::path::Path) -> [String; 3] {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "gateway test CA");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("key");
    let params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
    let cert = params.signed_by(&key, &issuer).expect("leaf");
    let files = [("ca.pem", ca_cert.pem()), ("server.pem", cert.pem()), ("server.key", key.serialize_pem())];
    files.map(|(name, pem)| {
        let path = dir.join(name);
        std::fs::write(&path, pem).expect("write");
        path.to_str().expect("UTF-8").to_owned()
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn an_https_upstream_is_verified_against_the_given_ca() {
    let dir = testkit::tempdir().expect("tempdir");
    let [ca, cert, key] = ca_and_server_cert(dir.path());
    let upstream = Upstream::start(Lang::Python, &["--tls-cert", &cert, "--tls-key", &key]);
    let https = upstream.url().replacen("http://", "https://", 1);

    let trusting = gateway(&https, "memory", &["--upstream-ca-cert", &ca]);
    let answer = send(&trusting.url, "/orders", &uuid_like(), "{}", &[]).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);

    // Without the CA the certificate is not trusted: never reached, nothing sent.
    let distrusting = gateway(&https, "memory", &[]);
    let refused = send(&distrusting.url, "/orders", &uuid_like(), "{}", &[]).await;
    assert_eq!((refused.status, refused.problem().as_str()), (StatusCode::BAD_GATEWAY, "upstream-unavailable"));
    let counts = client().get(format!("{https}/__count")).send().await;
    assert!(counts.is_err(), "the test's own client does not trust the CA either");
    assert_eq!(answer.json()["order"], 1, "one execution, through the trusting gateway");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trusted_header_names_the_principal_and_a_large_body_is_refused() {
    let upstream = Upstream::start(Lang::Python, &[]);
    let gw = gateway(upstream.url(), "memory", &["--principal", "header:x-user", "--max-body", "1KiB"]);
    let key = uuid_like();
    let keyed = |user: Option<&str>, body: String| {
        let mut req = client()
            .post(format!("{}/orders", gw.url))
            .header("idempotency-key", format!("\"{key}\""))
            .header("authorization", TOKEN)
            .body(body);
        if let Some(user) = user {
            req = req.header("x-user", user);
        }
        async move { Answer::of(req.send().await.expect("answer")).await }
    };
    // Authorization alone is no principal under header:x-user.
    let anonymous = keyed(None, "{}".to_owned()).await;
    assert_eq!((anonymous.status, anonymous.problem().as_str()), (StatusCode::UNAUTHORIZED, "principal-missing"));
    assert_eq!(keyed(Some("alice"), "{}".to_owned()).await.status, StatusCode::CREATED);
    // Another principal, the same key: its own record.
    assert_eq!(keyed(Some("bob"), "{}".to_owned()).await.header("idempotent-replayed"), None);
    let large = keyed(Some("carol"), "x".repeat(2048)).await;
    assert_eq!((large.status, large.problem().as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "body-too-large"));
    assert_eq!(upstream.executions().await, 2, "alice's and bob's; nothing else was forwarded");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_a_forwarded_request_finish_and_store_its_answer() {
    let upstream = Upstream::start(Lang::Node, &[]);
    let mut gw = gateway(upstream.url(), "memory", &[]);
    let url = gw.url.clone();
    let key = uuid_like();
    let k = key.clone();
    let pending =
        tokio::spawn(async move { send(&url, "/orders", &k, "{}", &[("x-upstream-delay-ms", "1000")]).await });
    crate::support::until_executed(&upstream, 1).await;
    assert_eq!(gw.sigterm_and_wait(), Some(0), "a drained shutdown exits 0");
    let answer = pending.await.expect("the task");
    assert_eq!(answer.status, StatusCode::CREATED, "the request in flight was answered: {}", answer.body);
}

/// Two gateway replicas on one Redis Cluster (three primaries the test starts).
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_on_one_redis_cluster_run_a_key_once() {
    if !testkit::redis::have_redis_binaries() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "redis-server is missing, and CI=true");
        eprintln!("SKIPPED two_replicas_on_one_redis_cluster_run_a_key_once: redis-server is not installed");
        return;
    }
    let cluster = tokio::task::spawn_blocking(testkit::redis::Cluster::start).await.expect("the cluster starts");
    two_replicas_run_a_key_once(&cluster.url()).await;
}
