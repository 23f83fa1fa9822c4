//! What an error reply says about the connection it came on: both a single server's connections
//! ([`crate::conn`]) and the cluster's ([`crate::cluster`]) ask it.

use redis::{ErrorKind, RedisError};

/// Whether `e` says the call got no answer from its node: its connection was lost, refused or
/// timed out (the client makes a new one), or there is none to the node.
pub(crate) fn is_connection_error(e: &RedisError) -> bool {
    e.is_timeout()
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.kind() == ErrorKind::ClusterConnectionNotFound
}
