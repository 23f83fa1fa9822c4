//! Runs the real `faultline` binary against real `leasebroker` and `lbctl` processes: a short run
//! with every fault kind must hold every invariant with protected clients, must really have
//! injected each kind of fault, and must show damage with naive clients.
//!
//! The PostgreSQL variant runs when `TEST_POSTGRES_URL` is set (a server URL on loopback); without
//! it the test says so on stderr and passes, except under `CI=true`, where it fails.

use serde_json::Value;

use crate::support::{SERIAL, num, run};

/// The smoke run's faults, and `extra`.
fn run_faultline(extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["--ops", "150", "--concurrency", "8", "--client-faults", "0.3", "--server-kills", "1"];
    args.extend(["--hv-fail-before", "0.1", "--hv-fail-after", "0.1", "--lbctl-share", "0.2"]);
    // A small share of the slow, refusing and abandoning modes (the full run has more). The
    // abandon window is longer than a faulted client's gap between two attempts (a 503's
    // Retry-After of up to the settle window, rounded up, then an attempt lost to a client
    // fault). With 2 s the reaper once rolled back a create whose client was waiting out that
    // Retry-After, and the retry booted again (one boot more than workers created); the reaper now
    // waits at least the longest Retry-After plus a grace (leasebroker's
    // `effects::the_reaper_waits_out_the_retry_after_the_service_gave`), the 8 s cover the rest.
    args.extend(["--hv-slow", "0.05", "--hv-refuse", "0.05", "--abandon", "0.08", "--abandon-after", "8s"]);
    args.extend(["--flashes", "0.15", "--max-duration", "150s"]);
    args.extend(extra);
    crate::support::run_faultline(&args)
}

fn assert_protected_and_naive(code: i32, report: &Value, replicas: i64) {
    let protected = run(report, "protected");
    let broken: Vec<&Value> =
        protected["invariants"].as_array().expect("invariants").iter().filter(|i| i["ok"] != true).collect();
    assert!(
        broken.is_empty(),
        "protected run broke invariants: {broken:#?}\nwhy operations failed: {:#}\nrefusals: {:#}",
        protected["failures"],
        protected["refusals"]
    );
    assert_eq!(code, 0, "faultline exits 0 when the protected run holds");
    assert_eq!(report["protected_passed"], true);
    assert_eq!(num(protected, &["setup", "replicas"]), replicas);

    // The faults were really injected, each kind.
    for kind in ["never_reached", "response_lost", "gave_up_mid_flight", "client_killed"] {
        assert!(num(protected, &["faults", kind]) > 0, "no {kind} fault was injected: {}", protected["faults"]);
    }
    assert_eq!(num(protected, &["server_kills"]), 1);
    assert!(num(protected, &["attempts"]) > 150, "faults must have caused retries");

    // Nothing duplicated or lost, every operation done.
    for field in ["phantom_workers", "lost_workers", "leaked_leases", "leaked_nodes", "extra_boots", "extra_reboots"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
    assert_eq!(num(protected, &["outcomes", "failed"]), 0);
    // Clients took the abandoning path; whether one hung up before its answer came is a race
    // with the server (a hang-up at 5 to 400 ms), which a fast machine may win every time in one
    // short run (seen once in CI: 0 in the protected run, 8 in the naive one), so the hang-ups
    // are required over both runs.
    assert!(num(protected, &["outcomes", "abandoning"]) > 0, "no client took the abandoning path");
    let abandoned = num(protected, &["outcomes", "abandoned"]);
    assert!(abandoned <= num(protected, &["outcomes", "abandoning"]), "{}", protected["outcomes"]);
    assert_eq!(num(protected, &["outcomes", "succeeded"]) + num(protected, &["outcomes", "refused"]) + abandoned, 150);
    for field in ["leaked_vms", "duplicate_boot_tags", "duplicate_reboot_tags"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
    assert!(num(protected, &["fleet", "workers_active"]) > 0);
    // Firmware flashes: accepted ones ended, none twice, no node bricked.
    assert!(num(protected, &["outcomes", "flashes_ok"]) > 0, "no flash was accepted: {}", protected["outcomes"]);
    for field in ["bricked_nodes", "duplicate_flash_tags", "stuck_operations", "extra_flashes"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }

    // Nothing acknowledged was lost: every key a success was answered for (through the SDK or
    // lbctl) still has its completed record, for the naive clients' keys too.
    let naive = run(report, "naive");
    for r in [protected, naive] {
        let lost = crate::support::invariant(r, crate::lost::RECORDS_LOST);
        assert_eq!((lost["actual"].as_i64(), lost["ok"].as_bool()), (Some(0), Some(true)), "{lost}");
        assert_eq!(num(r, &["acknowledged"]), num(r, &["outcomes", "succeeded"]), "each success's key is known");
    }

    let hung_up = abandoned + num(naive, &["outcomes", "abandoned"]);
    assert!(hung_up > 0, "no abandoning client hung up before its answer, in either run");

    // The naive clients ran into the same faults and paid for it.
    assert!(num(naive, &["faults", "response_lost"]) > 0);
    let damage = num(naive, &["damage", "phantom_workers"])
        + num(naive, &["damage", "extra_boots"])
        + num(naive, &["damage", "extra_reboots"])
        + num(naive, &["damage", "duplicate_boot_tags"])
        + num(naive, &["damage", "duplicate_reboot_tags"]);
    assert!(damage > 0, "naive clients left no phantom or duplicate: {}", naive["damage"]);
    assert_eq!(naive["passed"], false);
}

#[test]
fn sqlite_one_replica_holds_under_faults() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[]);
    assert_protected_and_naive(code, &report, 1);
    assert_eq!(run(&report, "protected")["setup"]["database"], "sqlite");
}

#[test]
fn postgres_two_replicas_hold_under_faults() {
    let Some(url) = std::env::var("TEST_POSTGRES_URL").ok().filter(|u| !u.is_empty()) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "TEST_POSTGRES_URL is not set: the PostgreSQL fault run cannot be skipped under CI"
        );
        eprintln!("SKIPPED postgres_two_replicas_hold_under_faults: set TEST_POSTGRES_URL to run it");
        return;
    };
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&["--postgres", &url, "--replicas", "2"]);
    assert_protected_and_naive(code, &report, 2);
    assert_eq!(run(&report, "protected")["setup"]["database"], "postgres");
}
