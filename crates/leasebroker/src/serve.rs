//! Serving connections with timeouts and a bounded drain (SPEC 3.1, 3.2).
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
//! - on shutdown: stop accepting, let every connection finish its current request, then wait for
//!   the handlers whose clients hung up (the idempotency layer moved them to tasks of their own;
//!   [`idempotency_tower::detached_handlers`] counts them) so their results are stored, all within
//!   `--shutdown-timeout`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How connections are timed out and drained.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Request headers must arrive within this.
    pub header: Duration,
    /// A connection with no traffic for this long is shut down.
    pub idle: Duration,
    /// How long shutdown waits for connections and detached handlers.
    pub shutdown: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains (bounded by
/// `timeouts.shutdown`). Returns whether everything finished within that bound.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()> + Send,
) -> bool {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, router.clone(), timeouts, stop_rx.clone()));
                }
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
        while idempotency_tower::detached_handlers() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    match tokio::time::timeout(timeouts.shutdown, drain).await {
        Ok(()) => true,
        Err(_) => {
            tracing::warn!(
                connections = connections.len(),
                detached_handlers = idempotency_tower::detached_handlers(),
                "shutdown timeout reached; exiting with work unfinished"
            );
            false
        }
    }
}

async fn connection(stream: TcpStream, router: axum::Router, timeouts: Timeouts, mut stop: watch::Receiver<bool>) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked { inner: stream, activity: activity.clone() });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(timeouts.header);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection_with_upgrades(io, TowerToHyperService::new(router));
    tokio::pin!(conn);
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    let mut idle_periods = 0;
    loop {
        let deadline = activity.last() + timeouts.idle;
        tokio::select! {
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
