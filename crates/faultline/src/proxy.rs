//! A fault-injecting TCP proxy on loopback, one in front of each replica.
//!
//! Clients open one connection per request (their HTTP clients keep no idle connections), so a
//! fault decided per connection hits exactly one request. With probability `rate` a connection
//! gets one of three faults, equally likely:
//! - never reaches the server: the client connection is closed without connecting upstream;
//! - response lost after the work: the request is forwarded, the server's first response bytes
//!   are read and dropped, and the client connection is reset;
//! - the client gives up mid-flight: the request is held back for most of the client's attempt
//!   timeout, then forwarded, and no response is passed on, so the client's attempt times out while
//!   the server works; when the client hangs up the server's connection is closed too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use rand::Rng;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};

/// Longest life of one proxied connection.
const CONNECTION_CAP: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The client fault kinds the proxy injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request never reaches the server.
    NeverReached,
    /// The server did the work; its response is dropped.
    ResponseLost,
    /// The client's attempt times out while the server works.
    GaveUpMidFlight,
}

/// What the proxy did, counted.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Faults of kind [`Fault::NeverReached`].
    pub never_reached: AtomicU64,
    /// Faults of kind [`Fault::ResponseLost`] where the server really answered.
    pub response_lost: AtomicU64,
    /// Faults of kind [`Fault::GaveUpMidFlight`] where the request really reached the server.
    pub gave_up_mid_flight: AtomicU64,
    /// Connections whose upstream could not be reached (the replica was down).
    pub upstream_down: AtomicU64,
    /// Connections to the replica open right now.
    pub active_upstream: AtomicI64,
}

/// A snapshot of [`ProxyStats`], summed over proxies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ProxyCounts {
    /// Connections accepted.
    pub connections: u64,
    /// Requests that never reached the server.
    pub never_reached: u64,
    /// Responses lost after the server did the work.
    pub response_lost: u64,
    /// Attempts the client gave up on while the server worked.
    pub gave_up_mid_flight: u64,
    /// Connections refused because the replica was down (a server kill, not an injected fault).
    pub upstream_down: u64,
}

impl ProxyStats {
    /// The counters now.
    pub fn snapshot(&self) -> ProxyCounts {
        ProxyCounts {
            connections: self.connections.load(Ordering::Relaxed),
            never_reached: self.never_reached.load(Ordering::Relaxed),
            response_lost: self.response_lost.load(Ordering::Relaxed),
            gave_up_mid_flight: self.gave_up_mid_flight.load(Ordering::Relaxed),
            upstream_down: self.upstream_down.load(Ordering::Relaxed),
        }
    }
}

impl std::ops::Add for ProxyCounts {
    type Output = ProxyCounts;
    fn add(self, o: ProxyCounts) -> ProxyCounts {
        ProxyCounts {
            connections: self.connections + o.connections,
            never_reached: self.never_reached + o.never_reached,
            response_lost: self.response_lost + o.response_lost,
            gave_up_mid_flight: self.gave_up_mid_flight + o.gave_up_mid_flight,
            upstream_down: self.upstream_down + o.upstream_down,
        }
    }
}

/// How the proxy injects faults.
#[derive(Debug, Clone, Copy)]
pub struct FaultPlan {
    /// Probability that a connection gets a fault.
    pub rate: f64,
    /// The clients' attempt timeout: a "gave up" fault forwards the request after 50-90% of it.
    pub attempt_timeout: Duration,
}

/// A running proxy. Dropping it stops accepting; open connections end within their caps.
#[derive(Debug)]
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<ProxyStats>,
    enabled: Arc<AtomicBool>,
    accept: JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr, plan: FaultPlan) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(ProxyStats::default());
        let enabled = Arc::new(AtomicBool::new(true));
        let accept = tokio::spawn({
            let stats = stats.clone();
            let enabled = enabled.clone();
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else { continue };
                    stats.connections.fetch_add(1, Ordering::Relaxed);
                    let fault = if enabled.load(Ordering::Relaxed) { roll(plan.rate) } else { None };
                    let stats = stats.clone();
                    tokio::spawn(async move {
                        let _ = timeout(CONNECTION_CAP, handle(client, upstream, fault, plan, stats)).await;
                    });
                }
            }
        });
        Ok(Proxy { addr, stats, enabled, accept })
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Turns fault injection on or off for new connections.
    pub fn set_faults(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }
}

fn roll(rate: f64) -> Option<Fault> {
    let mut rng = rand::rng();
    if rate <= 0.0 || rng.random::<f64>() >= rate {
        return None;
    }
    Some(match rng.random_range(0..3) {
        0 => Fault::NeverReached,
        1 => Fault::ResponseLost,
        _ => Fault::GaveUpMidFlight,
    })
}

/// Decrements the active-connection count when the upstream connection ends.
struct Active(Arc<ProxyStats>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.active_upstream.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connect(upstream: SocketAddr, stats: &Arc<ProxyStats>) -> Option<(TcpStream, Active)> {
    match timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream)).await {
        Ok(Ok(stream)) => {
            let _ = stream.set_nodelay(true);
            stats.active_upstream.fetch_add(1, Ordering::Relaxed);
            Some((stream, Active(stats.clone())))
        }
        _ => {
            stats.upstream_down.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Closes `stream` with a TCP reset, so the client sees the connection break, not end cleanly.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn handle(
    mut client: TcpStream,
    upstream: SocketAddr,
    fault: Option<Fault>,
    plan: FaultPlan,
    stats: Arc<ProxyStats>,
) {
    let _ = client.set_nodelay(true);
    if fault == Some(Fault::NeverReached) {
        stats.never_reached.fetch_add(1, Ordering::Relaxed);
        reset(client);
        return;
    }
    let Some((mut server, _active)) = connect(upstream, &stats).await else {
        reset(client);
        return;
    };
    match fault {
        None | Some(Fault::NeverReached) => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
        Some(Fault::ResponseLost) => {
            if forward_until_response(&mut client, &mut server).await {
                stats.response_lost.fetch_add(1, Ordering::Relaxed);
            }
            reset(client);
        }
        Some(Fault::GaveUpMidFlight) => {
            if hold_response(&mut client, &mut server, plan.attempt_timeout).await {
                stats.gave_up_mid_flight.fetch_add(1, Ordering::Relaxed);
            }
            reset(client);
        }
    }
}

/// Forwards the client's bytes until the server's first response bytes arrive; drops those.
/// True if the server answered.
async fn forward_until_response(client: &mut TcpStream, server: &mut TcpStream) -> bool {
    let (mut cr, _cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let mut up = [0u8; 16 * 1024];
    let mut down = [0u8; 1024];
    let mut client_open = true;
    loop {
        tokio::select! {
            r = cr.read(&mut up), if client_open => match r {
                Ok(0) | Err(_) => client_open = false,
                Ok(n) => if sw.write_all(&up[..n]).await.is_err() { return false },
            },
            r = sr.read(&mut down) => return matches!(r, Ok(n) if n > 0),
        }
    }
}

/// Holds the request back for 50-90% of the attempt timeout, forwards it, and passes no response
/// on, until the client hangs up (its attempt timed out) or three attempt timeouts pass (a client
/// with a longer timeout, such as lbctl, then sees a reset). True if the request reached the server.
async fn hold_response(client: &mut TcpStream, server: &mut TcpStream, attempt_timeout: Duration) -> bool {
    let hold = attempt_timeout.mul_f64(rand::rng().random_range(0.5..0.9));
    let forward_at = Instant::now() + hold;
    let give_up_at = Instant::now() + attempt_timeout * 3;
    let (mut cr, _cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let mut pending = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    // Phase 1: buffer what the client sends.
    loop {
        tokio::select! {
            () = sleep_until(forward_at) => break,
            r = cr.read(&mut buf) => match r {
                Ok(0) | Err(_) => return false,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            },
        }
    }
    if pending.is_empty() || sw.write_all(&pending).await.is_err() {
        return false;
    }
    // Phase 2: the server works; swallow its answer until the client gives up.
    let mut down = [0u8; 4096];
    let mut server_open = true;
    loop {
        tokio::select! {
            () = sleep_until(give_up_at) => return true,
            r = cr.read(&mut buf) => match r {
                Ok(0) | Err(_) => return true,
                Ok(n) => if sw.write_all(&buf[..n]).await.is_err() { server_open = false },
            },
            r = sr.read(&mut down), if server_open => if matches!(r, Ok(0) | Err(_)) { server_open = false },
        }
    }
}
