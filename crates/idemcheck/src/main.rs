//! `idemcheck`: checks any HTTP API that claims `Idempotency-Key` support against data-file
//! vectors (`conformance/vectors/`), one rule each, under a profile (`ietf-draft`, `stripe`,
//! `leasebroker`); `idemcheck client -- COMMAND` checks an HTTP client's idempotent retries
//! against a scripted API. See the crate README.

mod checks;
mod client;
mod clientcheck;
mod profile;
mod report;
mod vectors;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::checks::Ctx;
use crate::client::Target;
use crate::profile::{Counter, Profile, Req};
use crate::report::{Outcome, Report};

/// Checks an HTTP API's Idempotency-Key support against conformance vectors.
#[derive(Debug, Parser)]
#[command(name = "idemcheck", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the vectors against a target: one line per vector, then `N passed, M failed, K n/a`;
    /// exits 0 only when none failed.
    Run(RunArgs),
    /// Lists the vectors (with the profile: whether each applies to it).
    List {
        /// Only say which vectors apply to this profile.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(profile::NAMES))]
        profile: Option<String>,
        /// The vectors' directory (default: conformance/vectors).
        #[arg(long, value_name = "DIR")]
        vectors: Option<PathBuf>,
    },
    /// Checks an HTTP client: serves a scripted API on loopback and runs COMMAND once per
    /// scenario (it makes one logical POST to $IDEMCHECK_URL/v1/things through the client under
    /// test); one line per scenario, then `N passed, M failed`; exits 0 only when none failed.
    Client(clientcheck::ClientArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The target's base URL, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// A bearer token. Repeat it for the vectors that need more than one: the second is another
    /// principal (scope per principal); for the leasebroker profile the third is the admin token
    /// (the firmware flash).
    #[arg(long, env = "IDEMCHECK_TOKEN", hide_env_values = true)]
    token: Vec<String>,
    /// A mutating route, as 'METHOD /path', answered 2xx with a new key; the first is the
    /// route under test, a second one is another endpoint (scope per endpoint). Replaces the
    /// profile's routes.
    #[arg(long)]
    route: Vec<String>,
    /// The JSON body of the --route before it (one per --route, in order).
    #[arg(long)]
    body: Vec<String>,
    /// How the target's executions are counted (the concurrent duplicates, a refused key): a
    /// GET path answered with JSON, and a JSON pointer to the number (or array) that counts,
    /// e.g. '/counter#/executions' (no pointer: the whole answer). Sent with the first token.
    /// Replaces the profile's counter.
    #[arg(long, value_name = "PATH[#POINTER]")]
    counter: Option<String>,
    /// What the target promises.
    #[arg(long, default_value = "ietf-draft", value_parser = clap::builder::PossibleValuesParser::new(profile::NAMES))]
    profile: String,
    /// The vectors' directory (default: conformance/vectors).
    #[arg(long, value_name = "DIR")]
    vectors: Option<PathBuf>,
    /// Writes a report: markdown (.md) or JSON (.json). May be repeated (both forms of one run).
    #[arg(long, value_name = "out.md|out.json")]
    report: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = || tokio::runtime::Runtime::new().map_err(|e| format!("cannot start the runtime: {e}"));
    let result = match cli.command {
        Command::List { profile, vectors } => list(profile.as_deref(), vectors),
        Command::Run(args) => runtime().and_then(|rt| rt.block_on(run(args))),
        Command::Client(args) => runtime().and_then(|rt| rt.block_on(clientcheck::run(args))),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idemcheck: {}", e.replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

fn list(profile: Option<&str>, dir: Option<PathBuf>) -> Result<ExitCode, String> {
    let vectors = vectors::load(&dir.unwrap_or_else(vectors::default_dir))?;
    if let Some(p) = profile.and_then(Profile::named) {
        println!("profile {}: {}\n", p.name, p.about.split_whitespace().collect::<Vec<_>>().join(" "));
    }
    for v in &vectors {
        let applies = match profile {
            Some(p) if !v.applies_to(p) => " (n/a)",
            _ => "",
        };
        println!("{:<34} {}{applies}\n{:<34} source: {}", v.id, v.rule, "", v.source);
    }
    println!("{} vectors", vectors.len());
    Ok(ExitCode::SUCCESS)
}

async fn run(args: RunArgs) -> Result<ExitCode, String> {
    if !(args.url.starts_with("http://") || args.url.starts_with("https://")) {
        return Err(format!("--url {}: expected http://HOST:PORT or https://...", args.url));
    }
    if args.body.len() > args.route.len() {
        return Err("--body without a --route before it".into());
    }
    let routes = args
        .route
        .iter()
        .enumerate()
        .map(|(i, r)| Req::parse(r, args.body.get(i).map(String::as_str)))
        .collect::<Result<Vec<_>, _>>()?;
    let profile = Profile::named(&args.profile).ok_or_else(|| format!("unknown profile {}", args.profile))?;
    let mut profile = profile.with_routes(routes);
    if let Some(counter) = &args.counter {
        profile.counter = Some(Counter::parse(counter)?);
    }
    if let Some(path) =
        args.report.iter().find(|p| !matches!(p.extension().and_then(|e| e.to_str()), Some("md" | "json")))
    {
        return Err(format!("--report {}: name a .md or .json file", path.display()));
    }
    let vectors = vectors::load(&args.vectors.unwrap_or_else(vectors::default_dir))?;
    let target = Target::new(&args.url, args.token).map_err(|e| e.to_string())?;

    println!("idemcheck: {} vectors against {} (profile {})", vectors.len(), target.url, profile.name);
    let mut outcomes = Vec::with_capacity(vectors.len());
    for vector in &vectors {
        let mut ctx = Ctx { target: &target, profile: &profile, vector, log: Vec::new() };
        let verdict = checks::run(&mut ctx).await;
        let outcome = Outcome::new(vector, verdict, ctx.log);
        println!("{}", outcome.line());
        outcomes.push(outcome);
    }
    let count = |r: &str| outcomes.iter().filter(|o| o.result == r).count();
    let report = Report {
        target: target.url.clone(),
        profile: profile.name.to_owned(),
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        passed: count("pass"),
        failed: count("fail"),
        not_applicable: count("n/a"),
        vectors: outcomes,
    };
    println!("{}", report.summary());
    for path in &args.report {
        report.write(path)?;
    }
    Ok(if report.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
