//! Bad configurations: the binary exits 2 with one line naming the setting.

use std::process::Command;

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(testkit::GATEWAY);
    cmd.args(args).env_remove("IDEMPOTENCY_GATEWAY_UPSTREAM");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the gateway");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn assert_one_line_naming(args: &[&str], env: &[(&str, &str)], setting: &str) {
    let (code, stderr) = run(args, env);
    assert_eq!(code, Some(2), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: one line: {stderr}");
    assert!(lines[0].contains(setting), "{args:?}: names {setting}: {stderr}");
}

#[test]
fn bad_settings_exit_2_with_one_line_naming_them() {
    let dir = testkit::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("UTF-8").to_owned()
    };
    assert_one_line_naming(&[], &[], "--upstream");
    assert_one_line_naming(&["--upstream", "ftp://h"], &[], "--upstream");
    assert_one_line_naming(&["--upstream", "http://h", "--forward-key", "sideways"], &[], "--forward-key");
    assert_one_line_naming(
        &[],
        &[("IDEMPOTENCY_GATEWAY_UPSTREAM", "http://h"), ("IDEMPOTENCY_GATEWAY_MAX_BODY", "lots")],
        "max-body",
    );
    assert_one_line_naming(
        &["--upstream", "http://h", "--record-store", "mysql://u:secret@h/db"],
        &[],
        "--record-store",
    );
    let (_, stderr) = run(&["--upstream", "http://h", "--record-store", "mysql://u:secret@h/db"], &[]);
    assert!(!stderr.contains("secret"), "a record store's password is never printed: {stderr}");
    let in_file = write("store.toml", "upstream = \"http://h\"\nrecord-store = \"etcd://h\"\n");
    assert_one_line_naming(&["--config", &in_file], &[], "record-store");
    let bad_route = write(
        "route.toml",
        "upstream = \"http://h\"\n[[route]]\nmatch = \"POST /orders/{id}\"\npolicy = \"sometimes\"\n",
    );
    assert_one_line_naming(&["--config", &bad_route], &[], "policy");
    let unknown = write("unknown.toml", "upstream = \"http://h\"\nupstreams = \"http://h\"\n");
    assert_one_line_naming(&["--config", &unknown], &[], "upstreams");
    let template = write("template.toml", "upstream = \"http://h\"\n[[route]]\nmatch = \"POST /orders/{id\"\n");
    assert_one_line_naming(&["--config", &template, "--record-store", "memory"], &[], "match of route 1");
    let probe = write("probe.toml", "[[route]]\nmatch = \"POST /o\"\nprobe = \"GET /o/{key}\"\n");
    assert_one_line_naming(
        &["--config", &probe, "--upstream", "http://h", "--forward-key", "none"],
        &[],
        "probe of route 1",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flag_overrides_the_file_and_the_file_the_defaults() {
    use crate::support::{Lang, Upstream, send, uuid_like};
    let upstream = Upstream::start(Lang::Python, &[]);
    let dir = testkit::tempdir().expect("tempdir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, "forward-key = \"none\"\nupstream-timeout = \"1s\"\n").expect("write");
    let path = path.to_str().expect("UTF-8");
    let key = uuid_like();

    let from_file = testkit::gateway::start(upstream.url(), "memory", &["--config", path]);
    send(&from_file.url, "/orders", &key, "{}", &[]).await;
    assert!(upstream.counts().await["last"].get("idempotency-key").is_none(), "the file's forward-key");

    let flagged = testkit::gateway::start(upstream.url(), "memory", &["--config", path, "--forward-key", "original"]);
    send(&flagged.url, "/orders", &key, "{}", &[]).await;
    assert_eq!(upstream.counts().await["last"]["idempotency-key"], format!("\"{key}\""), "the flag's");
}

/// A route's `retention` is its own: its records are replayed until then and run again after,
/// while the other routes keep the global retention.
#[tokio::test(flavor = "multi_thread")]
async fn a_routes_retention_is_its_own() {
    use crate::support::{Lang, Upstream, send, uuid_like};
    let upstream = Upstream::start(Lang::Python, &[]);
    let dir = testkit::tempdir().expect("tempdir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, "[[route]]\nmatch = \"POST /short\"\nretention = \"2s\"\n").expect("write");
    let path = path.to_str().expect("UTF-8");
    // A retention must be longer than the in-flight TTL (default 5m): a short one for the route.
    let gw = testkit::gateway::start(upstream.url(), "memory", &["--config", path, "--in-flight-ttl", "1s"]);
    let (short, long) = (uuid_like(), uuid_like());
    for (route, key) in [("/short", &short), ("/orders", &long)] {
        assert_eq!(send(&gw.url, route, key, "{}", &[]).await.status, reqwest::StatusCode::CREATED);
        let again = send(&gw.url, route, key, "{}", &[]).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{route}: replayed at once");
    }
    assert_eq!(upstream.executions().await, 2);
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let short_again = send(&gw.url, "/short", &short, "{}", &[]).await;
    assert_eq!(short_again.header("idempotent-replayed"), None, "the route's 2s retention is over: it runs again");
    let long_again = send(&gw.url, "/orders", &long, "{}", &[]).await;
    assert_eq!(long_again.header("idempotent-replayed"), Some("true"), "the global retention still holds");
    assert_eq!(upstream.executions().await, 3);
}
