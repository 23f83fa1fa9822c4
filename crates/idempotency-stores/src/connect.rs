//! [`connect`]: the one function that builds a store from its URL.

use std::sync::Arc;

use idempotency::{MemoryStore, Store, StoreError};
#[cfg(feature = "redis")]
use idempotency_redis::RedisStoreOptions;

use crate::{DatabaseUrl, StoreUrl};

/// How [`connect`] builds a store, beyond what its URL says.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Options {
    /// SQL stores: connections in the pool. `None`: the store's own default.
    pub max_connections: Option<u32>,
    /// SQL stores: run the store's migrations after connecting (default: yes; safe on every
    /// start, and several replicas may run them at once).
    pub migrate: bool,
    /// Redis stores: prefix, replicas to wait for, timeouts, CA certificates.
    #[cfg(feature = "redis")]
    pub redis: RedisStoreOptions,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_connections: None,
            migrate: true,
            #[cfg(feature = "redis")]
            redis: RedisStoreOptions::default(),
        }
    }
}

impl Options {
    /// SQL stores: `n` connections in the pool.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = Some(n);
        self
    }

    /// SQL stores: whether to run the store's migrations after connecting.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Redis stores: these options.
    #[cfg(feature = "redis")]
    pub fn redis(mut self, redis: RedisStoreOptions) -> Self {
        self.redis = redis;
        self
    }
}

/// Why [`connect`] built no store. Each message names the URL, redacted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The SQL database could not be reached, opened or migrated.
    #[error("cannot open the record store at {url}")]
    Sql {
        /// The URL, redacted.
        url: String,
        /// What the store reported.
        #[source]
        source: StoreError,
    },
    /// The Redis server or cluster could not be reached, or refused (an evicting
    /// `maxmemory-policy`, a bad URL).
    #[cfg(feature = "redis")]
    #[error("cannot open the record store at {url}")]
    Redis {
        /// The URL, redacted.
        url: String,
        /// What the store reported.
        #[source]
        source: idempotency_redis::ConnectError,
    },
    /// The URL names a store this build has no support for.
    #[error("{url}: this build has no {feature} store (build idempotency-stores with the `{feature}` feature)")]
    NotBuilt {
        /// The URL, redacted.
        url: String,
        /// The cargo feature that builds it.
        feature: &'static str,
    },
}

/// Builds the store `url` names: connected, and for the SQL stores migrated (unless
/// [`Options::migrate`] is off). The one place a service turns a store URL into a store.
pub async fn connect(url: &StoreUrl, options: &Options) -> Result<Arc<dyn Store>, ConnectError> {
    let sql_error = |source| ConnectError::Sql { url: url.to_string(), source };
    match url {
        StoreUrl::Memory => Ok(Arc::new(MemoryStore::new())),
        StoreUrl::Sql(DatabaseUrl::Sqlite(raw)) => sqlite(raw, url, options).await?.map_err(sql_error),
        StoreUrl::Sql(DatabaseUrl::Postgres(raw)) => postgres(raw, url, options).await?.map_err(sql_error),
        StoreUrl::Sql(_) => Err(ConnectError::NotBuilt { url: url.to_string(), feature: "that database's" }),
        StoreUrl::Redis(raw) | StoreUrl::RedisCluster(raw) => redis(raw, url, options).await,
    }
}

/// A store, or the store's own error; the outer error is a store this build lacks.
type Built = Result<Result<Arc<dyn Store>, StoreError>, ConnectError>;

#[cfg(feature = "sqlite")]
async fn sqlite(raw: &str, _: &StoreUrl, options: &Options) -> Built {
    use idempotency_sqlx::SqliteStore;
    Ok(async {
        let store = match options.max_connections {
            None => SqliteStore::connect(raw).await?,
            Some(n) => SqliteStore::from_pool(
                idempotency_sqlx::sqlite_pool_options(n.max(1))
                    .connect_with(SqliteStore::connect_options(raw)?)
                    .await
                    .map_err(StoreError::unavailable)?,
            ),
        };
        if options.migrate {
            store.migrate().await?;
        }
        Ok(Arc::new(store) as Arc<dyn Store>)
    }
    .await)
}

#[cfg(feature = "postgres")]
async fn postgres(raw: &str, _: &StoreUrl, options: &Options) -> Built {
    use idempotency_sqlx::PostgresStore;
    Ok(async {
        let store = match options.max_connections {
            None => PostgresStore::connect(raw).await?,
            Some(n) => PostgresStore::from_pool(
                idempotency_sqlx::connect_postgres(raw, idempotency_sqlx::postgres_pool_options(n.max(1)))
                    .await
                    .map_err(StoreError::unavailable)?,
            ),
        };
        if options.migrate {
            store.migrate().await?;
        }
        Ok(Arc::new(store) as Arc<dyn Store>)
    }
    .await)
}

#[cfg(feature = "redis")]
async fn redis(raw: &str, url: &StoreUrl, options: &Options) -> Result<Arc<dyn Store>, ConnectError> {
    match idempotency_redis::RedisStore::connect_with(raw, options.redis.clone()).await {
        Ok(store) => Ok(Arc::new(store)),
        Err(source) => Err(ConnectError::Redis { url: url.to_string(), source }),
    }
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite(_: &str, url: &StoreUrl, _: &Options) -> Built {
    Err(ConnectError::NotBuilt { url: url.to_string(), feature: "sqlite" })
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_: &str, url: &StoreUrl, _: &Options) -> Built {
    Err(ConnectError::NotBuilt { url: url.to_string(), feature: "postgres" })
}

#[cfg(not(feature = "redis"))]
async fn redis(_: &str, url: &StoreUrl, _: &Options) -> Result<Arc<dyn Store>, ConnectError> {
    Err(ConnectError::NotBuilt { url: url.to_string(), feature: "redis" })
}
