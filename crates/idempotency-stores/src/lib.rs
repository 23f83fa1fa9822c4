#![doc = include_str!("../README.md")]

#[cfg(feature = "clap")]
pub mod clap;
mod connect;
mod url;

pub use connect::{ConnectError, Options, connect};
#[cfg(feature = "redis")]
pub use idempotency_redis::RedisStoreOptions;
pub use idempotency_sqlx::{DatabaseUrl, UnsupportedDatabaseUrl, redact};
pub use url::{StoreUrl, UnsupportedStoreUrl};
