//! Ports for test servers: picked where the kernel never hands ports out on its own
//! ([`free_ports`]), and a stopped server's port kept from other listeners until the server
//! starts again ([`HeldPort`]).

use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::ops::Range;

/// The lowest port [`free_ports`] picks: below it lie well-known services' ports.
const LOWEST: u16 = 10_000;

/// `n` distinct ports on 127.0.0.1, free now, for servers a test starts itself (PostgreSQL,
/// Patroni, HAProxy, etcd, redis-server), picked outside the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768 to 60999 by default).
///
/// A port picked by binding port 0 and letting it go comes from that range, and so does every
/// other listener on port 0 and the local port of every outgoing connection, of any process:
/// until the server meant for it binds it, which for a Patroni member's PostgreSQL or the
/// HAProxy in front of it comes minutes later on a loaded machine, any socket of the suite may
/// take it, and the server cannot listen. Outside the range only another caller of this
/// function could pick the same port; the picks start at a random place, so two callers at
/// once rarely meet.
pub fn free_ports(n: usize) -> Vec<u16> {
    pick(n, 0)
}

/// A port as [`free_ports`] picks it, whose `port + offset` is free and outside the
/// ephemeral range too (a Redis Cluster node's bus port is its port + 10000).
pub fn free_port_with(offset: u16) -> u16 {
    pick(1, offset)[0]
}

fn pick(n: usize, offset: u16) -> Vec<u16> {
    let candidates: Vec<Range<u16>> = outside_ephemeral()
        .into_iter()
        .filter_map(|r| {
            let end = r.end.saturating_sub(offset);
            (end > r.start).then_some(r.start..end)
        })
        .collect();
    let mut picked = pick_in(&candidates, n, offset);
    // No room outside the range (an unusual ip_local_port_range): the kernel's own choice.
    while picked.len() < n {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("bind");
        if !picked.contains(&port) && (offset == 0 || port.checked_add(offset).is_some_and(free)) {
            picked.push(port);
        }
    }
    picked
}

/// Up to `n` distinct ports of `ranges` that are free now (and whose `port + offset` is, when
/// `offset` is not 0), looked for from a random place on.
fn pick_in(ranges: &[Range<u16>], n: usize, offset: u16) -> Vec<u16> {
    let total: u32 = ranges.iter().map(|r| u32::from(r.end - r.start)).sum();
    let mut picked = Vec::with_capacity(n);
    if total == 0 {
        return picked;
    }
    let start = std::collections::hash_map::RandomState::new().build_hasher().finish() % u64::from(total);
    let start = u32::try_from(start).unwrap_or(0);
    for i in 0..total {
        if picked.len() == n {
            break;
        }
        let port = nth(ranges, (start + i) % total);
        if !picked.contains(&port) && free(port) && (offset == 0 || free(port + offset)) {
            picked.push(port);
        }
    }
    picked
}

/// The `i`th port of `ranges`, counted across them.
fn nth(ranges: &[Range<u16>], mut i: u32) -> u16 {
    for r in ranges {
        let len = u32::from(r.end - r.start);
        if i < len {
            return r.start + u16::try_from(i).unwrap_or(0);
        }
        i -= len;
    }
    ranges[0].start
}

/// Free: nothing is bound to `port`, a connection of a closed server's lingering in `TIME_WAIT`
/// included, so that a server started there can be held when stopped ([`HeldPort`]). A bind
/// with `SO_REUSEADDR`, as `TcpListener::bind` does, would pass over such a connection.
fn free(port: u16) -> bool {
    HeldPort::hold(port).is_some()
}

/// The ports from [`LOWEST`] up that lie outside the kernel's ephemeral range.
fn outside_ephemeral() -> Vec<Range<u16>> {
    let (lo, hi) = ephemeral_range();
    let mut ranges = vec![];
    if lo > LOWEST {
        ranges.push(LOWEST..lo);
    }
    if hi < u16::MAX {
        ranges.push(hi.max(LOWEST - 1) + 1..u16::MAX);
    }
    ranges
}

/// The kernel's ephemeral port range, inclusive (Linux's default where it cannot be read).
pub(crate) fn ephemeral_range() -> (u16, u16) {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut nums = text.split_whitespace().filter_map(|t| t.parse::<u16>().ok());
    match (nums.next(), nums.next()) {
        (Some(lo), Some(hi)) if lo <= hi => (lo, hi),
        _ => (32_768, 60_999),
    }
}

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
    fn picked_ports_are_free_distinct_and_outside_the_ephemeral_range() {
        let (lo, hi) = ephemeral_range();
        let ports = free_ports(9);
        assert_eq!(ports.len(), 9);
        for (i, &port) in ports.iter().enumerate() {
            assert!(
                !(lo..=hi).contains(&port),
                "{port} is in the ephemeral range {lo}-{hi}, where any socket may take it"
            );
            assert!(port >= LOWEST, "{port} is among the well-known services' ports");
            assert!(!ports[..i].contains(&port), "{port} picked twice");
            assert!(free(port), "{port} is not free");
        }
        let port = free_port_with(10_000);
        for p in [port, port + 10_000] {
            assert!(!(lo..=hi).contains(&p), "{p} is in the ephemeral range {lo}-{hi}");
            assert!(free(p), "{p} is not free");
        }
    }

    #[test]
    fn a_port_in_use_is_never_picked() {
        // 60 ports, all but every sixth held here: the picks must be the free ones.
        let (lo, _) = ephemeral_range();
        let range = LOWEST..lo.min(LOWEST + 60);
        let held: Vec<TcpListener> =
            range.clone().filter(|p| p % 6 != 0).filter_map(|p| TcpListener::bind(("127.0.0.1", p)).ok()).collect();
        let held: Vec<u16> = held.iter().map(|l| l.local_addr().expect("addr").port()).collect();
        assert!(held.len() >= 40, "could hold only {} ports of {range:?}", held.len());
        for _ in 0..20 {
            let picked = pick_in(std::slice::from_ref(&range), 5, 0);
            assert!(!picked.is_empty(), "nothing free found in {range:?}");
            for port in picked {
                assert!(!held.contains(&port), "{port} is in use and was picked");
                assert!(range.contains(&port));
            }
        }
    }

    /// A port whose last server closed a connection first keeps that connection in `TIME_WAIT`
    /// for a minute. A listener with `SO_REUSEADDR` (every test server's) binds it, but a
    /// [`HeldPort`] cannot: a server started there could not be held when stopped (seen in CI:
    /// `a_stopped_server_keeps_its_port_until_it_starts_again`). Such a port is not free.
    #[test]
    fn a_port_with_a_connection_in_time_wait_is_not_free() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (served, _) = listener.accept().expect("accept");
        drop(served); // the server's side closes first: its end waits in TIME_WAIT
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(client);
        drop(listener);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(HeldPort::hold(port).is_none(), "TIME_WAIT did not keep the port from a hold");
        assert!(!free(port), "a port that cannot be held was called free");
    }

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
