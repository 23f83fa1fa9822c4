//! "Every operation ends, and a rerun answers the original": an operation whose client gave up
//! (or failed otherwise) is sent again with its key once the faults are over, as its caller
//! would; it must complete then, and where the service had stored a response for the key, the
//! rerun must be answered that response.

use super::{Damage, Invariant};
use crate::workload::Rerun;

/// The name of the invariant on operations that never completed.
pub const NOT_COMPLETED: &str =
    "operations that gave up or failed, and did not complete when sent again with their key";
/// The name of the invariant on the reruns' answers.
pub const NOT_THE_STORED_ANSWER: &str = "reruns not answered the response stored for their key";

/// Checks the reruns of the `failed` operations that gave up or failed.
pub fn check_reruns(failed: u64, reruns: &[Rerun], damage: &mut Damage, invariants: &mut Vec<Invariant>) {
    let completed = reruns.iter().filter(|r| r.completed).count() as u64;
    damage.failed_ops_not_completed = failed.saturating_sub(completed);
    damage.reruns_not_stored_answer = reruns.iter().filter(|r| r.matched == Some(false)).count() as u64;
    for (name, actual) in
        [(NOT_COMPLETED, damage.failed_ops_not_completed), (NOT_THE_STORED_ANSWER, damage.reruns_not_stored_answer)]
    {
        invariants.push(Invariant { name: name.to_owned(), expected: 0, actual, at_most: false, ok: actual == 0 });
    }
}
