//! Issue 45, item 14: an operation whose client spends its retry budget is sent again with its
//! key once the faults are over (the SDK's key, lbctl's `--op-id`), as a real caller would; the
//! rerun must complete, and where the service had stored a response for the key it must answer
//! that response. The report says why each operation gave up, attempt by attempt: when, to which
//! replica, what that replica was doing then, what came of it.

use serde_json::Value;

use crate::support::{SERIAL, broken, invariant, num, run, run_faultline};

const NOT_COMPLETED: &str = "operations that gave up or failed, and did not complete when sent again with their key";
const NOT_THE_STORED_ANSWER: &str = "reruns not answered the response stored for their key";

fn strings(v: &Value) -> Vec<&str> {
    v.as_array().expect("an array").iter().map(|s| s.as_str().expect("a string")).collect()
}

/// The one replica is killed and kept down for 5 s, past the 2 s budget of every operation then
/// in flight, and 60% of the client connections are faulted: operations give up, some after the
/// service completed them (their response lost, or held past the attempt's timeout). Each is
/// rerun with its key: it completes, and those whose response was stored are answered it
/// (replayed), so the worker a create's client gave up on is not a phantom either.
#[test]
fn operations_that_gave_up_are_rerun_with_their_key_and_answered_what_was_stored() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "60",
        "--concurrency",
        "8",
        "--client-faults",
        "0.6",
        "--server-kills",
        "1",
        "--server-down",
        "5s",
        "--op-max-elapsed",
        "2s",
        "--lbctl-share",
        "0.3",
        "--max-duration",
        "200s",
    ]);
    let protected = run(&report, "protected");
    let broken = broken(protected);
    assert!(broken.is_empty(), "protected run broke invariants: {broken:#?}\ngave up: {:#}", protected["gave_up"]);
    assert_eq!(code, 0, "faultline exits 0 when every operation that gave up completed on its rerun");

    // Operations gave up, each was rerun and completed.
    let failed = num(protected, &["outcomes", "failed"]);
    assert!(failed > 0, "no operation gave up: {}", protected["outcomes"]);
    assert_eq!(num(protected, &["outcomes", "rerun_completed"]), failed);
    let gave_up = protected["gave_up"].as_array().expect("gave_up");
    assert_eq!(gave_up.len() as i64, failed.min(50));
    for name in [NOT_COMPLETED, NOT_THE_STORED_ANSWER] {
        let i = invariant(protected, name);
        assert_eq!((i["actual"].as_i64(), i["ok"].as_bool()), (Some(0), Some(true)), "{i}");
    }
    assert!(gave_up.iter().all(|g| g["completed"] == true), "{gave_up:#?}");

    // Some had their response stored before the rerun, and the rerun was answered it.
    let stored: Vec<&Value> =
        gave_up.iter().filter(|g| g["stored_before"].as_str().is_some_and(|s| s.starts_with("completed"))).collect();
    assert!(!stored.is_empty(), "no operation gave up after the service completed it: {gave_up:#?}");
    for g in &stored {
        assert_eq!(g["matched"], true, "{g:#}");
        assert!(g["answer"].as_str().is_some_and(|a| a.contains("(replayed)")), "{g:#}");
    }

    // Why: attempt by attempt, with the replica's state. The kill and the restart are on the
    // timeline, 5 s apart at least, and attempts sent meanwhile are said to meet a replica down.
    let timeline = strings(&protected["timeline"]);
    assert!(timeline.iter().any(|l| l.ends_with("replica 0 killed (SIGKILL)")), "{timeline:?}");
    assert!(timeline.iter().any(|l| l.contains("replica 0 ready again")), "{timeline:?}");
    let attempts: Vec<&str> = gave_up.iter().flat_map(|g| strings(&g["attempts"])).collect();
    assert!(gave_up.iter().all(|g| !strings(&g["attempts"]).is_empty()), "an operation without attempts: {gave_up:#?}");
    assert!(
        attempts.iter().any(|a| a.contains(" replica 0 [down since +") && a.contains("reset")),
        "no attempt is said to have met the replica down: {attempts:#?}"
    );
    assert_eq!(num(protected, &["setup", "server_down_ms"]), 5000);
    assert_eq!(num(protected, &["setup", "op_max_elapsed_ms"]), 2000);
    // Nothing duplicated: the reruns made no second worker.
    for field in ["phantom_workers", "lost_workers", "extra_boots", "extra_reboots"] {
        assert_eq!(num(protected, &["damage", field]), 0, "protected {field}");
    }
}
