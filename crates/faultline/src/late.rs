//! Late landings past the settle window (docs/protocol.md#proving-it, round 2): an HTTP proxy of faultline's between
//! the servers and the hypervisor simulator that holds a share of VM boots and delivers them once
//! the servers' settle window has passed.
//!
//! The servers' `--hypervisor-url` points here. Every call is passed to the simulator as it came
//! and its answer passed back (a connection the simulator dropped is dropped here too). The first
//! boot call (`POST /v1/vms`) of each tag is held, with probability `share`, for `hold` (the
//! settle window plus `--late-by`) and then sent to the simulator in a task of its own, whatever
//! the server did meanwhile: it timed out and answered `503`, a retry found nothing by tag after
//! the window and booted again (the late VM is then a second one of its tag), or the reaper rolled
//! the create back (the late VM then belongs to nothing). Either way only the service's inventory
//! sweep can remove what lands, which is what the run checks. Later boots of a held tag pass at
//! once, so a retry's boot is never held too.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use serde::Serialize;
use tokio::task::JoinHandle;

/// What the proxy did.
#[derive(Debug, Default)]
pub struct LateStats {
    /// Boot calls held.
    pub held: AtomicU64,
    /// Held boot calls sent on to the simulator after their hold (each may have booted a VM).
    pub delivered: AtomicU64,
    /// Of those, the ones the simulator answered `201` (a VM booted late, for sure).
    pub booted: AtomicU64,
}

/// A snapshot of [`LateStats`], for the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LateCounts {
    /// Boot calls held past the settle window.
    pub held: u64,
    /// Held boot calls delivered to the simulator (each may have booted a VM).
    pub delivered: u64,
    /// Of those, answered `201`: VMs that surely booted after the settle window.
    pub booted: u64,
}

impl LateStats {
    /// The counts now.
    pub fn snapshot(&self) -> LateCounts {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LateCounts { held: load(&self.held), delivered: load(&self.delivered), booted: load(&self.booted) }
    }
}

#[derive(Clone)]
struct Shared {
    upstream: String,
    http: reqwest::Client,
    share: f64,
    hold: Duration,
    /// Boot tags seen (held or not): only a tag's first boot may be held.
    seen: Arc<Mutex<HashSet<String>>>,
    stats: Arc<LateStats>,
}

/// The running proxy; stopped when dropped.
#[derive(Debug)]
pub struct LateProxy {
    /// Its base URL (give it to the servers as `--hypervisor-url`).
    pub url: String,
    /// What it did.
    pub stats: Arc<LateStats>,
    server: JoinHandle<()>,
}

impl Drop for LateProxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl LateProxy {
    /// Starts a proxy on a free loopback port in front of the simulator at `upstream`, holding a
    /// share `share` of first boots for `hold`.
    pub async fn start(upstream: &str, share: f64, hold: Duration) -> anyhow::Result<Self> {
        // No client timeout: a held call waits for the simulator's answer however slow it is.
        let http = reqwest::Client::builder().no_proxy().build().context("the late-landing proxy's client")?;
        let stats = Arc::new(LateStats::default());
        let shared = Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            http,
            share,
            hold,
            seen: Arc::default(),
            stats: stats.clone(),
        };
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .context("binding the late-landing proxy")?;
        let addr = listener.local_addr()?;
        let app = Router::new().fallback(pass).with_state(shared);
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("faultline: the late-landing proxy stopped: {e}");
            }
        });
        Ok(LateProxy { url: format!("http://{addr}"), stats, server })
    }
}

/// The tag of a boot call's body, if it has one.
fn boot_tag(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Boot {
        tag: String,
    }
    serde_json::from_slice::<Boot>(body).ok().map(|b| b.tag)
}

async fn pass(State(s): State<Shared>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let held = method == Method::POST
        && uri.path() == "/v1/vms"
        && boot_tag(&body).is_some_and(|tag| {
            let first = s.seen.lock().unwrap_or_else(PoisonError::into_inner).insert(tag);
            first && rand::rng().random::<f64>() < s.share
        });
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    if !held {
        return forward(&s, method, &path, &headers, body).await.0;
    }
    s.stats.held.fetch_add(1, Ordering::Relaxed);
    // In a task of its own: the server hangs up long before (its call timed out), and the call
    // must land all the same.
    let task = tokio::spawn(async move {
        tokio::time::sleep(s.hold).await;
        s.stats.delivered.fetch_add(1, Ordering::Relaxed);
        let (response, status) = forward(&s, method, &path, &headers, body).await;
        if status == Some(StatusCode::CREATED) {
            s.stats.booted.fetch_add(1, Ordering::Relaxed);
        }
        response
    });
    task.await.unwrap_or_else(|_| dropped())
}

/// Sends the call to the simulator; its answer (and its status), or a dropped connection when
/// the simulator dropped it.
async fn forward(
    s: &Shared,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> (Response, Option<StatusCode>) {
    let mut request = s.http.request(method, format!("{}{path}", s.upstream)).body(body);
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        request = request.header(header::CONTENT_TYPE, ct);
    }
    let answer = match request.send().await {
        Ok(answer) => answer,
        Err(_) => return (dropped(), None),
    };
    let status = answer.status();
    let content_type = answer.headers().get(header::CONTENT_TYPE).cloned();
    match answer.bytes().await {
        Ok(bytes) => {
            let mut response = (status, bytes).into_response();
            if let Some(ct) = content_type {
                response.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            (response, Some(status))
        }
        Err(_) => (dropped(), None),
    }
}

/// A response that never reaches the caller: its body fails before hyper flushed the status
/// line, so the connection is closed with nothing sent (as the simulator's `fail-after` does).
fn dropped() -> Response {
    let stream = futures::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the simulator dropped the connection",
        ))
    });
    Response::new(Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_tag_of_a_boot() {
        assert_eq!(super::boot_tag(br#"{"image":"i","cpu":1,"memory_gb":1,"tag":"sk-1"}"#).as_deref(), Some("sk-1"));
        assert_eq!(super::boot_tag(b"{}"), None);
        assert_eq!(super::boot_tag(b"not json"), None);
    }
}
