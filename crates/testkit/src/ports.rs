//! Ports on 127.0.0.1 for the servers a test starts, and ports that refuse connections.
//!
//! A server the kit starts binds port 0 itself and says where it listens. A port another process
//! binds later (a chromedriver, a redis-server, a Patroni member) comes from [`free_port`], which
//! picks it outside the kernel's ephemeral range: a port found by binding port 0 and letting it
//! go lies in that range, where any socket of any test may take it before the server binds it.

use std::sync::Mutex;

pub use idempotency::conformance::{HeldPort, free_port_with, free_ports};

/// One port, free now, outside the kernel's ephemeral range, for a server the test starts
/// (see [`free_ports`]).
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// A port on 127.0.0.1 that refuses every connection for the rest of this process: bound
/// without listening ([`HeldPort`]), so no other socket takes it meanwhile.
pub fn closed_port() -> u16 {
    static HELD: Mutex<Vec<HeldPort>> = Mutex::new(Vec::new());
    loop {
        let port = free_port();
        if let Some(held) = HeldPort::hold(port) {
            HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(held);
            return port;
        }
    }
}

/// `http://127.0.0.1:PORT` of a [`closed_port`].
pub fn closed_url() -> String {
    format!("http://127.0.0.1:{}", closed_port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_port_refuses_connections_and_no_listener_can_take_it() {
        let port = closed_port();
        let refused = std::net::TcpStream::connect(("127.0.0.1", port)).expect_err("a closed port accepted");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_err(), "a listener took a closed port");
        assert_ne!(closed_port(), port, "each call holds a port of its own");
    }
}
