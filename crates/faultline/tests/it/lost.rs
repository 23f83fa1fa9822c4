//! Issue 28: what a failover (or anything else) lost after it was acknowledged. Every key a
//! success was answered for must still have its completed record at the end (read from the
//! admin records listing by key). The check can fail: records deleted behind the service's back
//! are counted and listed by key.

use crate::support::{SERIAL, invariant, num, run, run_faultline};

/// The invariant's name in the report.
pub(crate) const RECORDS_LOST: &str = "acknowledged records lost (2xx answered, record gone or not completed)";

#[test]
fn records_deleted_behind_the_services_back_are_reported_lost() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (code, report) = run_faultline(&[
        "--no-naive",
        "--ops",
        "60",
        "--concurrency",
        "4",
        "--client-faults",
        "0",
        "--lbctl-share",
        "0.3",
        // A deleted flash request's record would also leave its flash without an operation.
        "--flashes",
        "0",
        "--drop-acknowledged",
        "3",
        "--max-duration",
        "150s",
    ]);
    assert_eq!(code, 1, "a protected run that lost acknowledged records fails");
    assert_eq!(report["protected_passed"], false);
    let protected = run(&report, "protected");
    // Every success's key was noted, through the SDK and through lbctl alike.
    assert!(num(protected, &["outcomes", "via_lbctl"]) > 0, "no operation ran through lbctl");
    assert_eq!(num(protected, &["acknowledged"]), num(protected, &["outcomes", "succeeded"]));
    let lost = invariant(protected, RECORDS_LOST);
    assert_eq!((lost["actual"].as_i64(), lost["ok"].as_bool()), (Some(3), Some(false)), "{lost}");
    assert_eq!(num(protected, &["damage", "acknowledged_records_lost"]), 3);
    let listed = protected["records_lost"].as_array().expect("records_lost");
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed.iter().all(|l| l.as_str().is_some_and(|l| l.ends_with(": gone"))), "{listed:?}");
    // Only that is broken: the rest of the run held.
    let broken: Vec<&str> = protected["invariants"]
        .as_array()
        .expect("invariants")
        .iter()
        .filter(|i| i["ok"] != true)
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(broken, [RECORDS_LOST], "{:#}", protected["invariants"]);
}
