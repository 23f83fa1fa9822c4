//! SQLite and PostgreSQL stores for idempotency records.
//!
//! Both implement [`idempotency::Store`] and pass the core's conformance suite:
//!
//! - [`SqliteStore`]: embedded, the default for a single machine, durable across restarts (WAL
//!   journal, `synchronous = FULL`, a busy timeout, writes in `BEGIN IMMEDIATE` transactions).
//! - [`PostgresStore`]: for several replicas of a service sharing one database. A claim is one
//!   round trip (a replay needs nothing else); a first execution is two (claim, then complete).
//!   See [`ClaimStrategy`] for the two claim statements on offer.
//!
//! ```
//! use idempotency::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, Scope, Store, now};
//! use idempotency_sqlx::SqliteStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("leasebroker.db");
//! let store = SqliteStore::connect(path.to_str().unwrap()).await?; // or "sqlite://leasebroker.db"
//! store.migrate().await?;
//!
//! let key = IdempotencyKey::try_from("7c3f5d1e-91a4-4b8c")?;
//! let scope = Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"), key);
//! let t = now();
//! let req = ClaimRequest {
//!     scope, fingerprint: Fingerprint::from_stored("sha256:00"), now: t, expires_at: t + chrono::Duration::hours(24),
//! };
//! assert!(matches!(store.claim(req.clone()).await?, ClaimOutcome::Owned(_)));
//! assert!(matches!(store.claim(req).await?, ClaimOutcome::Existing(_)));
//! # Ok(()) }
//! ```
//!
//! # Migrations, and sharing the database with another migrator
//!
//! The schema is created by versioned sqlx migrations ([`sqlite_migrator`], [`postgres_migrator`],
//! or simply [`SqliteStore::migrate`] / [`PostgresStore::migrate`]): one table,
//! `idempotency_records`, primary key `(principal, endpoint, key)`, an index on `expires_at`.
//!
//! A service usually keeps its own tables in the same database and runs its own sqlx migrator.
//! Two migrators that share sqlx's default bookkeeping table `_sqlx_migrations` break each
//! other: each sees the other's applied versions as "missing" and refuses to run
//! (`VersionMissing`), and equal version numbers collide. So these migrators record their
//! history in a table of their own, [`MIGRATIONS_TABLE`] (`_idempotency_migrations`), via
//! sqlx's `Migrator::dangerous_set_table_name`. What another migrator on the same database
//! must do:
//!
//! - keep its own history table (the default `_sqlx_migrations` is fine), never
//!   `_idempotency_migrations`;
//! - not create or alter `idempotency_records` or `_idempotency_migrations`;
//! - nothing else: no `set_ignore_missing`, no reserved version ranges. The two may run in
//!   either order, and on PostgreSQL even concurrently (sqlx serialises migrators with one
//!   advisory lock per database).
//!
//! # Pools
//!
//! [`PostgresStore::connect`] and [`SqliteStore::connect`] build their pools with
//! [`postgres_pool_options`] and [`sqlite_pool_options`], which a service that shares its own
//! pool with a store should use too. sqlx's default pings every connection as it leaves the pool,
//! which for PostgreSQL is a network round trip before every statement: a replay would cost two
//! round trips instead of one. These options ping only a connection that sat idle for
//! [`PING_IF_IDLE_FOR`] (30 s) or more.
//!
//! # Errors
//!
//! A database error is [`StoreError::Unavailable`](idempotency::StoreError::Unavailable); a row
//! that cannot be read back is [`StoreError::Corrupt`](idempotency::StoreError::Corrupt); a
//! fenced `complete`/`fail`/`heartbeat`/`remove` is
//! [`StoreError::Fenced`](idempotency::StoreError::Fenced). No error is ever reported as
//! ownership.

mod migrate;
mod pool;
mod postgres;
mod row;
mod sqlite;

#[cfg(feature = "testing")]
pub mod testing;

pub use migrate::{MIGRATIONS_TABLE, postgres_migrator, sqlite_migrator};
pub use pool::{PING_IF_IDLE_FOR, postgres_pool_options, sqlite_pool_options};
pub use postgres::{ClaimStrategy, PostgresStore};
pub use sqlite::SqliteStore;
