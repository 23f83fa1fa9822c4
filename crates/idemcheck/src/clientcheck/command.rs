//! Running the command under test: in a process group of its own (so that a kill takes its
//! children too), with the scenario's environment, its output kept for the report.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio::task::JoinHandle;

use super::api::Api;

/// How much of the command's output the report keeps (the end of it).
const OUTPUT_TAIL: usize = 2000;

/// What the command is told, through its environment.
#[derive(Debug, Clone)]
pub(crate) struct Env<'a> {
    /// `IDEMCHECK_URL`.
    pub(crate) url: &'a str,
    /// `IDEMCHECK_PATH`.
    pub(crate) path: &'a str,
    /// `IDEMCHECK_MAX_ELAPSED`, in seconds.
    pub(crate) budget: Duration,
    /// `IDEMCHECK_DIR`: a directory that lives as long as the kit's run.
    pub(crate) dir: &'a Path,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it (not the kit's).
    Signal,
    /// The kit killed it, as the scenario says.
    Killed,
    /// It was still running at its deadline; the kit killed it.
    TimedOut,
}

/// One run of the command.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Run {
    pub(crate) operation: String,
    pub(crate) exit: Exit,
    /// When it ended, since the scenario began.
    #[serde(rename = "ended_at_seconds", serialize_with = "seconds")]
    pub(crate) ended_at: Duration,
    /// The end of its stdout and stderr.
    pub(crate) output: String,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

impl Run {
    /// The last line of its output, for a reason.
    pub(crate) fn last_line(&self) -> &str {
        self.output.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim()
    }
}

/// When the kit ends a run that has not ended by itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stop {
    /// Kill it once this many requests of the scenario have arrived (the kill-and-rerun).
    pub(crate) at_arrival: Option<usize>,
    /// Kill it if it is still running this long after it started.
    pub(crate) deadline: Duration,
}

/// Runs `argv` once with the scenario's environment and `operation`, while `api` serves the
/// scenario. An `Err` is the kit's own failure (the command cannot be started).
pub(crate) async fn run(
    argv: &[String],
    env: &Env<'_>,
    api: &Api,
    scenario: &str,
    operation: &str,
    stop: Stop,
) -> Result<Run, String> {
    let mut arrivals = api.arrivals();
    let (program, args) = argv.split_first().ok_or("no command given after --")?;
    let mut child = Command::new(program)
        .args(args)
        .env("IDEMCHECK_URL", env.url)
        .env("IDEMCHECK_PATH", env.path)
        .env("IDEMCHECK_OPERATION", operation)
        .env("IDEMCHECK_MAX_ELAPSED", env.budget.as_secs().to_string())
        .env("IDEMCHECK_DIR", env.dir)
        .env("IDEMCHECK_SCENARIO", scenario)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let group = child.id().and_then(|id| i32::try_from(id).ok()).and_then(Pid::from_raw);
    let stdout = child.stdout.take().map(tail);
    let stderr = child.stderr.take().map(tail);
    let kill_point = async {
        match stop.at_arrival {
            Some(n) => drop(arrivals.wait_for(|count| *count >= n).await),
            None => std::future::pending().await,
        }
    };
    let exit = tokio::select! {
        status = child.wait() => match status.map_err(|e| format!("waiting for {program}: {e}"))?.code() {
            Some(code) => Exit::Code(code),
            None => Exit::Signal,
        },
        () = kill_point => Exit::Killed,
        () = tokio::time::sleep(stop.deadline) => Exit::TimedOut,
    };
    let ended_at = api.now();
    // The whole group, also after a normal exit: nothing it left behind sends into the next scenario.
    if let Some(group) = group {
        let _ = kill_process_group(group, Signal::KILL);
    }
    let _ = child.wait().await;
    let mut output = String::new();
    for reader in [stdout, stderr].into_iter().flatten() {
        // A grandchild outside the group may hold the pipe open: its output is not waited for.
        if let Ok(Ok(text)) = tokio::time::timeout(Duration::from_secs(5), reader).await {
            output.push_str(&text);
        }
    }
    Ok(Run { operation: operation.to_owned(), exit, ended_at, output: last_chars(&output, OUTPUT_TAIL) })
}

/// Reads a pipe to its end in the background.
fn tail(mut pipe: impl AsyncRead + Unpin + Send + 'static) -> JoinHandle<String> {
    tokio::spawn(async move {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes).await;
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn last_chars(s: &str, max: usize) -> String {
    let count = s.chars().count();
    s.chars().skip(count.saturating_sub(max)).collect()
}
