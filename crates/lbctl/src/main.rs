//! The `lbctl` binary: parse, run, exit with the docs/protocol.md#clients code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Usage errors exit 2 here, before any network or journal work.
    let cli = lbctl::Cli::parse();
    match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(lbctl::run(cli)),
        Err(e) => {
            eprintln!("lbctl: cannot start the runtime: {e}");
            lbctl::Exit::Failure.into()
        }
    }
}
