//! What one operation's client did, attempt by attempt: its key (or lbctl op id), and for each
//! attempt when it ended, which replica it went to and what came of it. Kept for the operations
//! that gave up, so that the report says why and the run can send them again with their key.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use leasebroker_client::Error;
use leasebroker_client::retry::{Attempt, AttemptOutcome};

use crate::timeline::{AttemptNote, Timeline};

/// One operation's key and attempts, shared with the SDK's attempt hook.
#[derive(Debug, Clone, Default)]
pub(super) struct OpLog {
    /// The `Idempotency-Key`, once known (lbctl names it with `-v`).
    pub(super) key: Option<String>,
    /// lbctl's `--op-id` (protected lbctl operations).
    pub(super) op_id: Option<String>,
    attempts: Arc<Mutex<Vec<AttemptNote>>>,
}

impl OpLog {
    fn notes(&self) -> std::sync::MutexGuard<'_, Vec<AttemptNote>> {
        self.attempts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An attempt is about to go to `replica`.
    pub(super) fn sending(&self, replica: usize, timeline: &Timeline) {
        self.notes().push(AttemptNote { at: timeline.now(), replica, outcome: "no answer noted".to_owned() });
    }

    /// The SDK's hook: the last attempt sent ended with `attempt`.
    pub(super) fn ended(&self, attempt: &Attempt<'_>, timeline: &Timeline) {
        if let Some(note) = self.notes().last_mut() {
            note.at = timeline.now();
            note.outcome = match &attempt.outcome {
                AttemptOutcome::Success { status, replayed: true } => format!("{status} (replayed)"),
                AttemptOutcome::Success { status, .. } => status.to_string(),
                AttemptOutcome::Failed(err) => short(err),
                _ => "an outcome faultline does not know".to_owned(),
            };
        }
    }

    /// Notes what one lbctl process run said (`-v`: one `lbctl: attempt N (S.SSs): ...` line per
    /// attempt) for a process started at `started` on `replica`; `ended` describes how the
    /// process ended when faultline ended it.
    pub(super) fn lbctl_run(&self, started: Duration, replica: usize, stderr: &str, ended: Option<&str>) {
        let mut notes = self.notes();
        let mut last = started;
        for (elapsed, outcome) in stderr.lines().filter_map(lbctl_attempt) {
            last = started + elapsed;
            notes.push(AttemptNote { at: last, replica, outcome });
        }
        if let Some(ended) = ended {
            notes.push(AttemptNote { at: last, replica, outcome: ended.to_owned() });
        }
    }

    /// The attempts so far.
    pub(super) fn attempts(&self) -> Vec<AttemptNote> {
        self.notes().clone()
    }
}

/// An lbctl `-v` attempt line: the time since its first attempt and what came of it (the text
/// after the time, without the wait that follows).
fn lbctl_attempt(line: &str) -> Option<(Duration, String)> {
    let rest = line.strip_prefix("lbctl: attempt ")?;
    let (_, rest) = rest.split_once(" (")?;
    let (secs, outcome) = rest.split_once("s): ")?;
    let elapsed = Duration::try_from_secs_f64(secs.parse().ok()?).ok()?;
    let outcome = outcome.rsplit_once("; retrying in ").map_or(outcome, |(o, _)| o);
    // A transport error prints its whole chain: its innermost cause says what happened.
    let outcome = match outcome.strip_prefix("transport error: ") {
        Some(chain) => format!("transport error: {}", chain.rsplit(": ").next().unwrap_or(chain)),
        None => outcome.to_owned(),
    };
    Some((elapsed, shorten(&outcome)))
}

/// What came of an lbctl `-v` attempt line's attempt: `201 Created (replayed)`.
pub(super) fn lbctl_outcome(line: &str) -> Option<String> {
    lbctl_attempt(line).map(|(_, outcome)| outcome)
}

/// The status an lbctl `-v` attempt line shows: `201 Created`, or `refused (404 Not Found): ...`.
pub(super) fn lbctl_status(line: &str) -> Option<u16> {
    let (_, outcome) = lbctl_attempt(line)?;
    let digits = |s: &str| s.get(..3).filter(|d| d.bytes().all(|b| b.is_ascii_digit()))?.parse().ok();
    digits(&outcome).or_else(|| digits(outcome.split_once('(')?.1))
}

/// An error in a line: a transport error by its innermost cause (`Connection reset by peer (os
/// error 104)`, `operation timed out`), the others as they print.
fn short(err: &Error) -> String {
    match err {
        Error::Transport(e) => {
            let mut cause: &dyn std::error::Error = e;
            while let Some(next) = cause.source() {
                cause = next;
            }
            let kind = if e.is_timeout() { "timed out" } else { "transport error" };
            format!("{kind}: {cause}")
        }
        other => shorten(&other.to_string()),
    }
}

/// At most 160 characters of `text`.
fn shorten(text: &str) -> String {
    const MAX: usize = 160;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STDERR: &str = "lbctl: op \"run-op-7\" key 0193a3c2-7b7e-7000-8000-000000000001 (journal j.db)\n\
        lbctl: attempt 1 (0.02s): transport error: error sending request for url (http://127.0.0.1:1/v1/workers): client error (SendRequest): connection error: Connection reset by peer (os error 104); retrying in 0.15s\n\
        lbctl: attempt 2 (1.50s): server error (503 Service Unavailable): store-unavailable: the database is unavailable; retrying in 1.00s\n\
        lbctl: attempt 3 (2.75s): 201 Created (replayed)\n";

    #[test]
    fn an_lbctl_run_is_noted_attempt_by_attempt_at_its_own_times() {
        let log = OpLog::default();
        log.lbctl_run(Duration::from_secs(10), 1, STDERR, None);
        log.lbctl_run(
            Duration::from_secs(20),
            0,
            "lbctl: op \"run-op-7\" key K (journal j.db)\n",
            Some("killed by faultline"),
        );
        let notes = log.attempts();
        let at: Vec<(u128, usize)> = notes.iter().map(|n| (n.at.as_millis(), n.replica)).collect();
        assert_eq!(at, [(10_020, 1), (11_500, 1), (12_750, 1), (20_000, 0)]);
        assert_eq!(notes[0].outcome, "transport error: Connection reset by peer (os error 104)");
        assert_eq!(notes[2].outcome, "201 Created (replayed)");
        assert_eq!(notes[3].outcome, "killed by faultline");
    }

    #[test]
    fn the_status_of_an_attempt_line() {
        let status = |l: &str| lbctl_status(l);
        assert_eq!(status("lbctl: attempt 3 (2.75s): 201 Created (replayed)"), Some(201));
        assert_eq!(status("lbctl: attempt 1 (0.01s): 204 No Content"), Some(204));
        assert_eq!(status("lbctl: attempt 2 (0.30s): refused (404 Not Found): not-found: no such worker"), Some(404));
        assert_eq!(status("lbctl: attempt 1 (0.02s): transport error: reset; retrying in 0.1s"), None);
        assert_eq!(status("lbctl: op \"x\" key K"), None);
    }
}
