//! Recording the end of an attempt in the store: `complete` with its response (retried in the
//! background when the store fails; left in flight when every retry fails) or `fail` (released
//! later when the store does not take it).

use std::sync::Arc;

use axum::body::Body;
use backon::{BackoffBuilder, ExponentialBuilder};
use http::Response;
use idempotency::{Claim, ErrorChain, StoreError, StoredResponse, Timestamp};
use tracing::Instrument;

use super::heartbeat::with_heartbeat;
use crate::config::Config;
use crate::expires::with_expiry;
use crate::problem::{Rejection, rejection_response};

/// Stores the response of `claim`'s attempt. A store error (other than being fenced) is retried
/// with backoff in a task of its own, so the client is answered at once; the claim is renewed
/// while it retries. If every retry fails, the record stays in flight (docs/protocol.md#side-effects): its client was
/// answered as final, so the handler must not run again at once (a retry that follows a lost
/// answer would run it a second time). Nobody renews the claim any more, so the first retry after
/// the in-flight TTL takes it over and runs the handler again, which resumes through its
/// sub-keys.
///
/// Returns the error when the store wrote the completion but its replicas did not acknowledge
/// it ([`StoreError::is_not_acknowledged`]): nothing is retried (the write is in the store
/// already), and the caller must not answer the response as final.
pub(super) async fn complete(
    cfg: &Arc<Config>,
    claim: &Arc<Claim>,
    stored: StoredResponse,
    expires_at: Timestamp,
) -> Option<StoreError> {
    let first = cfg.state.deadline.bounded("complete", cfg.store.complete(claim, &stored, expires_at)).await;
    let error = match first {
        Ok(()) => {
            cfg.state.waiters.wake(claim.scope());
            return None;
        }
        Err(StoreError::Fenced { generation }) => {
            tracing::warn!(
                generation,
                "a newer attempt owns this key; its response is the one replayed, this client gets its own"
            );
            return None;
        }
        Err(e) if e.is_not_acknowledged() => return Some(e),
        Err(e) => e,
    };
    let retry = cfg.completion_retry;
    tracing::warn!(
        error = %ErrorChain(&error),
        retries = retry.times,
        "storing the response failed; retrying in the background"
    );
    let detached = &cfg.state.detached;
    let (cfg, claim) = (cfg.clone(), claim.clone());
    let task = async move {
        let delays = ExponentialBuilder::default()
            .with_min_delay(retry.first_delay)
            .with_max_delay(retry.max_delay)
            .with_max_times(retry.times)
            .with_jitter()
            .build();
        let retried = async {
            let mut last = error;
            for delay in delays {
                tokio::time::sleep(delay).await;
                match cfg.state.deadline.bounded("complete", cfg.store.complete(&claim, &stored, expires_at)).await {
                    Ok(()) => return Ok(()),
                    Err(e @ StoreError::Fenced { .. }) => return Err(e),
                    Err(e) => {
                        tracing::debug!(error = %ErrorChain(&e), "storing the response failed again");
                        last = e;
                    }
                }
            }
            Err(last)
        };
        match with_heartbeat(&cfg, &claim, retried).await {
            Ok(()) => {
                cfg.state.waiters.wake(claim.scope());
                tracing::info!("the response was stored on a retry")
            }
            Err(StoreError::Fenced { generation }) => {
                tracing::warn!(generation, "a newer attempt took the key over while the response was being stored")
            }
            Err(e) => tracing::error!(
                error = %ErrorChain(&e),
                "storing the response failed on every retry; the record stays in flight, and the first retry after \
                 the in-flight TTL runs the handler again (resuming through its sub-keys)"
            ),
        }
    };
    // Counted like a detached handler, so a shutdown drain waits for the response to be stored.
    detached.spawn(task.instrument(tracing::Span::current()));
    None
}

/// Marks the attempt failed so the next retry runs the handler at once. When the store does not
/// take it, the claim is queued for release as soon as the store answers again
/// ([`Releases`](crate::release::Releases)).
pub(super) async fn fail(cfg: &Arc<Config>, claim: &Arc<Claim>, why: &'static str) {
    let sent = tokio::time::Instant::now();
    match cfg.state.deadline.bounded("fail", cfg.store.fail(claim)).await {
        Ok(()) => {
            // A failed record holds nothing that counts against the record limit.
            if let Some(limit) = &cfg.state.record_limit {
                limit.release(&claim.scope().principal, sent);
            }
            // A waiter takes the record over and runs the handler itself.
            cfg.state.waiters.wake(claim.scope());
            tracing::info!(why, "attempt failed; a retry runs the handler again")
        }
        Err(StoreError::Fenced { generation }) => {
            tracing::warn!(generation, why, "attempt failed after a newer attempt took the key over")
        }
        Err(e) => {
            tracing::error!(
                error = %ErrorChain(&e),
                why,
                "marking the attempt failed did not work; it is released when the store answers again"
            );
            cfg.state.releases.push(claim.clone(), why);
        }
    }
}

/// Marks the attempt uncertain (its handler does not know whether its request acted) and answers
/// `504 outcome-uncertain`. When the store does not take it, the record stays in flight: once
/// stale, a layer with [`StaleClaims::Uncertain`](crate::StaleClaims::Uncertain) makes it
/// uncertain then.
pub(super) async fn mark_uncertain(cfg: &Arc<Config>, claim: &Arc<Claim>) -> Response<Body> {
    match cfg.state.deadline.bounded("mark_uncertain", cfg.store.mark_uncertain(claim)).await {
        Ok(()) => {
            cfg.state.waiters.wake(claim.scope());
            tracing::warn!(
                record_id = %claim.record().record_id.to_hex(),
                "the handler does not know whether its request acted; the record is uncertain"
            )
        }
        Err(StoreError::Fenced { generation }) => {
            tracing::warn!(generation, "outcome uncertain after a newer attempt took the key over")
        }
        Err(e) => tracing::error!(
            error = %ErrorChain(&e),
            "marking the attempt uncertain did not work; the record stays in flight until its claim goes stale"
        ),
    }
    let rejection = Rejection::OutcomeUnknown { record_id: claim.record().record_id };
    with_expiry(rejection_response(cfg, rejection), claim.record().expires_at)
}
