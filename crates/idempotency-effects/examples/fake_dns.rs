//! A stand-in DNS provider for the `dns_records` example and its test: records in memory, each
//! carrying the caller's `tag`, and counters of what it was asked to do.
//!
//! ```text
//! cargo run -p idempotency-effects --example fake_dns -- --listen 127.0.0.1:5300 --create-delay-ms 2000
//! curl -s localhost:5300/stats      # {"creates_received":0,"creates":0,"deletes":0,"records":0}
//! ```
//!
//! `POST /records {name,value,tag}` answers `201 {id}` after `--create-delay-ms` (the record is
//! made then, even when the caller has gone: a real provider keeps working after its caller
//! timed out or died); with `--hold-creates`, creates land only once `POST /admin/land` is called. `GET /records?tag=T` (exact) or `?tag_prefix=P`; `DELETE /records/{id}`
//! (`204`, or `404` when gone).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, get};
use axum::{Json, Router};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
struct Args {
    /// Where to listen (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// How long a create takes to take effect and answer.
    #[arg(long, default_value_t = 0)]
    create_delay_ms: u64,
    /// Hold every create (it has not taken effect) until `POST /admin/land`: a landing placed
    /// exactly, for tests.
    #[arg(long)]
    hold_creates: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct DnsRecord {
    #[serde(default)]
    id: String,
    name: String,
    value: String,
    tag: String,
}

#[derive(Debug, Default, Serialize)]
struct Stats {
    creates_received: u64,
    creates: u64,
    deletes: u64,
    records: usize,
}

#[derive(Debug, Default)]
struct Zone {
    next: u64,
    records: BTreeMap<String, DnsRecord>,
    stats: Stats,
}

#[derive(Debug)]
struct Provider {
    zone: Mutex<Zone>,
    delay: Duration,
    /// `false` while creates are held (`--hold-creates`).
    landing: tokio::sync::watch::Sender<bool>,
}

type Shared = Arc<Provider>;

async fn create(State(s): State<Shared>, Json(mut rec): Json<DnsRecord>) -> (StatusCode, Json<serde_json::Value>) {
    s.zone.lock().unwrap().stats.creates_received += 1;
    // Made even if the caller is gone by then: the handler runs in its own task.
    let made = tokio::spawn(async move {
        tokio::time::sleep(s.delay).await;
        let _ = s.landing.subscribe().wait_for(|landing| *landing).await;
        let mut z = s.zone.lock().unwrap();
        z.next += 1;
        rec.id = format!("rec-{:04}", z.next);
        z.stats.creates += 1;
        z.records.insert(rec.id.clone(), rec.clone());
        rec.id
    });
    let id = made.await.unwrap_or_default();
    (StatusCode::CREATED, Json(serde_json::json!({ "id": id })))
}

#[derive(Debug, Deserialize)]
struct Filter {
    tag: Option<String>,
    tag_prefix: Option<String>,
}

async fn list(State(s): State<Shared>, Query(f): Query<Filter>) -> Json<Vec<DnsRecord>> {
    let z = s.zone.lock().unwrap();
    let keep = |r: &&DnsRecord| {
        f.tag.as_ref().is_none_or(|t| r.tag == *t) && f.tag_prefix.as_ref().is_none_or(|p| r.tag.starts_with(p))
    };
    Json(z.records.values().filter(keep).cloned().collect())
}

async fn remove(State(s): State<Shared>, Path(id): Path<String>) -> StatusCode {
    let mut z = s.zone.lock().unwrap();
    if z.records.remove(&id).is_some() {
        z.stats.deletes += 1;
        StatusCode::NO_CONTENT
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn land(State(s): State<Shared>) -> StatusCode {
    s.landing.send_replace(true);
    StatusCode::NO_CONTENT
}

async fn stats(State(s): State<Shared>) -> Json<Stats> {
    let z = s.zone.lock().unwrap();
    Json(Stats { records: z.records.len(), ..z.stats })
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let (landing, _) = tokio::sync::watch::channel(!args.hold_creates);
    let delay = Duration::from_millis(args.create_delay_ms);
    let state: Shared = Arc::new(Provider { zone: Mutex::default(), delay, landing });
    let app = Router::new()
        .route("/records", get(list).post(create))
        .route("/records/{id}", delete(remove))
        .route("/stats", get(stats))
        .route("/admin/land", axum::routing::post(land))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}
