//! lbctl: the leasebroker command line, on the [`leasebroker_client`] SDK.
//!
//! Every mutating command sends one `Idempotency-Key` on all of its retries, until `--max-elapsed`
//! is spent. With `--op-id` the key is also written to a durable journal before the first attempt,
//! so running the same command again after a crash, a kill or a give-up reuses the key and gets the
//! original result back; once the journal holds the operation's final outcome, a rerun answers
//! from the journal without contacting the server. Running a *different* request under the same op
//! id is refused locally (exit 4) without sending anything.
//!
//! While a request is retried, stderr says what lbctl waits for (the server, why, the budget)
//! from the first failed attempt on, at most a line a second; `-v` prints every attempt instead.
//!
//! `https` URLs are verified against the system's roots and, with `--ca-cert`, a private CA.
//! Text that came from the server is printed to stderr with control characters removed, and
//! to stdout with control and bidirectional-override characters escaped (`\uXXXX`, the same
//! JSON).
//!
//! `firmware flash NODE_ID --version V` (admin token) starts a firmware flash, a long-running
//! operation: the server answers `202` with the operation as soon as it accepts the flash, and a
//! retry or a rerun with the same key gets that same operation back instead of a second flash.
//! `--wait`, and `operations wait OP_ID`, follow the operation to its end with a spinner on a
//! terminal (one plain line per state change otherwise) and print its final JSON;
//! `operations get OP_ID` prints it once. An operation that ends `uncertain` (its flash was sent
//! and what came of it cannot be read) is ended by an operator who checked the machine:
//! `operations resolve OP_ID --state succeeded|failed --reason R` (one key for its retries, as
//! every mutating command).
//!
//! Exit codes (docs/protocol.md#clients): 0 success, 1 local failure (journal, TLS, unexpected response), 2 usage,
//! 3 refused (4xx), 4 key reused with a different request, 5 gave up retrying, 6 unauthorized,
//! 7 the followed operation ended without success (`failed`, or `uncertain`: not known to have
//! succeeded, with a line naming the resolve command).
//!
//! ```
//! use clap::Parser;
//! let cli = lbctl::Cli::try_parse_from([
//!     "lbctl", "--token", "t", "workers", "create", "--image", "base", "--cpu", "2", "--memory-gb", "4",
//!     "--label", "team=ml", "--op-id", "nightly-1",
//! ])
//! .unwrap();
//! assert!(matches!(cli.command, lbctl::Command::Workers(lbctl::WorkersCommand::Create { .. })));
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use leasebroker_client::journal::{Journal, JournalError};
use leasebroker_client::retry::{Attempt, AttemptOutcome, Retrier, RetryPolicy};
use leasebroker_client::{
    Client, CreateWorker, Error, FlashFirmware, Mutation, OPERATION_CONFLICT, OpKey, Operation, OperationId,
    OperationState, RecordFilter, ResolveOperation,
};

mod cli;
mod output;
mod progress;

use progress::{Display, Progress};

pub use cli::{Cli, Command, FirmwareCommand, OpArgs, OperationsCommand, RecordsCommand, WorkersCommand};
pub use output::OutputFormat;

/// lbctl's exit codes (docs/protocol.md#clients, plus 1 for local failures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// The request succeeded.
    Success = 0,
    /// A local failure: the journal, or a response the SDK could not read.
    Failure = 1,
    /// Bad arguments (clap uses 2 too).
    Usage = 2,
    /// The server refused the request (4xx).
    Refused = 3,
    /// The key was already used with a different request (server or journal).
    KeyReused = 4,
    /// Retrying ran out of attempts or time.
    GaveUp = 5,
    /// The token was refused (401/403).
    Unauthorized = 6,
    /// The operation followed by `--wait` or `operations wait` ended without success (`failed`,
    /// or `uncertain`).
    OperationFailed = 7,
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> Self {
        ExitCode::from(exit as u8)
    }
}

impl Exit {
    /// The exit code for an SDK error.
    pub fn for_error(err: &Error) -> Exit {
        match err {
            Error::KeyReused { .. } => Exit::KeyReused,
            Error::Refused { .. } => Exit::Refused,
            Error::Unauthorized { .. } => Exit::Unauthorized,
            Error::InvalidRequest(_) => Exit::Usage,
            Error::Decode { .. } | Error::Tls(_) => Exit::Failure,
            // Retryable errors only end a command through the retry budget.
            _ => Exit::GaveUp,
        }
    }
}

/// A command's failure: the exit code, the one line for stderr, and what still goes to stdout.
#[derive(Debug)]
pub struct Failure {
    /// The exit code.
    pub exit: Exit,
    /// The reason, one line.
    pub message: String,
    /// The response to print all the same (the final JSON of an operation that failed); usually
    /// empty.
    pub stdout: Vec<u8>,
}

impl Failure {
    fn new(exit: Exit, message: impl Into<String>) -> Self {
        Failure { exit, message: message.into(), stdout: Vec::new() }
    }
}

impl From<Error> for Failure {
    fn from(err: Error) -> Self {
        let exit = Exit::for_error(&err);
        let running = err.problem().filter(|p| p.is(OPERATION_CONFLICT)).and_then(|p| p.operation_id.clone());
        match (err, running) {
            (err @ Error::Tls(_), _) => Failure::new(exit, format!("{err} (for a private CA, pass --ca-cert PATH)")),
            (err, Some(id)) => Failure::new(exit, format!("{err} (`lbctl operations wait {id}` follows it)")),
            (err, None) => Failure::new(exit, err.to_string()),
        }
    }
}

/// The longest stderr line lbctl prints: a server's text is not allowed to flood the terminal.
const MAX_LINE: usize = 2000;

/// `text` made safe for a terminal, as one line: every control character (newlines, ESC and so
/// the ANSI sequences it starts, BEL, C1 controls) and every bidirectional-override character is
/// dropped (whitespace ones become a space), and the result is cut at `MAX_LINE` characters.
/// Server-supplied text passes through here before it reaches stderr.
pub fn one_line(text: &str) -> String {
    let mut line = String::with_capacity(text.len().min(MAX_LINE));
    for (n, c) in text
        .chars()
        .filter(|&c| (!c.is_control() || c.is_whitespace()) && !leasebroker_api::text::is_bidi_control(c))
        .enumerate()
    {
        if n == MAX_LINE {
            line.push_str("...");
            break;
        }
        line.push(if c.is_whitespace() && c != ' ' { ' ' } else { c });
    }
    line
}

/// Prints `text` as one stderr line after `lbctl: ` (above a progress spinner, if one is drawn).
fn warn(text: &str) {
    progress::eprint_line(&format!("lbctl: {}", one_line(text)));
}

/// A response body made safe for a terminal and still the same JSON: every control character
/// but newline and tab (ESC, BEL, CR, the C1 controls such as U+009B) and every bidirectional
/// override is written as a JSON escape `\uXXXX`, which inside a JSON string means the very same
/// character, so a program parsing stdout reads the same value. Bytes that are not UTF-8 become
/// U+FFFD. Everything lbctl prints to stdout passes through here.
pub fn escape_for_terminal(body: &[u8]) -> String {
    leasebroker_api::text::escape_unsafe(&String::from_utf8_lossy(body))
}

/// Prints a response body, escaped for the terminal ([`escape_for_terminal`]), and a newline to
/// stdout.
fn print(body: &[u8]) {
    let mut out = std::io::stdout().lock();
    if !body.is_empty() {
        // A closed stdout (`lbctl ... | head -0`) is the reader's choice, not a failure.
        let _ = out.write_all(escape_for_terminal(body).as_bytes()).and_then(|()| out.write_all(b"\n"));
    }
}

/// Runs the command: the response to stdout (as `-o` and `--quiet` say), a one-line reason to
/// stderr, and the exit code.
pub async fn run(cli: Cli) -> ExitCode {
    let (format, quiet) = (OutputFormat::for_stdout(cli.output), cli.quiet);
    let shown = |body: Vec<u8>| output::render(&body, format, quiet).unwrap_or(body);
    match execute(cli).await {
        Ok(body) => {
            print(&shown(body));
            Exit::Success.into()
        }
        Err(failure) => {
            print(&shown(failure.stdout));
            warn(&failure.message);
            failure.exit.into()
        }
    }
}

/// The least time between two of the lines [`waiting_notice`] makes.
const NOTICE_EVERY: Duration = Duration::from_secs(1);

/// The line printed for an attempt that failed and will be retried: the server, why, and how long
/// lbctl keeps trying. `None` for an attempt that is not retried.
fn waiting_notice(url: &str, budget: Duration, attempt: &Attempt<'_>) -> Option<String> {
    let (AttemptOutcome::Failed(err), Some(wait)) = (&attempt.outcome, attempt.next_wait) else { return None };
    let why = match err {
        // The innermost cause says it plainly ("Connection refused (os error 111)").
        Error::Transport(e) => {
            let mut cause: &dyn std::error::Error = e;
            while let Some(next) = cause.source() {
                cause = next;
            }
            cause.to_string()
        }
        other => other.to_string(),
    };
    Some(format!(
        "waiting for {url}: {why}; retrying in {:.1}s, until --max-elapsed {} is spent (attempt {}, {}s so far)",
        wait.as_secs_f64(),
        humantime::format_duration(budget),
        attempt.number,
        attempt.elapsed.as_secs()
    ))
}

/// Runs the command and returns the body to print.
pub async fn execute(cli: Cli) -> Result<Vec<u8>, Failure> {
    let Some(token) = cli.token.clone() else {
        return Err(Failure::new(Exit::Usage, "no token: pass --token or set LBCTL_TOKEN"));
    };
    let verbose = cli.verbose;
    // The time budget alone ends retrying: the default policy has no attempt cap.
    let mut retrier = Retrier::new(RetryPolicy::default().with_max_elapsed(cli.max_elapsed));
    if verbose {
        retrier = retrier.on_attempt(|attempt| warn(&attempt.to_string()));
    } else {
        // Retrying may last the whole budget: say at once, and on the retries after, what lbctl
        // waits for; at most a line a second (full jitter makes some retries come at once).
        let (url, budget) = (cli.url.clone(), cli.max_elapsed);
        let last = std::sync::Mutex::new(None::<std::time::Instant>);
        retrier = retrier.on_attempt(move |attempt| {
            let Some(line) = waiting_notice(&url, budget, attempt) else { return };
            let mut last = last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_none_or(|at| at.elapsed() >= NOTICE_EVERY) {
                *last = Some(std::time::Instant::now());
                warn(&line);
            }
        });
    }
    let usage = |e: Error| Failure::new(Exit::Usage, e.to_string());
    let mut builder = Client::builder(&cli.url, token).retrier(retrier);
    if let Some(path) = &cli.ca_cert {
        builder = builder.ca_certificates_file(path).map_err(usage)?;
    }
    let client = builder.build().map_err(usage)?;

    let (mutation, op_id, wait) = match cli.command {
        Command::Workers(command) => match command {
            WorkersCommand::Get { id } => return Ok(client.get_worker(&id).await?.body.to_vec()),
            WorkersCommand::List { limit, cursor } => {
                return Ok(client.list_workers(limit, cursor.as_deref()).await?.body.to_vec());
            }
            WorkersCommand::Create { image, cpu, memory_gb, labels, op } => {
                let mut map = BTreeMap::new();
                for (k, v) in &labels {
                    if map.insert(k.clone(), v.clone()).is_some() {
                        return Err(Failure::new(Exit::Usage, format!("label {k:?} given more than once")));
                    }
                }
                let request = CreateWorker {
                    labels: (!map.is_empty()).then_some(map),
                    ..CreateWorker::new(image, cpu, memory_gb)
                };
                (Mutation::CreateWorker(request), op.op_id, false)
            }
            WorkersCommand::Delete { id, op } => (Mutation::DeleteWorker(id), op.op_id, false),
            WorkersCommand::Reboot { id, op } => (Mutation::RebootWorker(id), op.op_id, false),
        },
        Command::Firmware(FirmwareCommand::Flash { node_id, version, force, op, wait }) => {
            let request = if force { FlashFirmware::new(version).forced() } else { FlashFirmware::new(version) };
            (Mutation::FlashFirmware { node_id, request }, op.op_id, wait)
        }
        Command::Operations(OperationsCommand::Get { op_id }) => {
            return Ok(client.get_operation(&op_id).await?.body.to_vec());
        }
        Command::Operations(OperationsCommand::Wait { op_id }) => return follow(&client, &op_id).await,
        Command::Operations(OperationsCommand::Resolve { id, state, reason, op }) => {
            (Mutation::ResolveOperation { op_id: id, request: ResolveOperation::new(state, reason) }, op.op_id, false)
        }
        Command::Records(RecordsCommand::List { state, principal, older_than, limit, cursor }) => {
            let filter = RecordFilter { state, principal, older_than, limit, cursor };
            return Ok(client.list_records(&filter).await?.body.to_vec());
        }
        Command::Records(RecordsCommand::Get { id, body }) => {
            return Ok(client.get_record(&id, body).await?.body.to_vec());
        }
        Command::Records(RecordsCommand::Forget { id, op }) => (Mutation::ForgetRecord(id), op.op_id, false),
    };

    let body = send(&client, &mutation, op_id.as_deref(), cli.journal, verbose).await?;
    if !wait {
        return Ok(body);
    }
    // The accepted operation (a replay, or the journal's record, names the same one). Its state
    // in that body may be long out of date (a journal's record): the first poll, sent at once,
    // is the first state shown.
    let accepted: Operation = serde_json::from_slice(&body)
        .map_err(|e| Failure::new(Exit::Failure, format!("the accepted flash is not an operation: {e}")))?;
    follow(&client, &accepted.id).await
}

/// Follows operation `id` to its end: its final JSON, or exit 7 with that JSON when it failed or
/// ended uncertain (the line then says how to resolve it).
async fn follow(client: &Client, id: &OperationId) -> Result<Vec<u8>, Failure> {
    let mut progress = Progress::start(id, Display::for_stderr());
    let done = client.wait_operation(id, |op| progress.observe(op)).await?;
    progress.finish(&done.value);
    let op = &done.value;
    if op.state == OperationState::Succeeded {
        return Ok(done.body.to_vec());
    }
    let reason = match (&op.state, &op.error) {
        (OperationState::Failed, Some(error)) => format!("operation {id} failed: {error}"),
        (OperationState::Failed, None) => format!("operation {id} failed (the server gave no reason)"),
        (OperationState::Uncertain, error) => format!(
            "operation {id} ended uncertain: {}; check the machine, then `lbctl operations resolve {id} --state \
             succeeded|failed --reason TEXT`",
            error.as_deref().unwrap_or("what came of it cannot be read")
        ),
        (state, _) => format!("operation {id} ended {state}, not succeeded"),
    };
    Err(Failure { exit: Exit::OperationFailed, message: reason, stdout: done.body.to_vec() })
}

/// Sends `mutation` with one key for all its attempts (the journal's, with an op id) and returns
/// the response body; with an op id whose final outcome the journal holds, answers from it.
async fn send(
    client: &Client,
    mutation: &Mutation,
    op_id: Option<&str>,
    journal: Option<PathBuf>,
    verbose: bool,
) -> Result<Vec<u8>, Failure> {
    let journal = match op_id {
        Some(op_id) => {
            let path = journal_path(journal)?;
            let journal = Journal::open(&path).await.map_err(|e| Failure::new(Exit::Failure, e.to_string()))?;
            Some((journal, op_id))
        }
        None => None,
    };
    // One key for every attempt of this operation: from the journal (durable before the first
    // attempt) or, without an op id, made here once and kept in memory.
    let key = match &journal {
        Some((journal, op_id)) => match journal.begin(op_id, &mutation.fingerprint()).await {
            Ok(key) => key,
            Err(e @ JournalError::RequestChanged { .. }) => {
                return Err(Failure::new(Exit::KeyReused, format!("{e}; not sent (use a new --op-id)")));
            }
            Err(e) => return Err(Failure::new(Exit::Failure, e.to_string())),
        },
        None => OpKey::new_v4(),
    };
    if verbose {
        match &journal {
            Some((j, op_id)) => eprintln!("lbctl: op {op_id:?} key {key} (journal {})", j.path().display()),
            None => eprintln!("lbctl: key {key} (not journaled: no --op-id)"),
        }
    }
    // A final outcome on record is the answer: resending could run the operation again once the
    // server has forgotten the key (its retention), and the answer would be the same before that.
    if let Some((journal, op_id)) = &journal {
        let entry = journal.entry(op_id).await.map_err(|e| Failure::new(Exit::Failure, e.to_string()))?;
        if let Some(outcome) = entry.and_then(|e| e.outcome) {
            if verbose {
                eprintln!(
                    "lbctl: op {op_id:?} answered from the journal (status {}, recorded {}); nothing sent",
                    outcome.status, outcome.finished_at
                );
            }
            return match outcome.error() {
                None => Ok(outcome.body),
                Some(err) => {
                    let failure = Failure::from(err);
                    Err(Failure::new(failure.exit, format!("{} (recorded in the journal)", failure.message)))
                }
            };
        }
    }

    let result = client.mutate(mutation, &key).await;
    if let Some((journal, op_id)) = &journal {
        // Record final answers only; after a give-up the outcome is unknown and a rerun will learn it.
        let outcome = match &result {
            Ok(response) => Some((response.status.as_u16(), response.body.to_vec())),
            Err(err @ (Error::Refused { .. } | Error::KeyReused { .. })) => {
                let body = err.problem().and_then(|p| serde_json::to_vec(p).ok()).unwrap_or_default();
                err.status().map(|s| (s.as_u16(), body))
            }
            Err(_) => None,
        };
        if let Some((status, body)) = outcome
            && let Err(e) = journal.finish(op_id, status, &body).await
        {
            warn(&format!("warning: could not record the outcome in the journal: {e}"));
        }
    }
    Ok(result?.body.to_vec())
}

/// `--journal`, else `$XDG_STATE_HOME/lbctl/journal.db`, else `~/.local/state/lbctl/journal.db`.
fn journal_path(explicit: Option<PathBuf>) -> Result<PathBuf, Failure> {
    if let Some(path) = explicit {
        return Ok(path);
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        // The XDG spec says a relative value is invalid and must be ignored.
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".local/state")));
    state
        .map(|dir| dir.join("lbctl").join("journal.db"))
        .ok_or_else(|| Failure::new(Exit::Failure, "no journal location: pass --journal or set HOME"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use leasebroker_client::RecordState;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        // Catches clashes such as `flash --version` against the top-level `--version` flag.
        Cli::command().debug_assert();
        let cli =
            Cli::try_parse_from(["lbctl", "firmware", "flash", "node-7", "--version", "2.1.0", "--wait"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Firmware(FirmwareCommand::Flash { ref version, wait: true, .. }) if version == "2.1.0"
        ));
        assert!(
            Cli::try_parse_from(["lbctl", "--version"])
                .is_err_and(|e| e.kind() == clap::error::ErrorKind::DisplayVersion)
        );
        let cli = Cli::try_parse_from(["lbctl", "operations", "wait", "op-1"]).unwrap();
        assert!(
            matches!(cli.command, Command::Operations(OperationsCommand::Wait { ref op_id }) if op_id.as_str() == "op-1")
        );
    }

    #[test]
    fn records_list_takes_every_record_state_and_no_other_word() {
        for state in ["in_flight", "failed", "completed", "uncertain"] {
            let cli = Cli::try_parse_from(["lbctl", "records", "list", "--state", state]).unwrap();
            assert!(
                matches!(cli.command, Command::Records(RecordsCommand::List { state: Some(ref s), .. }) if s.as_str() == state && !matches!(s, RecordState::Other(_))),
                "{state}"
            );
        }
        assert!(Cli::try_parse_from(["lbctl", "records", "list", "--state", "running"]).is_err());
    }

    #[test]
    fn one_line_drops_controls_and_bidi_overrides_and_bounds_the_length() {
        assert_eq!(one_line("a\r\nb\tc\u{1b}[31md\u{7}e\u{9b}f\u{202e}g\u{85}h"), "a  b c[31mdefg h");
        let long = one_line(&"x".repeat(MAX_LINE * 2));
        assert_eq!(long.len(), MAX_LINE + "...".len());
        assert_eq!(one_line("plain text, kept: é ü 中"), "plain text, kept: é ü 中");
    }
}
