//! The table's rows: which runs each ratio compares, and the goal it has to meet.

use super::parts::{commit_rows, gateway_rows, layer_cost, partition_ratios, push_create_rows, wait_rows};
use super::{Goal, Key, Ratio, Runs, key};

const CONNS: [u32; 3] = [1, 16, 64];

pub(super) fn ratios(runs: &Runs) -> Vec<Ratio> {
    let mut out = layer_rows(runs);
    out.extend(layer_cost(runs));
    out.extend(wait_rows(runs));
    out.extend(gateway_rows(runs));
    out.extend(floor_rows(runs));
    out.extend(redis_rows(runs));
    out.extend(replication_rows(runs));
    out.extend(sweeper_and_size_rows(runs));
    out.extend(partition_ratios(runs));
    out.extend(commit_rows(runs));
    out.extend(e2e_rows(runs));
    out.extend(scale_rows(runs));
    push_create_rows(runs, &mut out);
    out
}

/// Part `layer`: the layer on each store against the bare handler and axum-idempotent.
fn layer_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    for case in ["first", "replay"] {
        for c in CONNS {
            let k = |v: &str| key("layer", case, c, v);
            let at = format!("{case}, {c} conn");
            push(runs.ratio(
                "layer",
                format!("layer+memory / bare ({at})"),
                "rps",
                &k("memory"),
                &k("bare"),
                Some(Goal::AtLeast(0.85)),
            ));
            push(runs.ratio(
                "layer",
                format!("layer+memory / axum-idempotent ({at})"),
                "rps",
                &k("memory"),
                &k("peer"),
                Some(Goal::AtLeast(1.0)),
            ));
            for (v, name) in [("sqlite", "layer+SQLite"), ("postgres", "layer+PostgreSQL"), ("peer", "axum-idempotent")]
            {
                push(runs.ratio("layer", format!("{name} / bare ({at})"), "rps", &k(v), &k("bare"), None));
            }
            push(runs.ratio(
                "layer",
                format!("p99: layer+memory / bare ({at})"),
                "p99_us",
                &k("memory"),
                &k("bare"),
                None,
            ));
        }
    }
    out
}

/// Part `floor`: the PostgreSQL store and the layer against pgbench doing the same SQL.
fn floor_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    let f = |case: &str, v: &str| key("floor", case, 16, v);
    // Against pgbench running the same statements: its lookup (replay) and its script (first).
    for (what, case, variant, goal) in [
        ("replay: store direct / pgbench lookup", "replay", "store", Some(0.8)),
        ("replay: store direct, default pool 10 / pgbench lookup", "replay", "store-pool10", None),
        ("replay: layer over HTTP (wrk, hot key) / pgbench lookup", "replay", "layer", Some(0.7)),
        ("first: store direct claim+complete / pgbench script", "first", "store", Some(0.7)),
        ("first: store direct, default pool 10 / pgbench script", "first", "store-pool10", None),
        ("first: layer over HTTP (wrk) / pgbench script", "first", "layer", Some(0.7)),
    ] {
        let goal = goal.map(Goal::AtLeast);
        push(runs.ratio("floor", what.into(), "rps", &f(case, variant), &f(case, "pgbench"), goal));
    }
    // The replay cache: one hot key from 64 connections, against pgbench's lookup and against
    // the same layer reading the store for every replay.
    let hot = |v: &str| key("floor", "replay-hot", 64, v);
    push(runs.ratio(
        "floor",
        "replay: layer over HTTP with the replay cache (wrk, hot key, 64 conns) / pgbench lookup".into(),
        "rps",
        &hot("layer"),
        &f("replay", "pgbench"),
        Some(Goal::AtLeast(1.5)),
    ));
    push(runs.ratio(
        "floor",
        "replay, hot key, 64 conns: the layer with the replay cache / without it".into(),
        "rps",
        &hot("layer"),
        &hot("layer-nocache"),
        None,
    ));
    push(runs.ratio(
        "floor",
        "replay, hot key, 64 conns: database transactions per 100 replays, with the replay cache / without it".into(),
        "xacts_per_100",
        &hot("layer"),
        &hot("layer-nocache"),
        Some(Goal::AtMost(0.01)),
    ));
    for case in ["replay", "first"] {
        push(runs.ratio(
            "floor",
            format!("{case}: store, sqlx's default ping on every checkout / the stores' pool (no ping)"),
            "rps",
            &f(case, "store-ping"),
            &f(case, "store"),
            None,
        ));
    }
    for case in ["replay", "first"] {
        push(runs.ratio(
            "floor",
            format!("{case}: store through a multi-host URL (follows the primary) / one host"),
            "rps",
            &f(case, "store-multihost"),
            &f(case, "store"),
            None,
        ));
    }
    push(runs.ratio(
        "floor",
        "first: store sending the `Prefer: wait` announcements / without them".to_owned(),
        "rps",
        &f("first", "store"),
        &f("first", "store-quiet"),
        None,
    ));
    for (case, at) in [("replay", "10k keys"), ("replay-hot", "one hot key")] {
        push(runs.ratio(
            "floor",
            format!("replay ({at}): SeedUpsert / InsertOrRead"),
            "rps",
            &f(case, "seed"),
            &f(case, "store"),
            None,
        ));
        push(runs.ratio(
            "floor",
            format!("replay ({at}) WAL bytes/op: SeedUpsert / InsertOrRead"),
            "wal_bytes_per_op",
            &f(case, "seed"),
            &f(case, "store"),
            None,
        ));
    }
    out
}

/// Part `redis`: the Redis store against redis-benchmark running its scripts.
fn redis_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    let r = |case: &str, v: &str| key("redis", case, 16, v);
    push(runs.ratio(
        "redis",
        "replay: Redis store direct / redis-benchmark (its claim script, one completed key)".into(),
        "rps",
        &r("replay", "store"),
        &r("replay", "redis-benchmark"),
        Some(Goal::AtLeast(0.7)),
    ));
    push(runs.ratio(
        "redis",
        "first: Redis store direct claim+complete / redis-benchmark (its claim, then complete, scripts)".into(),
        "rps",
        &r("first", "store"),
        &r("first", "redis-benchmark"),
        Some(Goal::AtLeast(0.7)),
    ));
    for case in ["replay", "first"] {
        push(runs.ratio(
            "redis",
            format!("{case}: Redis store direct / PostgreSQL store direct"),
            "rps",
            &r(case, "store"),
            &r(case, "postgres-store"),
            None,
        ));
    }
    out
}

/// Part `replication` (issue 28): the price of waiting for a replica, as a ratio of
/// throughputs (below 1: slower with the wait).
fn replication_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    let rep = |case: &str, v: &str| key("replication", case, 16, v);
    for case in ["first", "replay"] {
        push(runs.ratio(
            "replication",
            format!("{case}: PostgreSQL store, synchronous / asynchronous replication (Patroni)"),
            "rps",
            &rep(case, "pg-sync"),
            &rep(case, "pg-async"),
            None,
        ));
        push(runs.ratio(
            "replication",
            format!("{case}: Redis Cluster store, WAIT 1 replica / no wait"),
            "rps",
            &rep(case, "redis-wait1"),
            &rep(case, "redis-nowait"),
            None,
        ));
    }
    out
}

/// Parts `sweeper` (a claim's p99 while the sweeper runs) and `size` (a record's bytes).
fn sweeper_and_size_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    push(runs.ratio(
        "sweeper",
        "claim p99: sweeping / idle".into(),
        "p99_us",
        &key("sweeper", "claim", 0, "sweeping"),
        &key("sweeper", "claim", 0, "idle"),
        Some(Goal::AtMost(2.0)),
    ));
    push(runs.ratio(
        "size",
        "bytes per record (1 KiB JSON): compressed / raw".into(),
        "total_bytes_per_record",
        &key("size", "", 0, "compressed"),
        &key("size", "", 0, "raw"),
        None,
    ));
    out
}

/// Part `e2e`: leasebroker, replays against creates.
fn e2e_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    for db in ["sqlite", "postgres"] {
        let e = |case: &str| key("e2e", case, 16, db);
        push(runs.ratio(
            "e2e",
            format!("leasebroker on {db}: replays/s / creates/s"),
            "rps",
            &e("replay"),
            &e("create"),
            None,
        ));
    }
    out
}

/// Part `scale` (issue 16, goal 4): the largest table against the smallest, and the pool at 50%
/// and 99% allocated against empty.
fn scale_rows(runs: &Runs) -> Vec<Ratio> {
    let mut out = Vec::new();
    let mut push = |r: Option<Ratio>| out.extend(r);
    for (case, what) in [
        ("replay", "replay"),
        ("first", "first execution"),
        ("create", "leasebroker create"),
        ("create-sqlite", "leasebroker on SQLite create"),
    ] {
        let sizes: Vec<(u64, &Key)> = runs
            .0
            .keys()
            .filter(|k| k.0 == "scale" && k.1 == case)
            .filter_map(|k| Some((k.3.parse::<u64>().ok()?, k)))
            .collect();
        let Some(&(low, base)) = sizes.iter().min_by_key(|s| s.0) else { continue };
        let unit = if case.starts_with("create") { "% allocated" } else { " records" };
        for &(n, k) in sizes.iter().filter(|s| s.0 != low) {
            for (metric, goal) in [("p50_us", Some(Goal::AtMost(1.5))), ("p99_us", None)] {
                let name = if metric == "p50_us" { "p50" } else { "p99" };
                push(runs.ratio("scale", format!("{what} {name}: {n}{unit} / {low}{unit}"), metric, k, base, goal));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::report::parts::scale_plans;

    #[test]
    fn scale_rows_compare_each_size_with_the_smallest() {
        let mut runs = Runs(BTreeMap::new());
        for (n, p50) in [("10000000", 900.0), ("10000", 600.0), ("1000000", 700.0)] {
            runs.0.entry(key("scale", "replay", 8, n)).or_default().insert(1, json!({ "p50_us": p50, "p99_us": 1.0 }));
        }
        runs.0
            .entry(key("scale", "create", 4, "0"))
            .or_default()
            .insert(1, json!({ "p50_us": 10.0, "plan": "Seq Scan" }));
        runs.0
            .entry(key("scale", "create", 4, "99"))
            .or_default()
            .insert(1, json!({ "p50_us": 20.0, "plan": "Index" }));
        let rows = ratios(&runs);
        let find = |what: &str| rows.iter().find(|r| r.what == what).unwrap_or_else(|| panic!("no row {what:?}"));
        let r = find("replay p50: 10000000 records / 10000 records");
        assert_eq!((r.ratio, r.met), (1.5, Some(true)));
        assert_eq!(find("leasebroker create p50: 99% allocated / 0% allocated").met, Some(false));
        assert!(!rows.iter().any(|r| r.what.contains("/ 1000000")), "only the smallest size is the base");
        let plans = scale_plans(&runs);
        assert!(
            plans.contains("- PostgreSQL, 0% allocated: `Seq Scan`")
                && plans.contains("- PostgreSQL, 99% allocated: `Index`"),
            "{plans}"
        );
    }

    #[test]
    fn the_layer_is_compared_with_the_json_handler_and_by_instructions() {
        let mut runs = Runs(BTreeMap::new());
        for (variant, rps) in [("memory", 80.0), ("json", 100.0)] {
            runs.0.entry(key("layer", "replay", 64, variant)).or_default().insert(1, json!({ "rps": rps }));
        }
        for (variant, n, without) in
            [("memory", 40_000.0, 30_000.0), ("json", 25_000.0, 25_000.0), ("bare", 20_000.0, 20_000.0)]
        {
            let m = json!({ "instructions_per_request": n, "instructions_per_request_without_sha256": without });
            runs.0.entry(key("instr", "first", 4, variant)).or_default().insert(1, m);
        }
        let rows = layer_cost(&runs);
        let find = |what: &str| rows.iter().find(|r| r.what == what).unwrap_or_else(|| panic!("no row {what:?}"));
        let json = find("layer+memory / Json handler (replay, 64 conn)");
        assert_eq!((json.ratio, json.met), (0.8, Some(false)));
        assert_eq!(find("instructions/request: layer+memory / Json handler (first)").ratio, 1.6);
        assert_eq!(find("instructions/request: layer+memory / bare (first)").ratio, 2.0);
        let without = find("instructions/request without SHA-256 blocks: layer+memory / Json handler (first)");
        assert_eq!((without.ratio, without.met), (1.2, Some(true)), "the goal is 1.25");
        // Rounds that measured nothing make no row.
        assert!(rows.iter().all(|r| !r.what.contains("(first, 16 conn)")));
    }

    #[test]
    fn the_gateway_is_compared_with_nginx_and_with_the_layer_in_process() {
        let mut runs = Runs(BTreeMap::new());
        for (case, variant, rps, p99) in [
            ("first", "gateway-memory", 75.0, 3000.0),
            ("first", "nginx", 100.0, 2000.0),
            ("replay", "gateway-memory", 90.0, 1000.0),
            ("replay", "nginx", 100.0, 2000.0),
            ("first", "gateway-postgres", 40.0, 9000.0),
            ("first", "layer-postgres", 50.0, 6000.0),
        ] {
            runs.0
                .entry(key("gateway", case, 16, variant))
                .or_default()
                .insert(1, json!({ "rps": rps, "p99_us": p99 }));
        }
        let rows = ratios(&runs);
        let find = |what: &str| rows.iter().find(|r| r.what == what).unwrap_or_else(|| panic!("no row {what:?}"));
        let first = find("gateway+memory / nginx (first, 16 conn)");
        assert_eq!((first.ratio, first.met), (0.75, Some(true)), "the goal for first executions is 0.7");
        let replay = find("gateway+memory / nginx (replay, 16 conn)");
        assert_eq!((replay.ratio, replay.met), (0.9, Some(false)), "a replay has to beat forwarding");
        let pg = find("gateway+PostgreSQL / layer+PostgreSQL in process (first, 16 conn)");
        assert_eq!((pg.ratio, pg.met), (0.8, Some(true)));
        let p99 = find("p99: gateway+memory / nginx (first, 16 conn)");
        assert_eq!((p99.metric, p99.ratio, p99.goal.is_none()), ("p99_us", 1.5, true));
        // Variants that did not run make no row.
        assert!(!rows.iter().any(|r| r.what.contains("SQLite") || r.what.contains("64 conn")));
    }

    #[test]
    fn prefer_wait_is_judged_by_its_p99_and_the_announcements_against_polling() {
        let mut runs = Runs(BTreeMap::new());
        for (variant, p50, p99) in [("memory", 0.1, 4.0), ("postgres", 1.0, 12.0), ("postgres-polling", 50.0, 100.0)] {
            let m = json!({ "p50_ms": p50, "p99_ms": p99, "goal_ms": 10.0 });
            runs.0.entry(key("wait", "retry", 1, variant)).or_default().insert(1, m);
        }
        let rows = super::super::parts::wait_rows(&runs);
        let find =
            |what: &str| rows.iter().find(|r| r.what.contains(what)).unwrap_or_else(|| panic!("no row {what:?}"));
        let memory = find("(memory, same process)");
        assert_eq!((memory.a, memory.ratio, memory.met), (4.0, 0.4, Some(true)));
        let announced = find("(PostgreSQL, another replica, announced)");
        assert_eq!((announced.a, announced.met), (12.0, Some(false)));
        assert_eq!(find("p50: PostgreSQL announced / polled").ratio, 0.02);
    }
}
