//! The `faultline` binary: parse, run, exit non-zero when a protected run broke an invariant.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = faultline::cli::Cli::parse();
    match faultline::run::main(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("faultline: an invariant broke in a protected run (see the table and the JSON report)");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("faultline: {e:#}");
            ExitCode::from(2)
        }
    }
}
