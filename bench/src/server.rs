//! The layer-overhead server: one trivial handler, six ways of serving it.

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use clap::{Args, ValueEnum};
use idempotency::{Principal, Store};
use idempotency_stores::StoreUrl;
use idempotency_tower::IdempotencyLayer;

/// What sits between the listener and the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// No layer at all.
    Bare,
    /// No layer; the handler parses the body with axum's `Json` extractor (what a user's own
    /// handler does), and answers the same bytes.
    Json,
    /// Our layer, in-memory store.
    Memory,
    /// Our layer, SQLite store in a temporary file.
    Sqlite,
    /// Our layer, PostgreSQL store (`--database`), the store's default pool of 10.
    Postgres,
    /// The peer crate `axum-idempotent` with its session layer's in-memory store, keyed by the
    /// `Idempotency-Key` header.
    Peer,
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[arg(long, value_enum)]
    mode: Mode,
    /// PostgreSQL URL for `--mode postgres`.
    #[arg(long)]
    database: Option<String>,
    /// Bytes of completed responses answered from memory on a store that announces its changes
    /// (PostgreSQL), as leasebroker and the gateway do by default; 0: every replay reads the
    /// store.
    #[arg(long, default_value_t = idempotency::DEFAULT_REPLAY_CACHE_BYTES)]
    replay_cache: u64,
}

/// The handler: the cheapest thing that still looks like a create.
async fn create() -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    (StatusCode::CREATED, [("content-type", "application/json")], r#"{"id":"wkr-1","state":"booting"}"#)
}

/// The body `bench/wrk/idem.lua` sends, as a user's handler would declare it.
#[derive(Debug, serde::Deserialize)]
struct CreateWorker {
    image: String,
    cpu: u32,
    memory_gb: u32,
}

/// The `json` baseline: the same answer, after parsing the body as a typed handler does.
async fn create_json(
    axum::Json(req): axum::Json<CreateWorker>,
) -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    // Read, as a handler would, so the parse is not optimized away.
    std::hint::black_box((&req.image, req.cpu, req.memory_gb));
    create().await
}

fn ours(store: Arc<dyn Store>) -> Router {
    // Every default: raw-body fingerprint, in-flight claims, 24 h retention. The benchmark has
    // no authentication, so every request shares one (explicitly allowed) anonymous scope.
    let layer = IdempotencyLayer::builder(store).allow_anonymous(Principal::new("bench")).build();
    Router::new().route("/v1/workers", post(create)).layer(layer)
}

fn peer() -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::memory::MemoryStore as SessionMemory;
    use ruts::{CookieOptions, SessionLayer};

    let sessions = Arc::new(SessionMemory::new());
    let options = IdempotentOptions::default().use_idempotency_key_header(Some("idempotency-key")).expire_after(3600);
    Router::new()
        .route("/v1/workers", post(create))
        .layer(IdempotentLayer::<SessionMemory>::new(options))
        .layer(SessionLayer::new(sessions).with_cookie_options(CookieOptions::build().name("session").path("/")))
        .layer(tower_cookies::CookieManagerLayer::new())
}

pub(crate) async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Kept alive for the life of the server: the SQLite file lives in it.
    let dir = tempfile::tempdir()?;
    let app = match args.mode {
        Mode::Bare => Router::new().route("/v1/workers", post(create)),
        Mode::Json => Router::new().route("/v1/workers", post(create_json)),
        Mode::Memory | Mode::Sqlite | Mode::Postgres => {
            let url: StoreUrl = match args.mode {
                Mode::Sqlite => format!("sqlite://{}", dir.path().join("bench.db").display()).parse()?,
                Mode::Postgres => args
                    .database
                    .as_deref()
                    .ok_or_else(|| anyhow::anyhow!("--mode postgres needs --database"))?
                    .parse()?,
                _ => StoreUrl::Memory,
            };
            let store = idempotency_stores::connect(&url, &idempotency_stores::Options::default()).await?;
            ours(idempotency::ReplayCache::over(store, args.replay_cache))
        }
        Mode::Peer => peer(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
