//! Renewing a claim while its attempt runs, so a handler slower than the in-flight TTL is not
//! taken for a dead one and run a second time, and its record does not expire under it however
//! short the retention.

use std::time::Duration;

use futures::future::Either;
use idempotency::{Claim, ErrorChain, Renewal, StoreError, now};

use crate::config::Config;

/// The shortest time between two renewals of a claim, whatever the in-flight TTL.
const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// Runs `work` while renewing `claim` every quarter of the in-flight TTL, so a live attempt
/// never goes stale and its record never expires (each renewal moves the expiry to at least
/// `now + retention`). A fenced heartbeat (the claim was taken over, or the record is final)
/// stops the renewal; `work` still runs to its end.
pub(super) async fn with_heartbeat<F: Future>(cfg: &Config, claim: &Claim, work: F) -> F::Output {
    let every = (cfg.in_flight_ttl / 4).max(MIN_HEARTBEAT);
    let beat = async {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let at = now();
            let renewal = Renewal {
                now: at,
                in_flight_ttl: cfg.in_flight_ttl,
                expires_at: idempotency::later(at, cfg.retention),
            };
            match cfg.state.deadline.bounded("heartbeat", cfg.store.heartbeat(claim, renewal)).await {
                Ok(()) => {}
                Err(StoreError::Fenced { generation }) => {
                    tracing::warn!(generation, "the claim is no longer this attempt's; renewal stops");
                    return;
                }
                Err(e) => tracing::warn!(
                    error = %ErrorChain(&e),
                    "renewing the claim failed; trying again at the next beat"
                ),
            }
        }
    };
    let work = std::pin::pin!(work);
    match futures::future::select(work, std::pin::pin!(beat)).await {
        Either::Left((out, _)) => out,
        Either::Right(((), work)) => work.await,
    }
}
