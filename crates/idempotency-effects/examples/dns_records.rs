//! A second adopter: a DNS-record endpoint that gets every guarantee of docs/protocol.md#side-effects without
//! writing a fence. `IdempotencyLayer` keeps the HTTP half (records, replays); this crate keeps
//! the downstream half: one DNS record per key, whatever the retries, kills and late landings.
//!
//! ```text
//! cargo run -p idempotency-effects --example fake_dns -- --listen 127.0.0.1:5300 &
//! cargo run -p idempotency-effects --example dns_records -- --dns-url http://127.0.0.1:5300 \
//!     --listen 127.0.0.1:3000 --db /tmp/dns.db &
//! curl -si -X POST localhost:3000/v1/records -H 'Idempotency-Key: "rec-1"' -H 'X-User: team-a' \
//!     -H 'content-type: application/json' -d '{"name":"api.example.com","value":"10.0.0.7"}'
//! curl -s localhost:5300/stats   # creates: 1, however often the POST is retried
//! ```

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use idempotency::Principal;
use idempotency_effects::{
    CallError, Effect, EffectError, Effects, InventorySweep, Operation, Reaper, ReaperConfig, Sent, SqlLedger, Tagged,
};
use idempotency_sqlx::SqliteStore;
use idempotency_tower::{IdempotencyContext, IdempotencyLayer, Problem};
use serde::Deserialize;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// The SQLite file of the idempotency records and the effect ledger (one file, two tables).
    #[arg(long)]
    db: String,
    /// The DNS provider.
    #[arg(long)]
    dns_url: String,
    /// The longest a DNS call may take (then it counts as "may have happened").
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    call_timeout: Duration,
    /// The longest a sent call may take to take effect; longer than --call-timeout.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// The layer's in-flight TTL: a claim older than this (its process died) is taken over.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    in_flight_ttl: Duration,
    /// How long an operation goes without an attempt before the reaper rolls it back.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    abandon_after: Duration,
    /// The reaper's and the inventory sweep's tick.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    sweep_interval: Duration,
}

/// The side effect: a DNS record, tagged with its sub-key.
#[derive(Debug)]
struct DnsRecord {
    http: reqwest::Client,
    url: String,
}

/// A 4xx or an unsent call did nothing; a timeout, a reset or a 5xx may have.
fn classify(e: reqwest::Error) -> CallError {
    match e.status() {
        Some(s) if s.is_client_error() => CallError::definite(e).with_status(s.as_u16()),
        Some(s) => CallError::ambiguous(e).with_status(s.as_u16()),
        None if e.is_connect() => CallError::definite(e),
        None => CallError::ambiguous(e),
    }
}

/// What the provider's create promises: its id, nothing more.
#[derive(Debug, Deserialize)]
struct Created {
    id: String,
}

#[derive(Debug, Deserialize)]
struct Listed {
    id: String,
    tag: String,
}

impl DnsRecord {
    /// `query`: `tag=...` or `tag_prefix=...` (tags are `sk-` and hex: nothing to escape).
    async fn list(&self, query: &str) -> Result<Vec<Listed>, CallError> {
        let res = self.http.get(format!("{}/records?{query}", self.url)).send().await.map_err(classify)?;
        res.error_for_status().map_err(classify)?.json().await.map_err(CallError::ambiguous)
    }
}

#[async_trait]
impl Effect for DnsRecord {
    fn name(&self) -> &str {
        "dns-record"
    }
    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        Ok(self.list(&format!("tag={tag}")).await?.into_iter().map(|r| r.id).collect())
    }
    fn can_undo(&self) -> bool {
        true
    }
    async fn undo(&self, id: &str) -> Result<bool, CallError> {
        let res = self.http.delete(format!("{}/records/{id}", self.url)).send().await.map_err(classify)?;
        Ok(res.status() != StatusCode::NOT_FOUND && res.error_for_status().map_err(classify)?.status().is_success())
    }
    fn can_list(&self) -> bool {
        true
    }
    async fn list(&self, prefix: &str) -> Result<Vec<Tagged>, CallError> {
        Ok(DnsRecord::list(self, &format!("tag_prefix={prefix}"))
            .await?
            .into_iter()
            .map(|r| Tagged { tag: r.tag, id: r.id })
            .collect())
    }
}

#[derive(Debug, Deserialize, serde::Serialize)]
struct NewRecord {
    name: String,
    value: String,
}

#[derive(Clone)]
struct App {
    effects: Effects,
    dns: Arc<DnsRecord>,
}

async fn create(State(app): State<App>, ctx: IdempotencyContext, body: axum::body::Bytes) -> Response {
    let Ok(rec) = serde_json::from_slice::<NewRecord>(&body) else {
        return Problem::new(
            StatusCode::BAD_REQUEST,
            "validation-failed",
            "Invalid request",
            "expected {\"name\",\"value\"}",
        )
        .into_response();
    };
    let attempt = app.effects.attempt(&Operation::of(ctx.claim().record(), "create-record"));
    let dns = app.dns.clone();
    let made = attempt
        .run(&*app.dns, |tag| async move {
            let body = serde_json::json!({ "name": rec.name, "value": rec.value, "tag": tag });
            let res = dns.http.post(format!("{}/records", dns.url)).json(&body).send().await.map_err(classify)?;
            // Read only what the contract promises: a 2xx and the id.
            let id: Created = res.error_for_status().map_err(classify)?.json().await.map_err(CallError::ambiguous)?;
            Ok(Sent::Done(id.id))
        })
        .await;
    let made = match made {
        Ok(outcome) => attempt.finish().await.map(|()| outcome),
        Err(e) => Err(e),
    };
    match made {
        Ok(outcome) => (StatusCode::CREATED, Json(serde_json::json!({ "id": outcome.id() }))).into_response(),
        Err(EffectError::Refused(e)) => {
            Problem::new(StatusCode::BAD_GATEWAY, "upstream-unavailable", "DNS provider refused", e.to_string())
                .into_response()
        }
        Err(e) => {
            let p = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream-unavailable",
                "DNS provider unavailable",
                e.to_string(),
            );
            p.with_retry_after(e.retry_after().unwrap_or(1)).into_response()
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Colours only on a terminal: a log file stays plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(ansi).init();
    let args = Args::parse();
    anyhow::ensure!(args.settle > args.call_timeout, "--settle must be longer than --call-timeout");
    let url = format!("sqlite://{}", args.db);
    let store = Arc::new(SqliteStore::connect(&url).await?);
    store.migrate().await?;
    let ledger = Arc::new(SqlLedger::connect(&url, 4).await?);
    ledger.migrate().await?;
    let http = reqwest::Client::builder().timeout(args.call_timeout).build()?;
    let dns = Arc::new(DnsRecord { http, url: args.dns_url.trim_end_matches('/').to_owned() });
    let effects = Effects::new(ledger.clone()).settle(args.settle);

    let config = ReaperConfig {
        settle: args.settle,
        abandon_after: args.abandon_after,
        in_flight_ttl: args.in_flight_ttl,
        ..Default::default()
    };
    let reaper = Reaper::new(ledger.clone(), store.clone(), vec![dns.clone()], config);
    let sweep = InventorySweep::new(ledger, vec![dns.clone()], args.settle);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(args.sweep_interval).await;
            match (reaper.tick().await, sweep.sweep().await) {
                (Ok(pass), Ok(swept)) => tracing::info!(?pass, ?swept, "background tick"),
                (r, s) => tracing::warn!(reaper = ?r.err(), sweep = ?s.err(), "background tick failed"),
            }
        }
    });

    let layer = IdempotencyLayer::builder(store)
        .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(Principal::new))
        .in_flight_ttl(args.in_flight_ttl)
        .try_build()?;
    let app = Router::new().route("/v1/records", post(create)).with_state(App { effects, dns }).layer(layer);
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
