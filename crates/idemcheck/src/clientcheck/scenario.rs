//! The scenarios: what the scripted API answers in each, how often the command runs, and the
//! verdict from what arrived (keys, timing, counts) and how each run ended.

use std::time::Duration;

use clap::ValueEnum;

use super::api::{Answer, Arrival, Script, Transcript};
use super::command::{Exit, Run};

/// The `Retry-After` of the 503 and 429 scenarios, in seconds: long enough that a client's own
/// backoff (a few hundred milliseconds) does not meet it by chance.
pub(crate) const RETRY_AFTER: u64 = 2;
/// How much earlier than `Retry-After` a retry may arrive (timer granularity).
const EARLY: Duration = Duration::from_millis(20);
/// How long after the budget a client may take to give up, from its first attempt.
pub(crate) const GIVE_UP_SLACK: Duration = Duration::from_secs(5);

/// A scenario, by its name on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Scenario {
    /// The work is done and the answer lost: the retry carries the same key.
    #[value(name = "lost-answer")]
    LostAnswer,
    /// `503` with `Retry-After`: retried, not sooner, with the same key.
    #[value(name = "retry-after-503")]
    RetryAfter503,
    /// `429` with `Retry-After`: retried, not sooner, with the same key.
    #[value(name = "retry-after-429")]
    RetryAfter429,
    /// `409 request-in-progress`: retried with the same key.
    #[value(name = "in-progress-409")]
    InProgress409,
    /// `409 idempotency-key-reused`: never retried.
    #[value(name = "mismatch-409")]
    Mismatch409,
    /// `422 idempotency-key-reused`: never retried.
    #[value(name = "mismatch-422")]
    Mismatch422,
    /// `400 idempotency-key-reused`: never retried.
    #[value(name = "mismatch-400")]
    Mismatch400,
    /// A plain `422` validation problem: never retried.
    #[value(name = "refused-422")]
    Refused422,
    /// `503` forever: the client gives up within its budget.
    #[value(name = "gives-up")]
    GivesUp,
    /// Two operations: two keys.
    #[value(name = "new-operation-new-key")]
    NewOperationNewKey,
    /// Killed mid-retry and run again with the same operation: the same key.
    #[value(name = "kill-and-rerun")]
    KillAndRerun,
}

/// How the command is run in a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Once.
    Once,
    /// Twice, each time with a new operation.
    TwoOperations,
    /// Killed (its process group, SIGKILL) when its second attempt arrives, then run again with
    /// the same operation.
    KillThenRerun,
}

/// What a verdict is judged from.
#[derive(Debug)]
pub(crate) struct Evidence {
    pub(crate) transcript: Transcript,
    pub(crate) runs: Vec<Run>,
    pub(crate) budget: Duration,
}

/// `Ok(why it passed)` or `Err(why it failed)`.
pub(crate) type Verdict = Result<String, String>;

const fn problem(status: u16, name: &'static str, retry_after: Option<u64>) -> Answer {
    Answer::Problem { status, name, retry_after }
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::LostAnswer => "lost-answer",
            Scenario::RetryAfter503 => "retry-after-503",
            Scenario::RetryAfter429 => "retry-after-429",
            Scenario::InProgress409 => "in-progress-409",
            Scenario::Mismatch409 => "mismatch-409",
            Scenario::Mismatch422 => "mismatch-422",
            Scenario::Mismatch400 => "mismatch-400",
            Scenario::Refused422 => "refused-422",
            Scenario::GivesUp => "gives-up",
            Scenario::NewOperationNewKey => "new-operation-new-key",
            Scenario::KillAndRerun => "kill-and-rerun",
        }
    }

    /// The rule it checks, as the report states it.
    pub(crate) fn rule(self) -> &'static str {
        match self {
            Scenario::LostAnswer => "an answer lost after the work was done is retried with the same key",
            Scenario::RetryAfter503 => "a 503 is retried with the same key, not before its Retry-After",
            Scenario::RetryAfter429 => "a 429 is retried with the same key, not before its Retry-After",
            Scenario::InProgress409 => "a 409 request-in-progress is retried with the same key",
            Scenario::Mismatch409 | Scenario::Mismatch422 | Scenario::Mismatch400 => {
                "the problem idempotency-key-reused is never retried, whatever its status"
            }
            Scenario::Refused422 => "a plain 4xx is never retried",
            Scenario::GivesUp => "a server that answers 503 forever: the client gives up within its budget",
            Scenario::NewOperationNewKey => "a new operation gets a new key",
            Scenario::KillAndRerun => "a command killed mid-retry and run again sends the same key",
        }
    }

    pub(crate) fn plan(self) -> Plan {
        match self {
            Scenario::NewOperationNewKey => Plan::TwoOperations,
            Scenario::KillAndRerun => Plan::KillThenRerun,
            _ => Plan::Once,
        }
    }

    pub(crate) fn script(self) -> Script {
        let (first, then) = match self {
            Scenario::LostAnswer => (vec![Answer::Lost], Answer::Created),
            Scenario::RetryAfter503 => (vec![problem(503, "upstream-unavailable", Some(RETRY_AFTER))], Answer::Created),
            Scenario::RetryAfter429 => (vec![problem(429, "too-many-requests", Some(RETRY_AFTER))], Answer::Created),
            Scenario::InProgress409 => (vec![problem(409, "request-in-progress", Some(1))], Answer::Created),
            Scenario::Mismatch409 => (vec![], problem(409, "idempotency-key-reused", None)),
            Scenario::Mismatch422 => (vec![], problem(422, "idempotency-key-reused", None)),
            Scenario::Mismatch400 => (vec![], problem(400, "idempotency-key-reused", None)),
            Scenario::Refused422 => (vec![], problem(422, "validation-failed", None)),
            Scenario::GivesUp => (vec![], problem(503, "upstream-unavailable", None)),
            Scenario::NewOperationNewKey => (vec![], Answer::Created),
            Scenario::KillAndRerun => (vec![Answer::Lost, Answer::Held], Answer::Created),
        };
        Script { first, then }
    }

    /// The verdict.
    pub(crate) fn judge(self, e: &Evidence) -> Verdict {
        if let Some(a) = e.transcript.arrivals.iter().find(|a| a.answer.starts_with("404")) {
            return Err(format!(
                "a request went to {} {} (answered 404): is the command's route right?",
                a.method, a.path
            ));
        }
        match self {
            Scenario::LostAnswer => retried(e, "lost answer", None),
            Scenario::RetryAfter503 => retried(e, "503", Some(RETRY_AFTER)),
            Scenario::RetryAfter429 => retried(e, "429", Some(RETRY_AFTER)),
            Scenario::InProgress409 => retried(e, "409 request-in-progress", None),
            Scenario::Mismatch409 => not_retried(e, "409 idempotency-key-reused"),
            Scenario::Mismatch422 => not_retried(e, "422 idempotency-key-reused"),
            Scenario::Mismatch400 => not_retried(e, "400 idempotency-key-reused"),
            Scenario::Refused422 => not_retried(e, "422 validation-failed"),
            Scenario::GivesUp => gave_up(e),
            Scenario::NewOperationNewKey => new_key(e),
            Scenario::KillAndRerun => same_key_after_kill(e),
        }
    }
}

/// A key as a reason shows it.
fn short(key: &str) -> String {
    match key.char_indices().nth(24) {
        Some((i, _)) => format!("{}...", &key[..i]),
        None => key.to_owned(),
    }
}

fn times(n: usize) -> String {
    match n {
        1 => "once".to_owned(),
        2 => "twice".to_owned(),
        n => format!("{n} times"),
    }
}

fn attempts(n: usize) -> String {
    if n == 1 { "1 attempt".to_owned() } else { format!("{n} attempts") }
}

/// The one key all `arrivals` carry, or which attempt broke the rule.
fn one_key(arrivals: &[Arrival]) -> Result<&str, String> {
    let first = arrivals.first().ok_or("no request arrived")?;
    let key = first.key.as_deref().ok_or("the first attempt carried no Idempotency-Key")?;
    for (i, a) in arrivals.iter().enumerate().skip(1) {
        match a.key.as_deref() {
            None => return Err(format!("attempt {} carried no Idempotency-Key", i + 1)),
            Some(k) if k != key => {
                return Err(format!("attempt {} carried a new key ({k} after {key})", i + 1));
            }
            Some(_) => {}
        }
    }
    Ok(key)
}

/// How a run ended, for a reason.
fn ended(run: &Run) -> String {
    let last = match run.last_line() {
        "" => String::new(),
        line => format!(": {}", crate::client::truncate(line, 160)),
    };
    match run.exit {
        Exit::Code(code) => format!("exit {code}{last}"),
        Exit::Signal => format!("ended by a signal{last}"),
        Exit::Killed => "killed by the kit".to_owned(),
        Exit::TimedOut => format!("still running at {:.1} s, killed{last}", run.ended_at.as_secs_f64()),
    }
}

fn succeeded(run: &Run) -> Result<(), String> {
    match run.exit {
        Exit::Code(0) => Ok(()),
        _ => Err(format!("the command did not succeed after the server's 201 ({})", ended(run))),
    }
}

fn failed(run: &Run, what: &str) -> Result<i32, String> {
    match run.exit {
        Exit::Code(0) => Err(format!("exit 0 after the {what}: the caller is told it succeeded")),
        Exit::Code(code) => Ok(code),
        _ => Err(format!("the command did not end with an error after the {what} ({})", ended(run))),
    }
}

/// The first attempt was answered `what` (after `wait` seconds of `Retry-After`): the second came
/// with the same key, no sooner, and the command succeeded.
fn retried(e: &Evidence, what: &str, wait: Option<u64>) -> Verdict {
    let arrivals = &e.transcript.arrivals;
    let run = &e.runs[0];
    let [first, second, ..] = arrivals.as_slice() else {
        return Err(format!("no retry after the {what}: {}, {}", attempts(arrivals.len()), ended(run)));
    };
    let key = one_key(arrivals)?;
    let gap = second.at.saturating_sub(first.answered_at.unwrap_or(first.at));
    if let Some(secs) = wait
        && gap + EARLY < Duration::from_secs(secs)
    {
        return Err(format!("retried {:.2} s after the {what}, before its Retry-After: {secs}", gap.as_secs_f64()));
    }
    succeeded(run)?;
    Ok(format!(
        "retried {:.2} s after the {what} under the same key ({}), {} attempts, the work ran {}, exit 0",
        gap.as_secs_f64(),
        short(key),
        arrivals.len(),
        times(e.transcript.executions)
    ))
}

/// The one attempt was refused with `what`: no other came, and the command failed.
fn not_retried(e: &Evidence, what: &str) -> Verdict {
    let arrivals = &e.transcript.arrivals;
    let run = &e.runs[0];
    match arrivals.as_slice() {
        [] => Err(format!("no request arrived ({})", ended(run))),
        [_] => {
            let code = failed(run, what)?;
            Ok(format!("one attempt, not retried after the {what}; exit {code}"))
        }
        [first, second, ..] => Err(format!(
            "retried the {what}: {} attempts, the second {:.2} s after the first",
            arrivals.len(),
            (second.at.saturating_sub(first.at)).as_secs_f64()
        )),
    }
}

/// 503 forever: the command retried, then gave up within the budget and failed.
fn gave_up(e: &Evidence) -> Verdict {
    let arrivals = &e.transcript.arrivals;
    let run = &e.runs[0];
    let first = arrivals.first().ok_or_else(|| format!("no request arrived ({})", ended(run)))?;
    let took = run.ended_at.saturating_sub(first.at);
    let budget = e.budget.as_secs();
    if run.exit == Exit::TimedOut {
        return Err(format!(
            "still retrying {:.1} s after the first attempt ({} attempts, budget {budget} s): killed",
            took.as_secs_f64(),
            arrivals.len()
        ));
    }
    if arrivals.len() < 2 {
        return Err(format!("no retry of the 503 before giving up: 1 attempt, {}", ended(run)));
    }
    one_key(arrivals)?;
    if took > e.budget + GIVE_UP_SLACK {
        return Err(format!(
            "gave up {:.1} s after the first attempt, past the budget of {budget} s (+{} s)",
            took.as_secs_f64(),
            GIVE_UP_SLACK.as_secs()
        ));
    }
    let code = failed(run, "503s")?;
    Ok(format!(
        "gave up after {} attempts under one key, {:.1} s after the first (budget {budget} s); exit {code}",
        arrivals.len(),
        took.as_secs_f64()
    ))
}

/// Two runs with two operations, each answered 201: two keys.
fn new_key(e: &Evidence) -> Verdict {
    let mut keys = Vec::new();
    for (i, run) in e.runs.iter().enumerate() {
        let arrivals: Vec<Arrival> = e.transcript.arrivals.iter().filter(|a| a.run == i).cloned().collect();
        let key = one_key(&arrivals).map_err(|why| format!("operation {}: {why} ({})", i + 1, ended(run)))?;
        succeeded(run)?;
        keys.push(key.to_owned());
    }
    match keys.as_slice() {
        [a, b] if a == b => Err(format!("two operations sent one key ({a}): the second gets the first's result")),
        [a, b] => Ok(format!("two operations, two keys ({} and {})", short(a), short(b))),
        _ => Err("expected two runs".to_owned()),
    }
}

/// Killed when its second attempt (the retry of a lost answer) arrived, then run again with the
/// same operation: every attempt carries one key, and the rerun succeeds.
fn same_key_after_kill(e: &Evidence) -> Verdict {
    let arrivals = &e.transcript.arrivals;
    let [first_run, rerun] = e.runs.as_slice() else { return Err("expected two runs".to_owned()) };
    if first_run.exit != Exit::Killed {
        return Err(format!(
            "the first run did not retry the lost answer, so it was not killed mid-retry ({})",
            ended(first_run)
        ));
    }
    let Some(rerun_first) = arrivals.iter().position(|a| a.run == 1) else {
        return Err(format!("the rerun sent nothing ({})", ended(rerun)));
    };
    let key = one_key(&arrivals[..rerun_first])?;
    match arrivals[rerun_first].key.as_deref() {
        Some(k) if k == key => {}
        Some(k) => {
            return Err(format!(
                "the rerun after the kill carried a new key ({k} after {key}): the work ran {}",
                times(e.transcript.executions)
            ));
        }
        None => return Err("the rerun carried no Idempotency-Key".to_owned()),
    }
    one_key(arrivals)?;
    succeeded(rerun)?;
    Ok(format!(
        "killed mid-retry after {rerun_first} attempts; the rerun carried the same key ({}), the work ran {}, exit 0",
        short(key),
        times(e.transcript.executions)
    ))
}
