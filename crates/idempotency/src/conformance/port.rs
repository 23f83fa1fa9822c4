//! A stopped test server's port, kept from other listeners until the server starts again.

use std::net::{Ipv4Addr, SocketAddrV4};

/// A TCP port on 127.0.0.1 bound without listening, so that no other socket can bind it (this
/// one has no `SO_REUSEADDR`) while a client that connects is refused, as by a stopped server.
///
/// Test servers take free ports from the range every other test's listeners take theirs from;
/// while a server is stopped (to test an outage) another test's listener could take its port,
/// and the server could not start again. Seen: an HTTP server took a stopped PostgreSQL's port,
/// whose clients then read "unexpected response from SSLRequest" and whose restart failed.
/// Hold the port after the stop, drop the hold right before the start.
#[derive(Debug)]
pub struct HeldPort {
    _socket: socket2::Socket,
}

impl HeldPort {
    /// Holds `port`; `None` when something else has it bound (nothing is held then).
    pub fn hold(port: u16) -> Option<Self> {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
        socket.bind(&SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into()).ok()?;
        Some(Self { _socket: socket })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_port_cannot_be_listened_on_and_refuses_connections() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let held = HeldPort::hold(port).expect("hold a free port");
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_err(), "another listener took a held port");
        let refused = std::net::TcpStream::connect(("127.0.0.1", port)).expect_err("a held port accepted a connection");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        drop(held);
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(), "the port stayed taken after the hold");
    }
}
