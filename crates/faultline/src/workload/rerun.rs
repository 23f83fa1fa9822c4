//! The operations that gave up, sent again once the faults are over, as a real caller would: the
//! SDK's with the same `Idempotency-Key`, lbctl's with the same `--op-id` (its journal holds the
//! key). When the service had stored a response for the key, the rerun must answer that response
//! (a replay: same status, same body); when it had not, the rerun runs the operation, once.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use leasebroker_client::retry::Retrier;
use leasebroker_client::{Error, OpKey};
use serde::Serialize;

use super::lbctl::{drain, key_of};
use super::sdk::{classify, decode};
use super::trace::{lbctl_outcome, lbctl_status};
use super::{ClientKind, GaveUp, Op, Outcome, Workload, add};

/// Reruns sent at once.
const RERUNS_AT_ONCE: usize = 8;
/// A rerun's retry budget, at least: a real caller's (the default of lbctl's `--max-elapsed` and
/// of the SDK's `RetryPolicy`), however short `--op-max-elapsed` was made. A rerun may meet a
/// claim its operation's last attempt left, or a call that may still land, and wait them out.
const RERUN_BUDGET: Duration = Duration::from_secs(600);

/// What the service held for a key before the rerun (`GET /admin/v1/records`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    /// `in_flight`, `completed` or `failed`.
    pub state: String,
    /// The stored response's status, when completed.
    pub status: Option<u16>,
    /// The stored response's body, when completed: its text, or its bytes in hex.
    pub body: Option<String>,
    /// Whether `body` is hex.
    pub hex: bool,
}

impl StoredAnswer {
    fn describe(&self) -> String {
        match self.status {
            Some(status) => format!("{} {status}", self.state),
            None => self.state.clone(),
        }
    }
}

/// An operation that gave up, why, and what its rerun came to.
#[derive(Debug, Clone, Serialize)]
pub struct Rerun {
    /// The operation, its client and its key.
    pub what: String,
    /// Why it gave up (the client's last word).
    pub reason: String,
    /// Each attempt: when it ended (from the start of the workload), to which replica, what that
    /// replica was doing then (down since a kill, paused, the database down), what came of it.
    pub attempts: Vec<String>,
    /// The service's record of the key before the rerun: `completed 201`, `in_flight`, `failed`,
    /// `no record`, or `key not named` (an lbctl process killed before it named its key).
    pub stored_before: String,
    /// What the rerun was answered (`201 Created (replayed)`), or why it was not sent (a naive
    /// client has no key to send again).
    pub answer: String,
    /// The rerun ended in a success or a clean refusal.
    pub completed: bool,
    /// When a response was stored before the rerun: whether the rerun answered it (its status;
    /// for a success its body too, as a replay).
    pub matched: Option<bool>,
}

/// What a rerun was answered.
struct Answer {
    outcome: Outcome,
    status: Option<u16>,
    body: Vec<u8>,
    replayed: bool,
    text: String,
    /// The key lbctl named (`-v`).
    key: Option<String>,
}

impl Workload {
    /// Sends every operation that gave up again with its key (protected clients; a naive client
    /// has none to send), at most 8 at a time, each with at least a real caller's retry budget
    /// (10 min), and learns from the answers (a create's worker, a delete done) as from any
    /// operation's. `stored` is the service's record of each key before the reruns.
    pub async fn rerun_gave_up(&self, stored: &HashMap<String, StoredAnswer>) -> Vec<Rerun> {
        let gave_up = self.ledger().gave_up.clone();
        if self.config.kind == ClientKind::Naive {
            return gave_up.iter().map(|g| self.not_rerun(g)).collect();
        }
        futures::stream::iter(gave_up)
            .map(|g| async move {
                let before = g.key.as_ref().map(|k| stored.get(k));
                let answer = self.send_again(&g).await;
                self.rerun_report(&g, before, answer)
            })
            .buffer_unordered(RERUNS_AT_ONCE)
            .collect()
            .await
    }

    fn rerun_budget(&self) -> Duration {
        self.config.op_max_elapsed.max(RERUN_BUDGET)
    }

    fn attempts_described(&self, g: &GaveUp) -> Vec<String> {
        g.attempts.iter().map(|a| a.describe(&self.timeline)).collect()
    }

    fn not_rerun(&self, g: &GaveUp) -> Rerun {
        Rerun {
            what: g.what(),
            reason: g.reason.clone(),
            attempts: self.attempts_described(g),
            stored_before: String::new(),
            answer: "not sent again: a naive client has no key to send".to_owned(),
            completed: false,
            matched: None,
        }
    }

    fn rerun_report(&self, g: &GaveUp, before: Option<Option<&StoredAnswer>>, answer: Answer) -> Rerun {
        let completed = matches!(
            answer.outcome,
            Outcome::Created(_) | Outcome::Rebooted(_) | Outcome::Deleted | Outcome::Flashed(_) | Outcome::Refused(_)
        );
        let stored = before.flatten().filter(|s| s.state == "completed");
        let matched = stored.map(|s| {
            let success = answer.status.is_some_and(|st| (200..300).contains(&st));
            s.status == answer.status && (!success || (answer.replayed && same_body(s, &answer.body)))
        });
        if completed {
            add(&self.counters.rerun_completed, 1);
            let key = g.key.as_deref().or(answer.key.as_deref());
            if let (false, Some(key)) = (matches!(answer.outcome, Outcome::Refused(_)), key) {
                self.acknowledged(&g.op, key);
            }
            self.learn(g.op.clone(), answer.outcome);
        }
        Rerun {
            what: g.what(),
            reason: g.reason.clone(),
            attempts: self.attempts_described(g),
            stored_before: match before {
                None => "key not named".to_owned(),
                Some(None) => "no record".to_owned(),
                Some(Some(s)) => s.describe(),
            },
            answer: answer.text,
            completed,
            matched,
        }
    }

    /// Sends `g` again with its key: through the SDK, or a fresh lbctl process with its op id.
    async fn send_again(&self, g: &GaveUp) -> Answer {
        if g.via_lbctl {
            return self.lbctl_again(&g.op, g.op_id.as_deref()).await;
        }
        let Some(key) = g.key.as_deref().and_then(|k| OpKey::parse(k).ok()) else {
            return failed("the SDK operation has no key");
        };
        let body = Self::body(&g.op);
        let retrier = Retrier::new(self.policy.with_max_elapsed(self.rerun_budget()));
        match retrier.send(Some(&key), || self.request(&g.op, &body, self.pick())).await {
            Ok(response) => {
                let status = response.status;
                let text = if response.replayed { format!("{status} (replayed)") } else { status.to_string() };
                let outcome = decode(&g.op, &response.body);
                let (body, replayed) = (response.body.to_vec(), response.replayed);
                Answer { outcome, status: Some(status.as_u16()), body, replayed, text, key: None }
            }
            Err(e) => {
                let status = match &e {
                    Error::Refused { status, .. } => Some(status.as_u16()),
                    _ => None,
                };
                Answer {
                    outcome: classify(&e),
                    status,
                    body: Vec::new(),
                    replayed: false,
                    text: e.to_string(),
                    key: None,
                }
            }
        }
    }

    /// A fresh lbctl process for `op` with `op_id` (its journal holds the key), the operation's
    /// budget and no fault.
    async fn lbctl_again(&self, op: &Op, op_id: Option<&str>) -> Answer {
        let budget = self.rerun_budget();
        let mut command = self.lbctl_command(op, self.pick(), budget, op_id);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => return failed(&format!("cannot start lbctl: {e}")),
        };
        let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
        let status = match tokio::time::timeout(budget + Duration::from_secs(30), child.wait()).await {
            Ok(status) => status.ok().and_then(|s| s.code()),
            Err(_) => {
                let _ = child.start_kill();
                return failed(&format!("lbctl still running after {:?}", budget + Duration::from_secs(30)));
            }
        };
        let (out, err) = (stdout.await.unwrap_or_default(), stderr.await.unwrap_or_default());
        let err = String::from_utf8_lossy(&err);
        let last_attempt = err.lines().rfind(|l| l.starts_with("lbctl: attempt ")).unwrap_or_default();
        let last_line = err.lines().last().unwrap_or_default().to_owned();
        let (outcome, text) = match status {
            Some(0) => (decode(op, &out), lbctl_outcome(last_attempt).unwrap_or_else(|| last_line.clone())),
            Some(3) => (Outcome::Refused(last_line.clone()), format!("lbctl exit 3: {last_line}")),
            code => (Outcome::Failed(last_line.clone()), format!("lbctl exit {code:?}: {last_line}")),
        };
        let replayed = last_attempt.ends_with("(replayed)");
        let key = key_of(&err).map(str::to_owned);
        Answer { outcome, status: lbctl_status(last_attempt), body: out, replayed, text, key }
    }
}

fn failed(why: &str) -> Answer {
    let outcome = Outcome::Failed(why.to_owned());
    Answer { outcome, status: None, body: Vec::new(), replayed: false, text: why.to_owned(), key: None }
}

/// Whether `answer` is the body `stored` holds: the same JSON value (lbctl prints the body as the
/// server sent it, the SDK hands it over as it came), or the same bytes.
fn same_body(stored: &StoredAnswer, answer: &[u8]) -> bool {
    let stored_body = stored.body.as_deref().unwrap_or_default();
    if stored.hex {
        let hex: String = answer.iter().map(|b| format!("{b:02x}")).collect();
        return hex == stored_body;
    }
    let json = |bytes: &[u8]| serde_json::from_slice::<serde_json::Value>(bytes).ok();
    match (json(stored_body.as_bytes()), json(answer)) {
        (Some(a), Some(b)) => a == b,
        _ => stored_body.trim() == String::from_utf8_lossy(answer).trim(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(body: &str) -> StoredAnswer {
        StoredAnswer { state: "completed".into(), status: Some(201), body: Some(body.into()), hex: false }
    }

    #[test]
    fn a_body_is_the_stored_one_when_it_is_the_same_json_or_the_same_text() {
        let body = r#"{"id":"w-1","state":"running"}"#;
        assert!(same_body(&stored(body), b"{\"state\":\"running\",\n \"id\":\"w-1\"}\n"));
        assert!(!same_body(&stored(body), br#"{"id":"w-2","state":"running"}"#));
        assert!(same_body(&StoredAnswer { body: None, ..stored("") }, b""));
        assert!(same_body(&StoredAnswer { body: Some("00ff".into()), hex: true, ..stored("") }, &[0x00, 0xff]));
    }
}
