//! This crate's retry core and journal under `idemcheck client` (docs/protocol.md#clients): one logical POST of a
//! small JSON body to `$IDEMCHECK_URL$IDEMCHECK_PATH`, keyed by the journal
//! (`$IDEMCHECK_DIR/rust-sdk-journal.db`) under the operation `$IDEMCHECK_OPERATION`, retried by a
//! [`Retrier`] within `$IDEMCHECK_MAX_ELAPSED` seconds. Exits 0 on a 2xx, 1 on an error.
//!
//! ```sh
//! cargo build -p leasebroker-client --example idemcheck_adapter
//! idemcheck client -- target/debug/examples/idemcheck_adapter
//! ```

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use leasebroker_client::RetryPolicy;
use leasebroker_client::journal::{Journal, RequestFingerprint};
use leasebroker_client::retry::Retrier;

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set: run me under `idemcheck client`"))
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("IDEMCHECK_PATH").unwrap_or_else(|_| "/v1/things".to_owned());
    let url = format!("{}{path}", var("IDEMCHECK_URL")?);
    let operation = var("IDEMCHECK_OPERATION")?;
    let budget = Duration::from_secs(var("IDEMCHECK_MAX_ELAPSED")?.parse()?);
    let body = br#"{"name":"idemcheck"}"#;

    // The key is committed to the journal before the first attempt: a rerun finds it.
    let journal = Journal::open(Path::new(&var("IDEMCHECK_DIR")?).join("rust-sdk-journal.db")).await?;
    let key = journal.begin(&operation, &RequestFingerprint::of("POST", &path, body)).await?;
    if let Some(outcome) = journal.entry(&operation).await?.and_then(|e| e.outcome) {
        println!("{} (from the journal)", String::from_utf8_lossy(&outcome.body));
        return Ok(());
    }
    let http = reqwest::Client::new();
    let retrier =
        Retrier::new(RetryPolicy::default().with_max_elapsed(budget)).on_attempt(|attempt| eprintln!("{attempt}"));
    let result =
        retrier.send(Some(&key), || http.post(&url).header("content-type", "application/json").body(&body[..])).await;
    match result {
        Ok(response) => {
            journal.finish(&operation, response.status.as_u16(), &response.body).await?;
            println!("{}", String::from_utf8_lossy(&response.body));
            Ok(())
        }
        Err(error) => Err(error.into()),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemcheck_adapter: {error}");
            ExitCode::FAILURE
        }
    }
}
