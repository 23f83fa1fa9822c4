//! A retry core for any HTTP request made idempotent by an `Idempotency-Key`.
//!
//! The key ([`OpKey`]) is made once per logical operation, before the first attempt, and the
//! [`Retrier`] sends it on every attempt: a fresh key per attempt would make each retry look like
//! a new operation to the server, which is exactly the duplicate the key exists to prevent.
//!
//! Retried: connection errors, timeouts, cut-short bodies, 5xx, 429 and `409 request-in-progress`,
//! with capped exponential backoff and full jitter, waiting at least as long as `Retry-After` asks,
//! until [`RetryPolicy::max_elapsed`] is spent: the time budget is what ends retrying (an attempt
//! cap, [`RetryPolicy::max_attempts`], is off unless set). Never retried: `idempotency-key-reused`,
//! 401/403 and every other 4xx, and a TLS failure (an untrusted certificate does not become trusted
//! by asking again).
//!
//! ```no_run
//! use leasebroker_client::retry::{OpKey, Retrier, RetryPolicy};
//! use std::time::Duration;
//! # async fn demo() -> Result<(), leasebroker_client::Error> {
//! let http = reqwest::Client::new();
//! let retrier = Retrier::new(RetryPolicy::default().with_max_elapsed(Duration::from_secs(60)));
//! let key = OpKey::new_v4(); // once, before the first attempt
//! let response = retrier
//!     .send(Some(&key), || http.post("http://127.0.0.1:8080/v1/charges").body("{\"amount\":1}"))
//!     .await?;
//! println!("{} after {} attempts", response.status, response.attempts);
//! # Ok(()) }
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use rand::Rng;
use reqwest::header::HeaderMap;
use reqwest::{RequestBuilder, StatusCode};

use crate::error::Error;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// The response header a server sets when it answers from its stored response.
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";
/// The longest key a server must accept (docs/protocol.md#the-key).
pub const MAX_KEY_LEN: usize = 128;

/// The idempotency key of one logical operation: 1 to 128 visible ASCII characters.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OpKey(String);

impl OpKey {
    /// A fresh random key (a UUIDv4), for a new logical operation.
    pub fn new_v4() -> Self {
        OpKey(uuid::Uuid::new_v4().to_string())
    }

    /// Validates a key chosen elsewhere (a journal, a caller's own scheme).
    pub fn parse(s: &str) -> Result<Self, InvalidKey> {
        if s.is_empty() || s.len() > MAX_KEY_LEN || !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidKey { len: s.len() });
        }
        Ok(OpKey(s.to_owned()))
    }

    /// The key as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for OpKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("OpKey").field(&self.0).finish()
    }
}

impl fmt::Display for OpKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for OpKey {
    type Err = InvalidKey;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OpKey::parse(s)
    }
}

/// A string that is not a valid idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an idempotency key is 1 to {MAX_KEY_LEN} visible ASCII characters (got {len} bytes)")]
pub struct InvalidKey {
    len: usize,
}

/// How long and how often to retry one logical operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Most requests to send, the first included (at least 1). [`u32::MAX`] by default, i.e. no
    /// cap: [`RetryPolicy::max_elapsed`] is the budget. Set it only to end retrying earlier on
    /// purpose; a cap that runs out first ends the operation before its time budget is spent.
    pub max_attempts: u32,
    /// Total budget from the first attempt: no wait or attempt reaches past it.
    pub max_elapsed: Duration,
    /// The backoff cap of the first retry; each retry doubles it up to `max_delay`.
    pub min_delay: Duration,
    /// The largest backoff cap.
    pub max_delay: Duration,
    /// The timeout of one attempt (connect, send, read the whole response).
    pub attempt_timeout: Duration,
}

impl Default for RetryPolicy {
    /// Retries for 10 minutes (no attempt cap), backoff caps from 200 ms doubling to 30 s, 30 s per
    /// attempt.
    fn default() -> Self {
        RetryPolicy {
            max_attempts: u32::MAX,
            max_elapsed: Duration::from_secs(600),
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// Sets [`RetryPolicy::max_attempts`].
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }
    /// Sets [`RetryPolicy::max_elapsed`].
    pub fn with_max_elapsed(mut self, d: Duration) -> Self {
        self.max_elapsed = d;
        self
    }
    /// Sets [`RetryPolicy::min_delay`] and [`RetryPolicy::max_delay`].
    pub fn with_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }
    /// Sets [`RetryPolicy::attempt_timeout`].
    pub fn with_attempt_timeout(mut self, d: Duration) -> Self {
        self.attempt_timeout = d;
        self
    }

    /// The backoff caps: exponential, capped, one per retry.
    fn caps(&self) -> impl Iterator<Item = Duration> {
        let builder = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay.max(self.min_delay))
            .with_factor(2.0);
        match self.max_attempts {
            u32::MAX => builder.without_max_times(),
            n => builder.with_max_times(n.saturating_sub(1) as usize),
        }
        .build()
    }
}

/// Full jitter: a uniform wait in `[0, cap]`. backon's own jitter adds `[0, cap)` on top of the cap,
/// which keeps synchronised clients synchronised at the low end; full jitter spreads them out.
fn full_jitter(cap: Duration) -> Duration {
    let nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::rng().random_range(0..=nanos))
}

/// A complete, successful (2xx) response.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HttpResponse {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// Whether the server answered from its stored response (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// How many requests were sent to get it, this one included.
    pub attempts: u32,
}

/// What one attempt came to.
#[derive(Debug)]
#[non_exhaustive]
pub enum AttemptOutcome<'a> {
    /// A 2xx response.
    Success {
        /// Its status.
        status: StatusCode,
        /// Whether it was a replay of a stored response.
        replayed: bool,
    },
    /// An error, retryable or not.
    Failed(&'a Error),
}

/// One attempt, as reported to the [`Retrier::on_attempt`] hook.
#[derive(Debug)]
#[non_exhaustive]
pub struct Attempt<'a> {
    /// 1 for the first request.
    pub number: u32,
    /// Time since the first attempt started.
    pub elapsed: Duration,
    /// What happened.
    pub outcome: AttemptOutcome<'a>,
    /// The wait before the next attempt; `None` when this was the last one.
    pub next_wait: Option<Duration>,
}

impl fmt::Display for Attempt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "attempt {} ({:.2}s): ", self.number, self.elapsed.as_secs_f64())?;
        match &self.outcome {
            AttemptOutcome::Success { status, replayed: true } => write!(f, "{status} (replayed)")?,
            AttemptOutcome::Success { status, replayed: false } => write!(f, "{status}")?,
            AttemptOutcome::Failed(err) => write!(f, "{err}")?,
        }
        match self.next_wait {
            Some(wait) => write!(f, "; retrying in {:.2}s", wait.as_secs_f64()),
            None => Ok(()),
        }
    }
}

type Hook = Arc<dyn Fn(&Attempt<'_>) + Send + Sync>;

/// Sends a request until it succeeds, fails for good, or the [`RetryPolicy`] budget runs out.
#[derive(Clone, Default)]
pub struct Retrier {
    policy: RetryPolicy,
    hook: Option<Hook>,
}

impl fmt::Debug for Retrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retrier").field("policy", &self.policy).field("hook", &self.hook.is_some()).finish()
    }
}

impl Retrier {
    /// A retrier with this policy and no hook.
    pub fn new(policy: RetryPolicy) -> Self {
        Retrier { policy, hook: None }
    }

    /// Calls `hook` after every attempt (for logging: number, outcome, next wait).
    pub fn on_attempt(mut self, hook: impl Fn(&Attempt<'_>) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// The policy in use.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Sends the request `build` makes, once per attempt, with `key` as `Idempotency-Key` on every
    /// attempt (no key for naturally idempotent reads).
    ///
    /// Returns the first 2xx response. A non-retryable error is returned as it is; running out of
    /// attempts or time while the errors are retryable returns [`Error::GaveUp`] with the last one.
    pub async fn send<F>(&self, key: Option<&OpKey>, mut build: F) -> Result<HttpResponse, Error>
    where
        F: FnMut() -> RequestBuilder,
    {
        let policy = &self.policy;
        let start = Instant::now();
        let mut caps = policy.caps();
        let mut number = 0u32;
        loop {
            number += 1;
            let remaining = policy.max_elapsed.saturating_sub(start.elapsed());
            let mut request = build().timeout(policy.attempt_timeout.min(remaining));
            if let Some(key) = key {
                request = request.header(IDEMPOTENCY_KEY, key.as_str());
            }
            let result = attempt(request).await;
            let err = match result {
                Ok(mut response) => {
                    response.attempts = number;
                    let outcome = AttemptOutcome::Success { status: response.status, replayed: response.replayed };
                    self.report(number, start, outcome, None);
                    return Ok(response);
                }
                Err(err) => err,
            };
            let wait = if err.is_retryable() { self.next_wait(&mut caps, &err, start) } else { None };
            self.report(number, start, AttemptOutcome::Failed(&err), wait);
            match wait {
                Some(wait) => tokio::time::sleep(wait).await,
                None if err.is_retryable() => {
                    return Err(Error::GaveUp { attempts: number, elapsed: start.elapsed(), last: Box::new(err) });
                }
                None => return Err(err),
            }
        }
    }

    /// The wait before the next attempt, or `None` when the budget does not allow one.
    fn next_wait(&self, caps: &mut impl Iterator<Item = Duration>, err: &Error, start: Instant) -> Option<Duration> {
        let jittered = full_jitter(caps.next()?);
        // The server knows when it will be ready; waiting less than it asked only earns another 409/503.
        let wait = err.retry_after().map_or(jittered, |asked| jittered.max(asked));
        // An attempt that starts at the deadline has no time left to run, so it is not worth sending.
        (start.elapsed() + wait < self.policy.max_elapsed).then_some(wait)
    }

    fn report(&self, number: u32, start: Instant, outcome: AttemptOutcome<'_>, next_wait: Option<Duration>) {
        if let Some(hook) = &self.hook {
            hook(&Attempt { number, elapsed: start.elapsed(), outcome, next_wait });
        }
    }
}

/// One request: send it, read the whole body, classify.
async fn attempt(request: RequestBuilder) -> Result<HttpResponse, Error> {
    let response = request.send().await.map_err(Error::from_reqwest)?;
    let status = response.status();
    let headers = response.headers().clone();
    // A body cut short is a transport error: the server may have done the work, so it is retried.
    let body = response.bytes().await.map_err(Error::from_reqwest)?;
    if let Some(err) = Error::from_response(status, &headers, &body) {
        return Err(err);
    }
    let replayed =
        headers.get(IDEMPOTENT_REPLAYED).is_some_and(|v| v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"true"));
    Ok(HttpResponse { status, headers, body, replayed, attempts: 0 })
}
