//! Pool settings for the stores' connections: no extra round trip per checkout.
//!
//! sqlx's pools by default ping every connection as it leaves the idle queue
//! (`test_before_acquire`). For PostgreSQL that ping is a full network round trip, so a replay,
//! which is one statement, cost two round trips, and a first execution four. The pools built here
//! ping only a connection that has sat idle longer than [`PING_IF_IDLE_FOR`], the one that may
//! have been cut by a server restart or a firewall's idle timeout; a connection in steady use goes
//! straight to its statement. A connection that broke while in steady use fails its one statement
//! with [`StoreError::Unavailable`](idempotency::StoreError::Unavailable) (a 503 the client
//! retries under the same key) and sqlx drops it.

use std::time::Duration;

#[cfg(feature = "postgres")]
use sqlx::Connection;
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePoolOptions;

/// A connection idle at least this long is pinged before it is handed out.
pub const PING_IF_IDLE_FOR: Duration = Duration::from_secs(30);

#[cfg(feature = "postgres")]
/// PostgreSQL pool options: `max_connections`, no ping on checkout unless idle for
/// [`PING_IF_IDLE_FOR`].
pub fn postgres_pool_options(max_connections: u32) -> PgPoolOptions {
    PgPoolOptions::new().max_connections(max_connections).test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= PING_IF_IDLE_FOR {
                conn.ping().await?;
            }
            Ok(true)
        })
    })
}

/// How long a PostgreSQL session may sit idle inside a transaction before the server ends it
/// (`idle_in_transaction_session_timeout`). The stores and the services on them never wait on
/// anything but the database inside a transaction, so a session idle that long belongs to a
/// process that stopped (a frozen VM, a long pause, SIGSTOP) while it held locks: ending it
/// rolls its transaction back and frees its rows for the other replicas, and when the process
/// resumes, its next statement fails on the closed connection, so it commits nothing.
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one PostgreSQL statement waits for a lock (`lock_timeout`) before it fails (as
/// [`StoreError::Unavailable`](idempotency::StoreError::Unavailable): a `503` with
/// `Retry-After`, which the client retries under the same key), instead of waiting on a
/// stopped holder until [`IDLE_IN_TRANSACTION_TIMEOUT`] ends it, with a pooled connection held.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(feature = "postgres")]
/// `options` with the session bounds every pooled connection gets: [`IDLE_IN_TRANSACTION_TIMEOUT`]
/// and [`LOCK_TIMEOUT`], sent in the connection's startup packet (no extra round trip). A
/// setting the URL already gives (`?options=-c%20lock_timeout%3D2s`) is left as it is.
pub fn bounded_session(options: PgConnectOptions) -> PgConnectOptions {
    let given = options.get_options().unwrap_or_default().to_owned();
    let settings =
        [("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION_TIMEOUT), ("lock_timeout", LOCK_TIMEOUT)];
    options.options(
        settings
            .into_iter()
            .filter(|(name, _)| !given.contains(name))
            .map(|(name, value)| (name, format!("{}ms", value.as_millis()))),
    )
}

#[cfg(feature = "sqlite")]
/// SQLite pool options: `max_connections`, no ping on checkout. A SQLite connection is a file
/// handle in this process; there is no peer that could have gone away, and the ping would be a
/// hop to the connection's worker thread and back.
///
/// A connection released with a transaction still counted open is closed instead of reused. SQLite
/// rolls a transaction back by itself on some errors (`SQLITE_FULL` among them); sqlx does not
/// see it, its own `ROLLBACK` of the dropped transaction then fails ("no transaction is active"),
/// and its count of open transactions stays at one, so every later `BEGIN` on that connection
/// would be refused: with one connection, the service would never write again, even once the
/// disk has space (seen in leasebroker's
/// `a_full_sqlite_file_system_answers_503_for_the_write_and_readyz_says_not_ready`).
pub fn sqlite_pool_options(max_connections: u32) -> SqlitePoolOptions {
    SqlitePoolOptions::new().max_connections(max_connections).test_before_acquire(false).after_release(|conn, _| {
        Box::pin(async move {
            use sqlx::Connection;
            if conn.is_in_transaction() {
                // A dropped transaction's rollback is queued: the ping runs it.
                conn.ping().await?;
                if conn.is_in_transaction() {
                    tracing::warn!("a SQLite connection is left inside a transaction it cannot roll back; closed");
                    return Ok(false);
                }
            }
            Ok(true)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_checkouts_are_not_pinged() {
        assert!(!postgres_pool_options(4).get_test_before_acquire());
        assert_eq!(postgres_pool_options(7).get_max_connections(), 7);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn sessions_are_bounded_unless_the_url_says_otherwise() {
        use std::str::FromStr;
        let plain = bounded_session(PgConnectOptions::from_str("postgres://h/db").expect("url"));
        let options = plain.get_options().expect("options");
        assert!(options.contains("idle_in_transaction_session_timeout=5000ms"), "{options}");
        assert!(options.contains("lock_timeout=5000ms"), "{options}");
        let given = PgConnectOptions::from_str("postgres://h/db?options=-c%20lock_timeout%3D2s").expect("url");
        let options = bounded_session(given).get_options().expect("options").to_owned();
        assert!(options.contains("lock_timeout=2s") && !options.contains("lock_timeout=5000ms"), "{options}");
        assert!(options.contains("idle_in_transaction_session_timeout=5000ms"), "{options}");
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_checkouts_are_not_pinged() {
        assert!(!sqlite_pool_options(4).get_test_before_acquire());
        assert_eq!(sqlite_pool_options(7).get_max_connections(), 7);
    }
}
