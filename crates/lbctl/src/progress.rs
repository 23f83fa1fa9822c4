//! The progress of a long-running operation on stderr: an indicatif spinner with the operation's
//! id, state and elapsed time when stderr is a terminal, else one plain line per state change (a
//! log or a CI job gets the story without a line per poll).

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use leasebroker_client::{Operation, OperationId, OperationState};

use crate::one_line;

/// The spinner on screen, if any: [`crate::warn`] prints above it instead of through it.
static ACTIVE: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Prints `line` to stderr, above the spinner when one is drawn.
pub(crate) fn eprint_line(line: &str) {
    let active = ACTIVE.lock().ok().and_then(|bar| bar.clone());
    match active {
        Some(bar) => bar.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Display {
    /// A spinner redrawn in place.
    Spinner,
    /// One line per state change.
    Lines,
}

impl Display {
    /// A spinner on a terminal that can draw one, plain lines anywhere else.
    pub(crate) fn for_stderr() -> Display {
        let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
        if std::io::stderr().is_terminal() && !dumb { Display::Spinner } else { Display::Lines }
    }
}

/// The progress of one operation being followed.
pub(crate) struct Progress {
    start: Instant,
    bar: Option<ProgressBar>,
    last: Option<OperationState>,
}

impl Progress {
    /// Starts showing the progress of `id`.
    pub(crate) fn start(id: &OperationId, display: Display) -> Progress {
        let bar = (display == Display::Spinner).then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
                bar.set_style(style);
            }
            bar.set_message(format!("{id}: waiting for its state"));
            bar.enable_steady_tick(Duration::from_millis(100));
            if let Ok(mut active) = ACTIVE.lock() {
                *active = Some(bar.clone());
            }
            bar
        });
        Progress { start: Instant::now(), bar, last: None }
    }

    /// One observed state of the operation (one poll).
    pub(crate) fn observe(&mut self, op: &Operation) {
        let text = describe(op);
        match &self.bar {
            Some(bar) => bar.set_message(text),
            None if self.last.as_ref() != Some(&op.state) => {
                eprint_line(&format!("lbctl: {text} ({:.1}s)", self.start.elapsed().as_secs_f64()));
            }
            None => {}
        }
        self.last = Some(op.state.clone());
    }

    /// The operation has ended as `op` says: the spinner gives way to one final line.
    pub(crate) fn finish(self, op: &Operation) {
        let Some(bar) = &self.bar else { return };
        // Cleared, then printed as a plain line: a finished bar leaves the cursor on its own line,
        // and the JSON on stdout would run on after it.
        bar.finish_and_clear();
        eprintln!("lbctl: {} ({:.1}s)", describe(op), self.start.elapsed().as_secs_f64());
    }
}

impl Drop for Progress {
    /// Ends the spinner on every path (an error mid-wait too), so the reason line lands on a
    /// clean line.
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            if !bar.is_finished() {
                bar.abandon();
            }
            if let Ok(mut active) = ACTIVE.lock() {
                *active = None;
            }
        }
    }
}

/// `op-5f1c2a firmware-flash node-0007 -> 2.1.0: running`, with the error when it failed. Text
/// from the server: made one safe line by the caller.
fn describe(op: &Operation) -> String {
    let mut text = format!("{} {} {} -> {}: {}", op.id, op.kind, op.node_id, op.version, op.state);
    if let Some(error) = &op.error {
        text.push_str(" (");
        text.push_str(error);
        text.push(')');
    }
    one_line(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_described_in_one_safe_line() {
        let op: Operation = serde_json::from_value(serde_json::json!({
            "id": "op-1", "kind": "firmware-flash", "node_id": "node-0007", "version": "2.1.0\u{1b}[2J",
            "state": "failed", "error": "BMC said\nno", "created_at": "2026-11-30T21:00:00Z",
            "finished_at": "2026-11-30T21:00:03Z",
        }))
        .unwrap();
        assert_eq!(describe(&op), "op-1 firmware-flash node-0007 -> 2.1.0[2J: failed (BMC said no)");
    }
}
