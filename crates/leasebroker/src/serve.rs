//! Serving connections with timeouts and a bounded drain (docs/protocol.md#running-leasebroker, #leasebroker-api).
//!
//! `axum::serve` gives hyper no timer, so a client that connects and never sends its headers
//! holds a connection (and a file descriptor) for ever. Here each connection is served by
//! hyper-util's HTTP/1 + HTTP/2 builder with:
//! - a header-read timeout (`--header-timeout`): a connection whose request headers have not all
//!   arrived within it is closed. hyper starts that timer whenever the connection waits for a
//!   request, so it also bounds a keep-alive connection waiting for its next one;
//! - an idle timeout (`--idle-timeout`): a connection on which no byte moved either way for that
//!   long is shut down gracefully (a request being handled still gets its answer), and closed
//!   outright after a second such period. A request body that stalls for that long is cut by the
//!   router's per-frame body timeout, so its handler fails instead of waiting;
//! - at most `--max-connections` connections at once, and at most `--max-connections-per-source`
//!   from one source (an IPv4 address, or the /64 of an IPv6 address): one accepted beyond
//!   either is closed at once, so one source's idle connections never take every slot;
//! - a stream timeout for both protocols: a connection with no request in progress for
//!   `--header-timeout` (none opened yet, or none since the last one ended) is shut down (a GOAWAY
//!   on HTTP/2) and closed after a second such period. HTTP/2 PING frames open no stream, so
//!   they do not keep a connection; hyper's own header timeout covers HTTP/1 only;
//! - at most [`MAX_STREAMS`] concurrent HTTP/2 streams per connection. How many requests a
//!   principal, and the process, handle at once is the router's business (`crate::api::shares`):
//!   the health routes must never wait behind tenant work, and only the router knows which
//!   request is which;
//! - on shutdown: stop accepting, let every connection finish its current request, then wait for
//!   the handlers whose clients hung up (the idempotency layer moved them to tasks of their own,
//!   its [`DetachedHandlers`]) so their results are stored, all within `--shutdown-timeout`.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use idempotency_tower::DetachedHandlers;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::head::{HYPER_H2_MAX_HEADER_LIST, HYPER_MAX_HEADERS};
use crate::limits::DeadlineBody;
use crate::places::{Place, Places};

/// Concurrent HTTP/2 streams allowed on one connection.
pub const MAX_STREAMS: u32 = 32;

/// How connections are limited, timed out and drained.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// The most connections served at once.
    pub max_connections: usize,
    /// The most connections served at once from one source ([`Source`]); `usize::MAX`: no cap.
    pub max_connections_per_source: usize,
    /// Request headers must arrive within this; a connection without a request in progress
    /// for this long is shut down.
    pub header: Duration,
    /// A connection with no traffic for this long is shut down.
    pub idle: Duration,
    /// A request body must arrive whole within this (`408` beyond, by the idempotency layer).
    pub body: Duration,
    /// How long shutdown waits for connections and detached handlers.
    pub shutdown: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains (bounded by
/// `timeouts.shutdown`): its connections, then `detached`, the handlers of the router's
/// idempotency layer whose clients hung up. Returns whether everything finished within that
/// bound.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    timeouts: Timeouts,
    detached: Option<DetachedHandlers>,
    shutdown: impl Future<Output = ()> + Send,
) -> bool {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let slots = Arc::new(Semaphore::new(timeouts.max_connections));
    let sources = Places::new(timeouts.max_connections_per_source);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match admit(&slots, &sources, peer) {
                    Some(slot) => {
                        let service = Counted::new(router.clone(), timeouts.body, peer);
                        connections.spawn(connection(stream, service, timeouts, stop_rx.clone(), slot));
                    }
                    // Over a cap: closed at once, before a byte is read.
                    None => drop(stream),
                },
                // Out of file descriptors and the like: back off rather than spin.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drain = async {
        while connections.join_next().await.is_some() {}
        if let Some(detached) = &detached {
            detached.close();
            detached.wait().await;
        }
    };
    match tokio::time::timeout(timeouts.shutdown, drain).await {
        Ok(()) => true,
        Err(_) => {
            tracing::warn!(
                connections = connections.len(),
                detached_handlers = detached.as_ref().map_or(0, DetachedHandlers::len),
                "shutdown timeout reached; exiting with work unfinished"
            );
            false
        }
    }
}

/// Where a connection comes from, for `--max-connections-per-source`: its IPv4 address, or the
/// /64 network of its IPv6 address (one host is usually given a whole /64, and could otherwise
/// open each connection from an address of its own). An IPv4 address mapped into IPv6 (a
/// listener on `[::]`) is its IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// The source of a connection from `peer`.
    pub fn of(peer: SocketAddr) -> Self {
        match peer.ip().to_canonical() {
            IpAddr::V6(v6) => {
                let network = u128::from(v6) & !((1u128 << 64) - 1);
                Self(IpAddr::V6(Ipv6Addr::from(network)))
            }
            v4 => Self(v4),
        }
    }
}

/// A connection's places: one of `--max-connections`, and one of its source's; both given back
/// when it closes.
struct Slot {
    _global: OwnedSemaphorePermit,
    _source: Place<Source>,
}

/// The places of a connection just accepted from `peer`, or `None` when it is over
/// `--max-connections` or over its source's cap (it is then closed before a byte is read).
fn admit(slots: &Arc<Semaphore>, sources: &Places<Source>, peer: SocketAddr) -> Option<Slot> {
    let source = Source::of(peer);
    let Ok(global) = slots.clone().try_acquire_owned() else {
        tracing::debug!("connection refused: --max-connections reached");
        return None;
    };
    let Some(place) = sources.enter(source) else {
        tracing::debug!(source = %source.0, "connection refused: --max-connections-per-source reached");
        return None;
    };
    Some(Slot { _global: global, _source: place })
}

async fn connection(
    stream: TcpStream,
    service: Counted,
    timeouts: Timeouts,
    mut stop: watch::Receiver<bool>,
    _slot: Slot,
) {
    let activity = Arc::new(Activity::new());
    let streams = service.streams.clone();
    let io = TokioIo::new(Tracked { inner: stream, activity: activity.clone() });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's header limits above the service's own (crate::head), so that the service's problem
    // answers a request between the two, not hyper's bare 431.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(timeouts.header).max_headers(HYPER_MAX_HEADERS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(HYPER_H2_MAX_HEADER_LIST);
    let conn = builder.serve_connection_with_upgrades(io, TowerToHyperService::new(service));
    tokio::pin!(conn);
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    let mut idle_periods = 0;
    let mut streamless_close: Option<Instant> = None;
    loop {
        let deadline = activity.last() + timeouts.idle;
        let streamless = streamless_close.unwrap_or_else(|| streams.quiet_since() + timeouts.header);
        tokio::select! {
            // A stream ended: the stream timeout starts again from now.
            () = streams.ended.notified() => {}
            () = tokio::time::sleep_until(streamless), if streams.active() == 0 || streamless_close.is_some() => {
                if streamless_close.is_some() {
                    tracing::debug!("closing a connection that opened no stream after its GOAWAY");
                    return;
                }
                if streams.active() > 0 || streams.quiet_since() + timeouts.header > Instant::now() {
                    continue;
                }
                // No request in progress for the header timeout: GOAWAY (HTTP/2) or close
                // (an idle HTTP/1 connection), then a hard close after one more such period.
                tracing::debug!("shutting down a connection without a request for the header timeout");
                stopping = true;
                conn.as_mut().graceful_shutdown();
                streamless_close = Some(Instant::now() + timeouts.header);
            }
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            changed = stop.changed(), if !stopping => {
                if changed.is_err() || *stop.borrow() {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            () = tokio::time::sleep_until(deadline) => {
                if activity.last() + timeouts.idle > Instant::now() {
                    idle_periods = 0;
                    continue;
                }
                idle_periods += 1;
                if idle_periods >= 2 {
                    tracing::debug!("closing a connection idle for two idle timeouts");
                    return;
                }
                if !stopping {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                }
                activity.touch();
            }
        }
    }
}

/// The requests (HTTP/2 streams) in progress on one connection, and when the last one started
/// or ended.
#[derive(Debug)]
struct Streams {
    active: AtomicU64,
    quiet: Activity,
    ended: tokio::sync::Notify,
}

impl Streams {
    fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    /// When the connection last had a request start or end (its start, before any).
    fn quiet_since(&self) -> Instant {
        self.quiet.last()
    }
}

/// Ends one stream when dropped (the response head was produced, or the request was dropped).
struct StreamGuard {
    streams: Arc<Streams>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams.active.fetch_sub(1, Ordering::Relaxed);
        self.streams.quiet.touch();
        self.streams.ended.notify_one();
    }
}

/// The router, counting the requests in progress on its connection. Each request carries the
/// connection's peer address (axum's `ConnectInfo`).
#[derive(Clone)]
struct Counted {
    router: axum::Router,
    streams: Arc<Streams>,
    body_timeout: Duration,
    peer: SocketAddr,
}

impl Counted {
    fn new(router: axum::Router, body_timeout: Duration, peer: SocketAddr) -> Self {
        let streams = Streams { active: AtomicU64::new(0), quiet: Activity::new(), ended: tokio::sync::Notify::new() };
        Self { router, streams: Arc::new(streams), body_timeout, peer }
    }
}

impl<B> tower::Service<axum::http::Request<B>> for Counted
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        self.streams.active.fetch_add(1, Ordering::Relaxed);
        self.streams.quiet.touch();
        let guard = StreamGuard { streams: self.streams.clone() };
        let router = self.router.clone();
        // The whole body must arrive within --body-timeout of the request's headers.
        let deadline = Instant::now() + self.body_timeout;
        let mut req = req.map(|body| axum::body::Body::new(DeadlineBody::new(axum::body::Body::new(body), deadline)));
        req.extensions_mut().insert(axum::extract::ConnectInfo(self.peer));
        Box::pin(async move {
            let response = tower::ServiceExt::oneshot(router, req).await;
            drop(guard);
            response
        })
    }
}

/// When bytes last moved on a connection.
#[derive(Debug)]
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self { start: Instant::now(), last_ms: AtomicU64::new(0) }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// A stream that records when bytes last moved.
#[derive(Debug)]
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(poll, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        poll
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        poll
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_is_an_ipv4_address_or_an_ipv6_64() {
        let of = |s: &str| Source::of(s.parse().expect("a socket address"));
        assert_eq!(of("10.0.0.1:1000"), of("10.0.0.1:2000"));
        assert_ne!(of("10.0.0.1:1000"), of("10.0.0.2:1000"));
        assert_eq!(of("[::ffff:10.0.0.1]:1000"), of("10.0.0.1:1"), "an IPv4-mapped address is its IPv4 address");
        assert_eq!(of("[2001:db8:1:2:aaaa::1]:1"), of("[2001:db8:1:2:bbbb::9]:2"), "one /64");
        assert_ne!(of("[2001:db8:1:2::1]:1"), of("[2001:db8:1:3::1]:1"));
    }

    #[test]
    fn each_source_holds_at_most_its_cap_and_gets_its_places_back() {
        let slots = Arc::new(Semaphore::new(3));
        let sources = Places::new(2);
        let (a, b) = ("10.0.0.1:1".parse().expect("addr"), "10.0.0.2:1".parse().expect("addr"));
        let a1 = admit(&slots, &sources, a).expect("a's first");
        let a2 = admit(&slots, &sources, a).expect("a's second");
        assert!(admit(&slots, &sources, a).is_none(), "a's third is over the per-source cap");
        assert_eq!(slots.available_permits(), 1, "a refused connection gives its global place back");
        let b1 = admit(&slots, &sources, b).expect("b is served");
        assert!(admit(&slots, &sources, b).is_none(), "over --max-connections");
        drop((a1, b1));
        assert!(admit(&slots, &sources, a).is_some(), "a place given back is taken again");
        drop(a2);
        assert_eq!(sources.keys(), 0, "sources with nothing open are forgotten");
    }
}
