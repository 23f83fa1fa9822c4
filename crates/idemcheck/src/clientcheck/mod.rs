//! `idemcheck client -- COMMAND [ARGS]...`: checks any HTTP client's idempotent retries (docs/protocol.md#clients).
//!
//! It serves a scripted API on loopback and runs the command once per scenario (twice for the
//! two-operation and the kill-and-rerun scenarios) with, in its environment:
//!
//! - `IDEMCHECK_URL`: the API's base URL; the command makes one logical `POST` to
//!   `$IDEMCHECK_URL$IDEMCHECK_PATH` (`/v1/things` unless `--path` says otherwise) through the
//!   client under test and exits 0 on success, non-zero on an error;
//! - `IDEMCHECK_OPERATION`: the logical operation's id, new per scenario, the same for a rerun;
//! - `IDEMCHECK_MAX_ELAPSED`: the retry budget in seconds, for the command to hand to its client;
//! - `IDEMCHECK_DIR`: a directory that lives for the kit's whole run (for a journal);
//! - `IDEMCHECK_SCENARIO`: the scenario's name (for logs only).
//!
//! Each verdict comes from what arrived (keys, timing, counts) and how the runs ended.

mod api;
mod command;
mod report;
mod scenario;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::ValueEnum;

use self::api::{Api, Route};
use self::command::{Env, Run, Stop};
use self::report::{Outcome, Report};
use self::scenario::{Evidence, Plan, Scenario};

/// How long past its budget a run may go on before the kit kills it.
const LATE: Duration = Duration::from_secs(15);

/// `idemcheck client`'s arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct ClientArgs {
    /// Only this scenario; repeat for more (default: all, in the order listed).
    #[arg(long = "scenario", value_enum, value_name = "NAME")]
    scenarios: Vec<Scenario>,
    /// The route the command calls (`POST PATH`): its client may send to a fixed path.
    #[arg(long, default_value = "/v1/things")]
    path: String,
    /// The JSON body of a success (`201`), for a client that reads it (default: {"id": "thing-N"}).
    #[arg(long, value_name = "JSON")]
    answer: Option<String>,
    /// The retry budget, in seconds, told to the command as IDEMCHECK_MAX_ELAPSED; the gives-up
    /// scenario expects the command to stop within it (plus 5 s).
    #[arg(long, default_value_t = 5, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=600))]
    budget: u64,
    /// Writes a report: markdown (.md) or JSON (.json). May be repeated.
    #[arg(long, value_name = "out.md|out.json")]
    report: Vec<PathBuf>,
    /// The command, after `--`: it makes one logical POST through the client under test.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// The kit while it runs: the API, the command and what the command is told.
struct Kit<'a> {
    api: Api,
    argv: &'a [String],
    env: Env<'a>,
}

impl Kit<'_> {
    async fn run(&self, scenario: Scenario, operation: &str, at_arrival: Option<usize>) -> Result<Run, String> {
        let stop = Stop { at_arrival, deadline: self.env.budget + LATE };
        command::run(self.argv, &self.env, &self.api, scenario.name(), operation, stop).await
    }

    /// Plays one scenario to its verdict. An `Err` is the kit's own failure.
    async fn play(&self, scenario: Scenario) -> Result<Outcome, String> {
        self.api.begin(scenario.script());
        let operation = operation_id(scenario);
        let mut runs = Vec::with_capacity(2);
        match scenario.plan() {
            Plan::Once => runs.push(self.run(scenario, &operation, None).await?),
            Plan::TwoOperations => {
                runs.push(self.run(scenario, &operation, None).await?);
                self.api.next_run(1);
                runs.push(self.run(scenario, &operation_id(scenario), None).await?);
            }
            Plan::KillThenRerun => {
                runs.push(self.run(scenario, &operation, Some(2)).await?);
                self.api.next_run(1);
                runs.push(self.run(scenario, &operation, None).await?);
            }
        }
        let evidence = Evidence { transcript: self.api.finish(), runs, budget: self.env.budget };
        Ok(Outcome::new(scenario, scenario.judge(&evidence), evidence))
    }
}

/// A fresh operation id.
fn operation_id(scenario: Scenario) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("idemcheck-{}-{}", scenario.name(), &id[..12])
}

/// Runs the scenarios; exits 0 when none failed, 1 when one did. An `Err` is the kit's own
/// failure (bad arguments, a command that cannot be started): one line, exit 2.
pub(crate) async fn run(args: ClientArgs) -> Result<ExitCode, String> {
    if !args.path.starts_with('/') || args.path.contains(char::is_whitespace) {
        return Err(format!("--path {}: expected an absolute path such as /v1/things", args.path));
    }
    let created = match &args.answer {
        Some(text) => Some(serde_json::from_str(text).map_err(|e| format!("--answer is not JSON: {e}"))?),
        None => None,
    };
    if let Some(path) =
        args.report.iter().find(|p| !matches!(p.extension().and_then(|e| e.to_str()), Some("md" | "json")))
    {
        return Err(format!("--report {}: name a .md or .json file", path.display()));
    }
    let chosen = if args.scenarios.is_empty() { Scenario::value_variants() } else { args.scenarios.as_slice() };
    let mut scenarios: Vec<Scenario> = Vec::with_capacity(chosen.len());
    for s in chosen {
        if !scenarios.contains(s) {
            scenarios.push(*s);
        }
    }
    let dir = tempfile::Builder::new()
        .prefix("idemcheck-client-")
        .tempdir()
        .map_err(|e| format!("cannot make a scratch directory: {e}"))?;
    let (api, url) = Api::start(Route { path: args.path.clone(), created })
        .await
        .map_err(|e| format!("cannot serve the scripted API: {e}"))?;
    let env = Env { url: &url, path: &args.path, budget: Duration::from_secs(args.budget), dir: dir.path() };
    let kit = Kit { api, argv: &args.command, env };

    println!(
        "idemcheck client: {} scenarios, POST {url}{} (budget {} s), command: {}",
        scenarios.len(),
        args.path,
        args.budget,
        args.command.join(" ")
    );
    let mut outcomes = Vec::with_capacity(scenarios.len());
    for scenario in scenarios {
        let outcome = kit.play(scenario).await?;
        println!("{}", outcome.line());
        outcomes.push(outcome);
    }
    let passed = outcomes.iter().filter(|o| o.passed()).count();
    let report = Report {
        command: args.command.clone(),
        path: args.path.clone(),
        budget_seconds: args.budget,
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        passed,
        failed: outcomes.len() - passed,
        scenarios: outcomes,
    };
    println!("{}", report.summary());
    for path in &args.report {
        report.write(path)?;
    }
    Ok(if report.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
