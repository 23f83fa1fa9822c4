//! Sign-ins throttled per source address: every attempt from one address, right or wrong, takes
//! one from its budget ([`BURST`] at once, one more every [`EVERY`]), and one beyond it is
//! refused (`429` with `Retry-After`) before the token is looked at, so guessing the admin token
//! costs a minute per ten guesses. The source is the TCP peer: behind a proxy every client shares
//! the proxy's budget, which a proxy in front should throttle per client itself.

use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Sign-in attempts one source may make at once.
pub const BURST: u32 = 10;
/// How often a source gets one more attempt.
pub const EVERY: Duration = Duration::from_secs(6);
/// Past this many sources held, the ones whose budget is full again are dropped.
const MAX_SOURCES: usize = 10_000;

/// The per-source budget of sign-in attempts.
#[derive(Clone)]
pub struct LoginThrottle {
    limiter: Arc<DefaultKeyedRateLimiter<IpAddr>>,
    /// Sources refused since their last admitted attempt: a streak is logged once.
    refused: Arc<Mutex<HashSet<IpAddr>>>,
}

impl fmt::Debug for LoginThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoginThrottle").field("sources", &self.limiter.len()).finish()
    }
}

impl Default for LoginThrottle {
    fn default() -> Self {
        let burst = NonZeroU32::new(BURST).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::with_period(EVERY).unwrap_or(Quota::per_second(NonZeroU32::MIN)).allow_burst(burst);
        Self { limiter: Arc::new(RateLimiter::keyed(quota)), refused: Arc::default() }
    }
}

/// A sign-in attempt over its source's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    /// Seconds until the source may try again (at least 1).
    pub retry_after: u64,
    /// Whether this is the first refusal since the source's last admitted attempt.
    pub first: bool,
}

impl LoginThrottle {
    /// Takes one attempt from `source`'s budget, or says how long it must wait.
    pub fn attempt(&self, source: IpAddr) -> Result<(), Throttled> {
        if self.limiter.len() > MAX_SOURCES {
            self.limiter.retain_recent();
        }
        let mut refused = self.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match self.limiter.check_key(&source) {
            Ok(()) => {
                refused.remove(&source);
                Ok(())
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.limiter.clock().now());
                let retry_after = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
                if refused.len() > MAX_SOURCES {
                    refused.clear();
                }
                Err(Throttled { retry_after, first: refused.insert(source) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_has_a_budget_of_its_own() {
        let throttle = LoginThrottle::default();
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().expect("ip"), "192.0.2.2".parse().expect("ip"));
        for _ in 0..BURST {
            assert_eq!(throttle.attempt(a), Ok(()));
        }
        let first = throttle.attempt(a).expect_err("over the budget");
        assert!(first.first && (1..=EVERY.as_secs()).contains(&first.retry_after), "{first:?}");
        assert!(!throttle.attempt(a).expect_err("still over").first, "a streak is one refusal to log");
        assert_eq!(throttle.attempt(b), Ok(()), "another source is not held back");
    }
}
