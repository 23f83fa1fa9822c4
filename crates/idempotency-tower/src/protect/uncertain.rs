//! A retry that finds its record uncertain, or a claim gone stale that becomes uncertain
//! ([`crate::StaleClaims::Uncertain`]): what the request's [`OnUncertain`] rule says it gets.

use axum::body::Body;
use http::Response;
use idempotency::{Claim, ReclaimRequest, Record, Resolve, StoredBody, StoredResponse, Timestamp};

use super::store_down;
use crate::config::Config;
use crate::expires::with_expiry;
use crate::problem::{Rejection, rejection_response};
use crate::replay::{replay, replayable_headers};
use crate::uncertain::{OnUncertain, Probed};

/// What the claim loop does next with an uncertain record.
pub(super) enum Next {
    /// Answer this.
    Answer(Response<Body>),
    /// Run the handler as the owner of this claim (the record taken over).
    Own(Claim),
    /// The record changed under this request (another took it over, resolved or forgot it):
    /// read it again and decide again.
    Again,
}

/// The rule for this request: its own, put in its extensions before the layer, else the layer's.
pub(super) fn rule_of(cfg: &Config, extensions: &http::Extensions) -> OnUncertain {
    extensions.get::<OnUncertain>().cloned().unwrap_or_else(|| cfg.on_uncertain.clone())
}

/// A reclaim-style request on `record` at `t`, keeping the record at least the retention.
pub(super) fn on_record<'a>(cfg: &Config, record: &'a Record, t: Timestamp) -> ReclaimRequest<'a> {
    ReclaimRequest {
        record,
        now: t,
        in_flight_ttl: cfg.in_flight_ttl,
        expires_at: idempotency::later(t, cfg.retention),
    }
}

/// Turns `record`, in flight with a stale claim, uncertain. `Some`: this request did (the record
/// as it now is); `None`: the record changed first (read it again).
pub(super) async fn mark_stale(cfg: &Config, record: &Record, t: Timestamp) -> Result<Option<Record>, Response<Body>> {
    match cfg.state.deadline.bounded("mark_uncertain", cfg.store.mark_stale_uncertain(on_record(cfg, record, t))).await
    {
        Ok(Some(marked)) => {
            tracing::warn!(
                record_id = %marked.record_id.to_hex(),
                generation = marked.generation,
                "a stale in-flight claim is marked uncertain: its attempt may have acted, it is not run again on a guess"
            );
            cfg.state.waiters.wake(&marked.scope);
            Ok(Some(marked))
        }
        Ok(None) => Ok(None),
        Err(e) => Err(store_down(cfg, "mark_stale_uncertain", e)),
    }
}

/// What a retry of the uncertain `record` gets under `rule`.
pub(super) async fn retry(cfg: &Config, record: &Record, t: Timestamp, rule: &OnUncertain) -> Next {
    match rule {
        OnUncertain::Hold => Next::Answer(held(cfg, record)),
        OnUncertain::Resend => take_over(cfg, record, t).await,
        OnUncertain::Probe(probe) => match probe.probe(record).await {
            Probed::Happened(response) => resolve(cfg, record, t, response).await,
            Probed::NeverHappened => take_over(cfg, record, t).await,
            Probed::Unknown => {
                let rejection = Rejection::ProbeUnanswered {
                    record_id: record.record_id,
                    retry_after: cfg.in_progress_retry_after,
                };
                Next::Answer(with_expiry(rejection_response(cfg, rejection), record.expires_at))
            }
        },
    }
}

/// `409 outcome-uncertain` naming the record.
fn held(cfg: &Config, record: &Record) -> Response<Body> {
    let res = rejection_response(cfg, Rejection::UncertainHeld { record_id: record.record_id });
    with_expiry(res, record.expires_at)
}

async fn take_over(cfg: &Config, record: &Record, t: Timestamp) -> Next {
    match cfg
        .state
        .deadline
        .bounded("take_over_uncertain", cfg.store.take_over_uncertain(on_record(cfg, record, t)))
        .await
    {
        Ok(Some(claim)) => {
            tracing::warn!(
                record_id = %record.record_id.to_hex(),
                generation = claim.generation(),
                "an uncertain record is taken over; the handler runs again"
            );
            Next::Own(claim)
        }
        Ok(None) => Next::Again,
        Err(e) => Next::Answer(store_down(cfg, "take_over_uncertain", e)),
    }
}

/// Stores what the probe found as the record's response and replays it.
async fn resolve(cfg: &Config, record: &Record, t: Timestamp, response: http::Response<bytes::Bytes>) -> Next {
    let (parts, body) = response.into_parts();
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers: replayable_headers(cfg, &parts.headers),
        body: StoredBody::encode(body, cfg.compression_threshold),
    };
    let expires_at = idempotency::later(t, cfg.retention);
    match cfg.state.deadline.bounded("resolve", cfg.store.resolve(&record.record_id, &stored, expires_at)).await {
        Ok(Resolve::Resolved(resolved)) => {
            tracing::info!(record_id = %record.record_id.to_hex(), status = stored.status, "an uncertain record is resolved by its probe");
            cfg.state.waiters.wake(&record.scope);
            Next::Answer(with_expiry(replay(cfg, &stored), resolved.expires_at))
        }
        Ok(Resolve::NotUncertain(_) | Resolve::Absent) => Next::Again,
        Err(e) => Next::Answer(store_down(cfg, "resolve", e)),
    }
}
