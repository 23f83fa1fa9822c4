//! What happened to the replicas and the database during a run, and when: the server-side half of
//! the diagnostics that say why an operation gave up. Each attempt of an operation is noted with
//! its time and its replica ([`AttemptNote`]); [`Timeline::state_of`] says what that replica was
//! doing then (up, killed and not yet ready again, paused) and whether the database was down.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Something the run did to a replica or to the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Happening {
    /// Replica `0` was sent SIGKILL.
    Killed(usize),
    /// Replica `replica` printed its `listening on` line again, after `failed_starts` processes
    /// that exited (or never got ready) first; the last one's reason.
    Ready {
        /// Which replica.
        replica: usize,
        /// Processes started in vain before this one.
        failed_starts: u32,
        /// Why the last of those did not start.
        last_failure: Option<String>,
    },
    /// Replica `0` was stopped with SIGSTOP.
    Paused(usize),
    /// Replica `0` was continued with SIGCONT.
    Resumed(usize),
    /// The database was stopped.
    DatabaseStopped,
    /// The database accepts connections again.
    DatabaseStarted,
}

impl fmt::Display for Happening {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Happening::Killed(r) => write!(f, "replica {r} killed (SIGKILL)"),
            Happening::Ready { replica, failed_starts: 0, .. } => write!(f, "replica {replica} ready again"),
            Happening::Ready { replica, failed_starts, last_failure } => write!(
                f,
                "replica {replica} ready again after {failed_starts} start(s) that failed (the last: {})",
                last_failure.as_deref().unwrap_or("no reason")
            ),
            Happening::Paused(r) => write!(f, "replica {r} paused (SIGSTOP)"),
            Happening::Resumed(r) => write!(f, "replica {r} resumed (SIGCONT)"),
            Happening::DatabaseStopped => f.write_str("database stopped"),
            Happening::DatabaseStarted => f.write_str("database started again"),
        }
    }
}

/// What a replica was doing at some moment of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// Running (as far as the run knows).
    Up,
    /// Killed at `since`, not ready again yet (or never).
    Down {
        /// When it was killed.
        since: Duration,
    },
    /// Stopped with SIGSTOP at `since`.
    Paused {
        /// When it was stopped.
        since: Duration,
    },
}

/// The run's happenings, each at its offset from the start of the run's workload.
#[derive(Debug)]
pub struct Timeline {
    start: Instant,
    events: Mutex<Vec<(Duration, Happening)>>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// An empty timeline starting now.
    pub fn new() -> Self {
        Timeline { start: Instant::now(), events: Mutex::new(Vec::new()) }
    }

    /// The time since the start.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// Notes `what`, now.
    pub fn note(&self, what: Happening) {
        self.note_at(self.now(), what);
    }

    /// Notes `what` at `at` (kept in time order).
    pub fn note_at(&self, at: Duration, what: Happening) {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let place = events.partition_point(|(t, _)| *t <= at);
        events.insert(place, (at, what));
    }

    /// What replica `replica` was doing at `at`, and since when the database had been down
    /// (`None`: it was up).
    pub fn state_of(&self, replica: usize, at: Duration) -> (ReplicaState, Option<Duration>) {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let mut state = ReplicaState::Up;
        let mut database_down = None;
        for (t, what) in events.iter().take_while(|(t, _)| *t <= at) {
            match what {
                Happening::Killed(r) if *r == replica => state = ReplicaState::Down { since: *t },
                Happening::Paused(r) if *r == replica => state = ReplicaState::Paused { since: *t },
                Happening::Ready { replica: r, .. } | Happening::Resumed(r) if *r == replica => {
                    state = ReplicaState::Up;
                }
                Happening::DatabaseStopped => database_down = Some(*t),
                Happening::DatabaseStarted => database_down = None,
                _ => {}
            }
        }
        (state, database_down)
    }

    /// The happenings, one line each (`+12.3s replica 0 killed (SIGKILL)`).
    pub fn lines(&self) -> Vec<String> {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events.iter().map(|(t, what)| format!("{} {what}", offset(*t))).collect()
    }
}

/// `+12.3s`.
pub fn offset(t: Duration) -> String {
    format!("+{:.1}s", t.as_secs_f64())
}

/// One attempt of an operation: when it ended, which replica it was sent to, what came of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptNote {
    /// When it ended, from the start of the workload.
    pub at: Duration,
    /// The replica (the index of its proxy).
    pub replica: usize,
    /// What came of it: the status, or the error.
    pub outcome: String,
}

impl AttemptNote {
    /// The note as the report shows it: `+51.2s replica 1 [down since +49.0s]: reset ...`.
    pub fn describe(&self, timeline: &Timeline) -> String {
        let (state, database_down) = timeline.state_of(self.replica, self.at);
        let mut context = match state {
            ReplicaState::Up => Vec::new(),
            ReplicaState::Down { since } => vec![format!("down since {}", offset(since))],
            ReplicaState::Paused { since } => vec![format!("paused since {}", offset(since))],
        };
        if let Some(since) = database_down {
            context.push(format!("database down since {}", offset(since)));
        }
        let context = if context.is_empty() { String::new() } else { format!(" [{}]", context.join(", ")) };
        format!("{} replica {}{context}: {}", offset(self.at), self.replica, self.outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_replica_is_down_from_its_kill_to_its_next_start_and_paused_until_resumed() {
        let timeline = Timeline::new();
        timeline.note_at(secs(10.0), Happening::Killed(1));
        timeline.note_at(secs(4.0), Happening::Paused(0));
        timeline.note_at(secs(8.0), Happening::Resumed(0));
        timeline.note_at(secs(30.0), Happening::Ready { replica: 1, failed_starts: 2, last_failure: None });
        timeline.note_at(secs(12.0), Happening::DatabaseStopped);
        timeline.note_at(secs(15.0), Happening::DatabaseStarted);

        assert_eq!(timeline.state_of(1, secs(9.9)), (ReplicaState::Up, None));
        assert_eq!(timeline.state_of(1, secs(10.0)), (ReplicaState::Down { since: secs(10.0) }, None));
        assert_eq!(timeline.state_of(1, secs(13.0)), (ReplicaState::Down { since: secs(10.0) }, Some(secs(12.0))));
        assert_eq!(timeline.state_of(1, secs(29.0)), (ReplicaState::Down { since: secs(10.0) }, None));
        assert_eq!(timeline.state_of(1, secs(30.0)), (ReplicaState::Up, None));
        // The other replica's kill is not this one's.
        assert_eq!(timeline.state_of(0, secs(11.0)), (ReplicaState::Up, None));
        assert_eq!(timeline.state_of(0, secs(5.0)), (ReplicaState::Paused { since: secs(4.0) }, None));

        let note = AttemptNote { at: secs(13.0), replica: 1, outcome: "connection reset".into() };
        assert_eq!(
            note.describe(&timeline),
            "+13.0s replica 1 [down since +10.0s, database down since +12.0s]: connection reset"
        );
        let note = AttemptNote { at: secs(31.0), replica: 1, outcome: "201 Created".into() };
        assert_eq!(note.describe(&timeline), "+31.0s replica 1: 201 Created");
        assert_eq!(
            timeline.lines(),
            [
                "+4.0s replica 0 paused (SIGSTOP)",
                "+8.0s replica 0 resumed (SIGCONT)",
                "+10.0s replica 1 killed (SIGKILL)",
                "+12.0s database stopped",
                "+15.0s database started again",
                "+30.0s replica 1 ready again after 2 start(s) that failed (the last: no reason)",
            ]
        );
    }
}
