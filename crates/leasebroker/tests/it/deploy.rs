//! Issue 30: what `deploy/` ships is checked here: the alert rules pass `promtool check rules`
//! and their unit tests (`promtool test rules`, one test per alert); the rules and the Grafana
//! dashboard name only metrics the code exports (and those a short session makes appear on the
//! real binary's /metrics page do); the systemd unit and the container image start `serve` with
//! flags it accepts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::support::{TOKEN, send, serve, sqlite_url};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `promtool`, or `None` after a loud SKIPPED line (a failure under `CI=true`).
fn promtool() -> Option<&'static str> {
    if Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Some("promtool");
    }
    let message = "promtool is missing (Debian package `prometheus`; scripts/install-test-tools installs it)";
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
    eprintln!("SKIPPED: {message}");
    None
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let dir = repo().join("deploy/prometheus");
    for args in [["check", "rules", "leasebroker-alerts.yml"], ["test", "rules", "leasebroker-alerts.test.yml"]] {
        let out = Command::new(promtool).args(args).current_dir(&dir).output().expect("run promtool");
        assert!(
            out.status.success(),
            "promtool {args:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // One unit test per alert.
    let rules = read("deploy/prometheus/leasebroker-alerts.yml");
    let tests = read("deploy/prometheus/leasebroker-alerts.test.yml");
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert_eq!(alerts.len(), 7, "{alerts:?}");
    for alert in alerts {
        let fired = format!("alertname: {alert}\n        exp_alerts:\n          - exp_labels:");
        assert!(tests.contains(&fired), "no unit test where {alert} fires");
    }
}

/// The metric names a PromQL text uses (histogram series by their family name).
fn metric_names(text: &str) -> BTreeSet<String> {
    let re = regex::Regex::new(r"\b(?:idempotency|leasebroker)_[a-z_]+").expect("regex");
    re.find_iter(text)
        .map(|m| {
            let name = m.as_str();
            ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name).to_owned()
        })
        .collect()
}

/// Every metric name the code declares: string literals in the crates' sources.
fn declared_names() -> BTreeSet<String> {
    let re = regex::Regex::new(r#""((?:idempotency|leasebroker)_[a-z_]+)""#).expect("regex");
    let mut names = BTreeSet::new();
    let mut dirs = vec![repo().join("crates")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir").map_while(Result::ok) {
            let path = entry.path();
            let tests_or_target = path.file_name().is_some_and(|n| n == "tests" || n == "target");
            if path.is_dir() && !tests_or_target {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read source");
                names.extend(re.captures_iter(&text).map(|c| c[1].to_owned()));
            }
        }
    }
    names
}

#[tokio::test]
async fn the_rules_and_the_dashboard_name_only_metrics_the_service_exports() {
    let rules = metric_names(&read("deploy/prometheus/leasebroker-alerts.yml"));
    let dashboard: Value = serde_json::from_str(&read("deploy/grafana/leasebroker-dashboard.json")).expect("JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    let panels = metric_names(&exprs.join("\n"));
    let declared = declared_names();
    for name in rules.iter().chain(&panels) {
        assert!(declared.contains(name), "{name} is not a metric the code declares ({declared:?})");
    }

    // A short session on the real binary: a create, then mutating requests over the rate limit.
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--rate-limit", "1", "--rate-limit-burst", "1", "--sweep-interval", "1s"]);
    let created = crate::support::create(&lb.url, TOKEN, "deploy-1", &crate::support::worker_body()).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let deadline = Instant::now() + Duration::from_secs(60);
    for n in 0.. {
        let url = format!("{}/v1/workers/wkr-none/reboot", lb.url);
        let r = send(Method::POST, &url, TOKEN, Some(&format!("deploy-flood-{n}")), None).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert!(Instant::now() < deadline, "no 429 within a minute at --rate-limit 1");
    }
    // The gauges the alerts read appear once the reaper has ticked (every second here).
    let wanted = [
        r#"leasebroker_http_responses_total{code="429"}"#,
        r#"leasebroker_http_responses_total{code="201"}"#,
        r#"idempotency_requests_total{outcome="executed"}"#,
        "idempotency_store_duration_seconds_bucket{",
        "leasebroker_reaper_backlog_operations 0",
        "leasebroker_records_stuck_in_flight 0",
    ];
    loop {
        let page = reqwest::get(format!("{}/metrics", lb.url)).await.expect("metrics").text().await.expect("text");
        let missing: Vec<&str> = wanted.into_iter().filter(|w| !page.lines().any(|l| l.starts_with(w))).collect();
        if missing.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{missing:?} not on /metrics:\n{page}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 45: every counter an alert reads with `increase(...)` or `rate(...)` is on `/metrics` at
/// zero from the start, so the first event after a start is an increase Prometheus can see (a
/// series that appears at 1 has no earlier sample to increase from). So are the other counters of
/// what went wrong and was cleaned up: records swept, each kind of rollback.
#[tokio::test]
async fn the_counters_alerts_read_are_on_metrics_at_zero_from_the_start() {
    let rules = read("deploy/prometheus/leasebroker-alerts.yml");
    let re = regex::Regex::new(r"(?:increase|rate)\(\s*([a-z_]+)(\{[^}]*\})?\[").expect("regex");
    let mut wanted: Vec<String> =
        re.captures_iter(&rules).map(|c| format!("{}{}", &c[1], c.get(2).map_or("", |m| m.as_str()))).collect();
    assert!(wanted.len() >= 3, "{wanted:?}");
    wanted.push("idempotency_records_swept_total".into());
    for resource in ["operation", "vm", "lease", "node"] {
        wanted.push(format!(r#"leasebroker_reaper_rolled_back_total{{resource="{resource}"}}"#));
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let page = reqwest::get(format!("{}/metrics", lb.url)).await.expect("metrics").text().await.expect("text");
    for series in &wanted {
        // `name value`, or `name{labels} value` whose labels include the wanted ones.
        let (name, labels) =
            series.split_once('{').map_or((series.as_str(), ""), |(n, l)| (n, l.trim_end_matches('}')));
        let line = page.lines().find(|l| {
            let Some(rest) = l.strip_prefix(name) else { return false };
            if labels.is_empty() {
                rest.starts_with(' ') || rest.starts_with('{')
            } else {
                rest.starts_with('{')
                    && labels.split(',').all(|m| rest.split('}').next().unwrap_or_default().contains(m.trim()))
            }
        });
        let line = line.unwrap_or_else(|| panic!("{series} is not on /metrics of a fresh server:\n{page}"));
        assert!(line.ends_with(" 0"), "{series} starts at zero: {line}");
    }
}

/// The words of a command line (no quoting is used in these files).
fn words(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_owned).collect()
}

#[test]
fn the_systemd_unit_and_the_container_image_start_serve_with_flags_it_accepts() {
    let unit = read("deploy/systemd/leasebroker.service");
    let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart");
    let mut argv = words(exec);
    assert_eq!(argv[0], "/usr/local/bin/leasebroker");
    argv[0] = "leasebroker".to_owned();

    let image = read("deploy/Containerfile");
    let json_array = |prefix: &str| -> Vec<String> {
        let line = image.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("{prefix}"));
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{prefix} is not a JSON array: {e}"))
    };
    let container: Vec<String> = json_array("ENTRYPOINT ").into_iter().chain(json_array("CMD ")).collect();
    assert_eq!(container[0], "leasebroker");

    for argv in [argv, container] {
        let cli = leasebroker::config::Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        let leasebroker::config::Command::Serve(args) = cli.command else { panic!("{argv:?} does not serve") };
        assert!(args.database.as_str().starts_with("sqlite:///var/lib/leasebroker/"), "{argv:?}");
    }
    assert!(unit.contains("EnvironmentFile=") && !unit.contains("--token"), "tokens come from the environment file");
}
