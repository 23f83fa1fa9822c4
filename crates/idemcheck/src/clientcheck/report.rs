//! What `idemcheck client` found: one line per scenario, and the report (markdown or JSON, by the
//! file's extension) with each scenario's runs and every request that arrived.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::api::Arrival;
use super::command::Run;
use super::scenario::{Evidence, Scenario, Verdict};

/// One scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Outcome {
    pub(crate) scenario: &'static str,
    pub(crate) rule: &'static str,
    /// `pass` or `fail`.
    pub(crate) result: &'static str,
    pub(crate) reason: String,
    /// How many times the scripted API did the work.
    pub(crate) executions: usize,
    pub(crate) runs: Vec<Run>,
    pub(crate) arrivals: Vec<Arrival>,
}

impl Outcome {
    pub(crate) fn new(scenario: Scenario, verdict: Verdict, evidence: Evidence) -> Self {
        let (result, reason) = match verdict {
            Ok(why) => ("pass", why),
            Err(why) => ("fail", why),
        };
        Outcome {
            scenario: scenario.name(),
            rule: scenario.rule(),
            result,
            reason,
            executions: evidence.transcript.executions,
            runs: evidence.runs,
            arrivals: evidence.transcript.arrivals,
        }
    }

    pub(crate) fn passed(&self) -> bool {
        self.result == "pass"
    }

    /// The line a run prints.
    pub(crate) fn line(&self) -> String {
        let tag = if self.passed() { "PASS" } else { "FAIL" };
        format!("{tag} {:<22} {}", self.scenario, self.reason)
    }
}

/// The whole run.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    /// The command under test, as given after `--`.
    pub(crate) command: Vec<String>,
    /// The route it was told to call.
    pub(crate) path: String,
    pub(crate) budget_seconds: u64,
    pub(crate) date: String,
    pub(crate) passed: usize,
    pub(crate) failed: usize,
    pub(crate) scenarios: Vec<Outcome>,
}

impl Report {
    pub(crate) fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failed)
    }

    pub(crate) fn write(&self, path: &Path) -> Result<(), String> {
        let text = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::to_string_pretty(self).map_err(|e| e.to_string())?,
            _ => self.markdown(),
        };
        std::fs::write(path, text).map_err(|e| format!("--report {}: {e}", path.display()))
    }

    fn markdown(&self) -> String {
        let mut md = String::from("# idemcheck client report\n\n");
        let _ = write!(
            md,
            "- Command: `{}`\n- Route: `POST {}`\n- Budget (`IDEMCHECK_MAX_ELAPSED`): {} s\n- Date: {}\n- Result: {}\n\n",
            self.command.join(" "),
            self.path,
            self.budget_seconds,
            self.date,
            self.summary()
        );
        md.push_str("| Scenario | Result | Rule | Evidence |\n|---|---|---|---|\n");
        for o in &self.scenarios {
            let _ = writeln!(md, "| `{}` | {} | {} | {} |", o.scenario, o.result, cell(o.rule), cell(&o.reason));
        }
        md.push_str("\n## What arrived\n");
        for o in &self.scenarios {
            let _ = writeln!(md, "\n### `{}`: {}\n", o.scenario, o.result);
            md.push_str("| Run | At (s) | Idempotency-Key | Answer |\n|---|---|---|---|\n");
            for a in &o.arrivals {
                let key = a.key.as_deref().map_or("(none)".to_owned(), |k| format!("`{k}`"));
                let _ = writeln!(
                    md,
                    "| {} | {:.3} | {} | {} |",
                    a.run + 1,
                    a.at.as_secs_f64(),
                    cell(&key),
                    cell(&a.answer)
                );
            }
            for (i, run) in o.runs.iter().enumerate() {
                let _ = writeln!(
                    md,
                    "\nRun {} (operation `{}`): {:?} at {:.3} s.",
                    i + 1,
                    run.operation,
                    run.exit,
                    run.ended_at.as_secs_f64()
                );
                if !o.passed() && !run.output.trim().is_empty() {
                    let _ = write!(md, "\n```text\n{}\n```\n", run.output.trim_end());
                }
            }
        }
        md
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}
