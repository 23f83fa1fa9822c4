//! The command line: `lbctl [OPTIONS] workers|firmware|operations ...`.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use leasebroker_client::{NodeId, OperationId, RecordId, RecordState, Resolution, WorkerId};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "lbctl",
    version,
    about = "Provision and manage leasebroker workers and flash node firmware, safely retried",
    after_help = "Exit codes: 0 success, 1 local failure, 2 usage, 3 refused (4xx), 4 key reused with a \
                  different request, 5 gave up retrying, 6 unauthorized, 7 the followed operation failed \
                  or ended uncertain."
)]
pub struct Cli {
    /// The leasebroker base URL.
    #[arg(long, env = "LBCTL_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// The bearer token.
    #[arg(long, env = "LBCTL_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
    /// The op-id journal [default: $XDG_STATE_HOME/lbctl/journal.db or ~/.local/state/lbctl/journal.db].
    #[arg(long, env = "LBCTL_JOURNAL", global = true)]
    pub journal: Option<PathBuf>,
    /// The retry budget: keep retrying until this much time has passed (e.g. 30s, 10m).
    #[arg(long, default_value = "10m", value_parser = leasebroker_api::parse::duration, global = true)]
    pub max_elapsed: Duration,
    /// A PEM file of CA certificates to trust for https URLs, besides the system's roots.
    #[arg(long, env = "LBCTL_CA_CERT", value_name = "PATH", global = true)]
    pub ca_cert: Option<PathBuf>,
    /// Print every attempt and the wait before the next one to stderr.
    #[arg(long, short, global = true)]
    pub verbose: bool,
    /// How to print the answer [default: table on a terminal, json when piped].
    #[arg(long, short = 'o', value_enum, global = true)]
    pub output: Option<crate::output::OutputFormat>,
    /// Print only ids, one a line (of a page: its workers', records' or operations').
    #[arg(long, short, global = true)]
    pub quiet: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Workers: create, get, list, delete, reboot.
    #[command(subcommand)]
    Workers(WorkersCommand),
    /// Node firmware: flash (admin token).
    #[command(subcommand)]
    Firmware(FirmwareCommand),
    /// Long-running operations such as firmware flashes: get, wait, resolve (admin token).
    #[command(subcommand)]
    Operations(OperationsCommand),
    /// Idempotency records: list, get, forget (admin token).
    #[command(subcommand)]
    Records(RecordsCommand),
}

/// `lbctl records ...`.
#[derive(Debug, Subcommand)]
pub enum RecordsCommand {
    /// List idempotency records, one page (admin token).
    ///
    /// `--state in_flight --older-than 10m` lists the operations stuck in flight for ten minutes
    /// or more (their attempt has not been renewed since).
    List {
        /// Only records in this state.
        #[arg(long, value_parser = PossibleValuesParser::new(RecordState::KNOWN).map(RecordState::from))]
        state: Option<RecordState>,
        /// Only this principal's records.
        #[arg(long)]
        principal: Option<String>,
        /// Only records whose current attempt started at least this long ago (90s, 10m, 2h, 7d).
        #[arg(long)]
        older_than: Option<String>,
        /// Page size (1-500; the server's default is 100).
        #[arg(long)]
        limit: Option<u32>,
        /// The `next_cursor` of the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one record (admin token).
    Get {
        /// The record id (32 hex digits).
        id: RecordId,
        /// Include the stored response body.
        #[arg(long)]
        body: bool,
    },
    /// Forget a completed or failed record, so that its key's next request runs as a new
    /// operation (admin token). A record in flight is refused (exit 3). The server writes an
    /// audit line and row.
    Forget {
        /// The record id (32 hex digits).
        id: RecordId,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
    },
}

/// `lbctl firmware ...`.
#[derive(Debug, Subcommand)]
pub enum FirmwareCommand {
    /// Flash a node's BMC firmware (admin token): prints the operation the server accepted.
    ///
    /// The flash runs on the server after it answers. Retries and reruns with the same key (one
    /// key per run; with --op-id, the journal's key across runs) get the same operation back
    /// instead of starting a second flash. A flash already running on the node under another key
    /// is refused (exit 3) and named: follow it with `lbctl operations wait OP_ID`, and flash again
    /// under a new --op-id once it has ended (the server keeps the refusal as this key's answer).
    #[command(after_help = "With --wait, exits 0 when the flash succeeded and 7 when it failed.")]
    Flash {
        /// The node whose BMC to flash, e.g. node-0007.
        node_id: NodeId,
        /// The firmware version to write.
        #[arg(long)]
        version: String,
        /// Flash even though a worker holds the node (its VM is disrupted); without it such a
        /// flash is refused with `node-in-use` (exit 3).
        #[arg(long)]
        force: bool,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
        /// Follow the flash to its end (a spinner on a terminal, plain lines otherwise) and print
        /// the final operation.
        #[arg(long)]
        wait: bool,
    },
}

/// `lbctl operations ...`.
#[derive(Debug, Subcommand)]
pub enum OperationsCommand {
    /// Show a long-running operation once (admin token).
    Get {
        /// The server's operation id (op-...), as a flash printed it.
        op_id: OperationId,
    },
    /// Follow a long-running operation to its end and print it (admin token).
    ///
    /// Polls about once a second (longer when the server asks with Retry-After), showing a
    /// spinner with the operation's id, state and elapsed time on a terminal and one plain line
    /// per state change otherwise. A poll that fails is retried within --max-elapsed.
    #[command(after_help = "Exits 0 when the operation succeeded, and 7 when it failed or ended uncertain \
                            (then `lbctl operations resolve` ends it once the machine is checked).")]
    Wait {
        /// The server's operation id (op-...), as a flash printed it.
        op_id: OperationId,
    },
    /// End an `uncertain` operation as you found the machine (admin token): prints the operation.
    ///
    /// An operation is `uncertain` when its flash was sent and what came of it cannot be read
    /// (the BMC keeps no task for it and serves no firmware inventory); its node takes no other
    /// flash until it is resolved. The server writes an audit line with the reason. An operation
    /// in another state is refused (exit 3, `operation-not-uncertain`).
    Resolve {
        /// The server's operation id (op-...).
        #[arg(value_name = "OP_ID")]
        id: OperationId,
        /// How the machine was found: `succeeded` (it runs the version) or `failed`.
        #[arg(long, value_parser = parse_resolution)]
        state: Resolution,
        /// What was found, and how (1 to 500 characters).
        #[arg(long)]
        reason: String,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
    },
}

/// `lbctl workers ...`.
#[derive(Debug, Subcommand)]
pub enum WorkersCommand {
    /// Create a worker.
    Create {
        /// The image to boot.
        #[arg(long)]
        image: String,
        /// CPUs.
        #[arg(long)]
        cpu: u32,
        /// Memory in GiB.
        #[arg(long)]
        memory_gb: u32,
        /// A label, K=V; repeat for more.
        #[arg(long = "label", value_name = "K=V", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
    },
    /// Show one worker.
    Get {
        /// The worker id.
        id: WorkerId,
    },
    /// List your workers, one page.
    List {
        /// Page size.
        #[arg(long)]
        limit: Option<u32>,
        /// The `next_cursor` of the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Delete a worker (its lease, node and VM).
    Delete {
        /// The worker id.
        id: WorkerId,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
    },
    /// Reboot a worker: once per operation, however often it is retried.
    Reboot {
        /// The worker id.
        id: WorkerId,
        /// The operation's identity across retries and reruns.
        #[command(flatten)]
        op: OpArgs,
    },
}

/// The durable identity of a mutating command.
#[derive(Debug, Args)]
pub struct OpArgs {
    /// Name this operation: its key goes to the journal before the first attempt, and a rerun with
    /// the same op id (after a crash or a give-up) reuses it instead of doing the work twice.
    #[arg(long, value_parser = parse_op_id)]
    pub op_id: Option<String>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        Some(_) => Err(format!("label {s:?} has an empty key; expected K=V")),
        None => Err(format!("label {s:?} has no '='; expected K=V")),
    }
}

fn parse_resolution(s: &str) -> Result<Resolution, String> {
    s.parse().map_err(|e: leasebroker_api::InvalidRequest| e.message().to_owned())
}

fn parse_op_id(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 256 || s.chars().any(char::is_control) {
        return Err("an op id is 1 to 256 characters, without control characters".to_owned());
    }
    Ok(s.to_owned())
}
