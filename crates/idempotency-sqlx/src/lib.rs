#![doc = include_str!("../README.md")]
//!
//! The stores: [`SqliteStore`] and [`PostgresStore`]; see [`ClaimStrategy`] for the two claim
//! statements on offer on PostgreSQL, and [`PartitionedPostgresStore`] for the opt-in layout
//! partitioned by expiry day, whose sweeper drops whole days.
//!
//! With the `sqlite` feature: [`SqliteStore`], [`sqlite_migrator`], [`sqlite_pool_options`].
//! With `postgres`: [`PostgresStore`], [`postgres_migrator`], [`postgres_pool_options`].
//!
//! # Migrations, and sharing the database with another migrator
//!
//! The schema is created by versioned sqlx migrations ([`sqlite_migrator`], [`postgres_migrator`],
//! or simply [`SqliteStore::migrate`] / [`PostgresStore::migrate`]): one table,
//! `idempotency_records`, primary key `(principal, endpoint, key)`, an index on `expires_at`.
//!
//! The opt-in partitioned layout ([`PartitionedPostgresStore::migrate`],
//! [`postgres_partitioned_migrator`]) creates `idempotency_records_by_day` and its claim function,
//! with a history table of its own, [`PARTITIONED_MIGRATIONS_TABLE`]; the store creates the
//! day partitions itself.
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

#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod admin;
#[cfg(feature = "postgres")]
mod changes;
#[cfg(feature = "postgres")]
mod fenced;
mod migrate;
#[cfg(feature = "postgres")]
mod multihost;
#[cfg(feature = "postgres")]
mod partitioned;
mod pool;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod row;
#[cfg(feature = "sqlite")]
mod sqlite;
mod url;

#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "postgres")]
pub use changes::CHANGES_CHANNEL;
#[doc(hidden)]
pub use migrate::compare_with_directory;
#[cfg(feature = "postgres")]
pub use migrate::postgres_migrator;
#[cfg(feature = "sqlite")]
pub use migrate::sqlite_migrator;
pub use migrate::{BadMigrationName, MIGRATIONS_TABLE, embedded_migrator};
#[cfg(feature = "postgres")]
pub use multihost::{UrlError, connect_postgres};
#[cfg(feature = "postgres")]
pub use partitioned::{
    DEFAULT_DAYS_AHEAD, DropWindow, PARTITIONED_MIGRATIONS_TABLE, PARTITIONED_TABLE, PartitionedPostgresStore,
    postgres_partitioned_migrator,
};
#[cfg(feature = "sqlite")]
pub use pool::sqlite_pool_options;
pub use pool::{IDLE_IN_TRANSACTION_TIMEOUT, LOCK_TIMEOUT, PING_IF_IDLE_FOR};
#[cfg(feature = "postgres")]
pub use pool::{bounded_session, postgres_pool_options};
#[cfg(feature = "postgres")]
pub use postgres::{ClaimStrategy, PostgresStore};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
pub use url::{DatabaseUrl, UnsupportedDatabaseUrl, redact};
