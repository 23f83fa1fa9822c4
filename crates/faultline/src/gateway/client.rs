//! The clients of a gateway run: one key per logical operation, kept across every retry, with
//! full-jitter backoff that honours `Retry-After`, as the client rules ask; and the upstream's own
//! count of what it did.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::Rng;
use serde::{Deserialize, Serialize};

/// A fault the upstream is asked for (by request header) on an operation's first attempt only:
/// a retry carries none, as a fault of the moment would not repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UpstreamFault {
    /// The work is done and the answer comes this much later: after the gateway's upstream
    /// timeout, so its outcome is unknown.
    Slow(Duration),
    /// The work is done and the connection reset instead of an answer.
    Reset,
    /// `503` without doing anything (the upstream's own "try again").
    Unavailable,
}

impl UpstreamFault {
    fn headers(self) -> Vec<(&'static str, String)> {
        match self {
            UpstreamFault::Slow(delay) => vec![("X-Upstream-Delay-Ms", delay.as_millis().to_string())],
            UpstreamFault::Reset => vec![("X-Upstream-Reset", "1".to_owned())],
            UpstreamFault::Unavailable => {
                vec![("X-Upstream-Skip", "1".to_owned()), ("X-Upstream-Status", "503".to_owned())]
            }
        }
    }
}

/// One logical operation.
#[derive(Debug, Clone)]
pub(super) struct Op {
    /// Its number.
    pub(super) index: u64,
    /// Its name in the body (`op-17`), which the upstream counts its executions under.
    pub(super) name: String,
    /// Its one key, made before the first attempt.
    key: String,
    /// Its principal's bearer token.
    token: String,
    /// Its first attempt's upstream fault.
    pub(super) fault: Option<UpstreamFault>,
}

impl Op {
    pub(super) fn new(index: u64, principal: u32, fault: Option<UpstreamFault>) -> Self {
        Op {
            index,
            name: format!("op-{index}"),
            key: format!("fl-{:032x}", rand::random::<u128>()),
            token: format!("faultline-token-p{principal}"),
            fault,
        }
    }

    fn body(&self) -> String {
        serde_json::json!({ "op": self.name }).to_string()
    }
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum End {
    /// A 2xx; `order` is the upstream's execution number in its body.
    Succeeded { order: Option<u64>, replayed: bool },
    /// `409 outcome-uncertain`: held for an operator.
    Held,
    /// The retry budget was spent; the last attempt's error.
    GaveUp { last: String },
    /// A final 4xx other than the two above.
    Refused { status: u16, body: String },
}

/// One operation's ending, and its rerun's if it gave up.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Ending {
    /// The operation's index.
    pub(super) op: u64,
    /// How the workload's client ended it.
    pub(super) end: End,
    /// Its attempts.
    pub(super) attempts: u32,
    /// The rerun after the faults, for an operation that gave up.
    pub(super) rerun: Option<End>,
}

impl Ending {
    pub(super) fn gave_up(&self) -> bool {
        matches!(self.end, End::GaveUp { .. })
    }

    /// The ending that counts: the rerun's when there was one.
    pub(super) fn last(&self) -> &End {
        self.rerun.as_ref().unwrap_or(&self.end)
    }
}

/// What the clients did, counted as they went.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Operations ended (the workload's, not the reruns).
    pub(super) done: AtomicU64,
    /// Attempts sent.
    pub(super) attempts: AtomicU64,
    /// Answers with `Idempotent-Replayed: true`.
    pub(super) replayed: AtomicU64,
    /// `409 request-in-progress` answers.
    pub(super) in_progress: AtomicU64,
    /// `504` answers (`outcome-uncertain`: the gateway lost the upstream's answer).
    pub(super) uncertain_504: AtomicU64,
    /// `502` answers (`upstream-unavailable`).
    pub(super) unavailable_502: AtomicU64,
    /// Other 5xx and 429 answers.
    pub(super) other_5xx: AtomicU64,
    /// Attempts without an answer (connection failed, reset, timed out).
    pub(super) transport_errors: AtomicU64,
}

/// What one attempt got.
enum Attempt {
    /// Final.
    Done(End),
    /// Worth another attempt, after at least this long.
    Again { error: String, retry_after: Option<Duration> },
}

/// The clients: attempts spread over the targets (the proxies in front of the replicas).
pub(super) struct Client {
    http: reqwest::Client,
    targets: Vec<String>,
    attempt_timeout: Duration,
    budget: Duration,
    counters: std::sync::Arc<Counters>,
}

impl Client {
    pub(super) fn new(
        targets: Vec<String>,
        attempt_timeout: Duration,
        budget: Duration,
        counters: std::sync::Arc<Counters>,
    ) -> anyhow::Result<Self> {
        // No idle connections: every attempt opens its own, so a proxy fault hits one request.
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Client { http, targets, attempt_timeout, budget, counters })
    }

    /// The same clients with another retry budget (and counters of their own).
    pub(super) fn with_budget(&self, budget: Duration) -> Self {
        Client {
            http: self.http.clone(),
            targets: self.targets.clone(),
            attempt_timeout: self.attempt_timeout,
            budget,
            counters: std::sync::Arc::default(),
        }
    }

    /// Runs `op` to its end: the first attempt carries its upstream fault.
    pub(super) async fn run(&self, op: &Op) -> Ending {
        self.attempts(op, op.fault).await
    }

    /// Sends `op` again with its key, without a fault, until it ends or the budget is spent.
    pub(super) async fn rerun(&self, op: &Op) -> End {
        self.attempts(op, None).await.end
    }

    async fn attempts(&self, op: &Op, mut fault: Option<UpstreamFault>) -> Ending {
        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            let target = &self.targets[rand::rng().random_range(0..self.targets.len())];
            attempts += 1;
            self.counters.attempts.fetch_add(1, Ordering::Relaxed);
            let (error, retry_after) = match self.attempt(op, target, fault.take()).await {
                Attempt::Done(end) => return Ending { op: op.index, end, attempts, rerun: None },
                Attempt::Again { error, retry_after } => (error, retry_after),
            };
            // Full jitter, 50 ms doubling to 2 s; a Retry-After is waited out (up to 5 s).
            let cap = Duration::from_millis(50).saturating_mul(1 << attempts.min(6)).min(Duration::from_secs(2));
            let jitter = cap.mul_f64(rand::rng().random::<f64>());
            let wait = retry_after.map_or(jitter, |r| r.min(Duration::from_secs(5)).max(jitter));
            if started.elapsed() + wait + self.attempt_timeout > self.budget {
                return Ending { op: op.index, end: End::GaveUp { last: error }, attempts, rerun: None };
            }
            tokio::time::sleep(wait).await;
        }
    }

    async fn attempt(&self, op: &Op, target: &str, fault: Option<UpstreamFault>) -> Attempt {
        let mut request = self
            .http
            .post(format!("{target}/orders"))
            .timeout(self.attempt_timeout)
            .header("Idempotency-Key", format!("\"{}\"", op.key))
            .header("Authorization", format!("Bearer {}", op.token))
            .header("Content-Type", "application/json")
            .body(op.body());
        for (name, value) in fault.map(UpstreamFault::headers).unwrap_or_default() {
            request = request.header(name, value);
        }
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return self.transport_error(&e),
        };
        let status = response.status().as_u16();
        let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = match response.text().await {
            Ok(body) => body,
            Err(e) => return self.transport_error(&e),
        };
        let c = &self.counters;
        match status {
            200..=299 => {
                if replayed {
                    c.replayed.fetch_add(1, Ordering::Relaxed);
                }
                let order = serde_json::from_str::<serde_json::Value>(&body).ok().and_then(|v| v["order"].as_u64());
                Attempt::Done(End::Succeeded { order, replayed })
            }
            409 if body.contains("outcome-uncertain") => Attempt::Done(End::Held),
            409 if body.contains("request-in-progress") => {
                c.in_progress.fetch_add(1, Ordering::Relaxed);
                Attempt::Again { error: "409 request-in-progress".to_owned(), retry_after }
            }
            504 => {
                c.uncertain_504.fetch_add(1, Ordering::Relaxed);
                Attempt::Again { error: format!("504 {}", problem_name(&body)), retry_after }
            }
            502 => {
                c.unavailable_502.fetch_add(1, Ordering::Relaxed);
                Attempt::Again { error: format!("502 {}", problem_name(&body)), retry_after }
            }
            429 | 500..=599 => {
                c.other_5xx.fetch_add(1, Ordering::Relaxed);
                Attempt::Again { error: format!("{status} {}", problem_name(&body)), retry_after }
            }
            _ => Attempt::Done(End::Refused { status, body: body.chars().take(200).collect() }),
        }
    }

    fn transport_error(&self, e: &reqwest::Error) -> Attempt {
        self.counters.transport_errors.fetch_add(1, Ordering::Relaxed);
        let kind = if e.is_timeout() { "timed out" } else { "no answer" };
        Attempt::Again { error: format!("{kind}: {e}"), retry_after: None }
    }
}

/// The last path segment of a problem's `type`, or the body's start.
fn problem_name(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["type"].as_str().and_then(|t| t.rsplit('/').next()).map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(60).collect())
}

/// The upstream's own count (`GET /__count`).
#[derive(Debug, Clone, Default, Deserialize)]
pub(super) struct UpstreamCounts {
    /// Executions in all.
    pub(super) executions: u64,
    /// Each operation's executions, by order number.
    pub(super) by_op: HashMap<String, Vec<u64>>,
}

/// Reads the upstream's count, straight from it (no proxy).
pub(super) async fn upstream_counts(upstream: &str) -> anyhow::Result<UpstreamCounts> {
    let url = format!("{upstream}/__count");
    let response = reqwest::Client::builder().no_proxy().build()?.get(&url).send().await;
    let response = response.and_then(reqwest::Response::error_for_status).with_context(|| format!("GET {url}"))?;
    response.json().await.with_context(|| format!("GET {url}: not the upstream's count"))
}
