//! Calls to a downstream that may land late: the send stamp taken ahead of the clock, the settle
//! window, and the clean-up of a second VM that landed past it.

use idempotency::ErrorChain;
use std::time::Duration;

use super::{DUPLICATE_VMS_DESTROYED_TOTAL, ServiceError};
use crate::hypervisor::client::HypervisorClient;

/// How far ahead of the clock a call's send stamp lies: the longest the stamp's write may take
/// for the call still to be sent ([`Workers::mark_sending`]).
const SEND_STAMP_AHEAD_MICROS: i64 = 1_000_000;

/// The send stamp of a call about to be sent, for an intent whose stamp was `seen`: a little
/// ahead of the clock, and always past `seen` (so the compare-and-set moves it).
pub(crate) fn send_stamp(seen: i64) -> i64 {
    now_micros().saturating_add(SEND_STAMP_AHEAD_MICROS).max(seen + 1)
}

/// Errs with 503 when the write of the send stamp `stamp` came back after the stamped moment:
/// then the call is not sent (see [`Workers::mark_sending`]).
pub(crate) fn stamped_in_time(tag: &str, stamp: i64) -> Result<(), ServiceError> {
    if now_micros() >= stamp {
        tracing::warn!(tag, "recording the call took too long; not sending it");
        return Err(ServiceError::UpstreamUnavailable {
            reason: "the database was too slow to record the call before sending it; nothing was sent".into(),
            retry_after: 1,
        });
    }
    Ok(())
}

/// Errs with 503 + Retry-After while a call sent at `sent_at` may still land: until `settle`
/// has passed since.
pub(crate) fn settled_since(tag: &str, sent_at: i64, settle: Duration) -> Result<(), ServiceError> {
    let settle = micros(settle);
    let waited = now_micros().saturating_sub(sent_at);
    if waited < settle {
        let left = ((settle - waited) + 999_999) / 1_000_000;
        tracing::info!(tag, left_s = left, "an earlier call may still land; waiting");
        return Err(ServiceError::UpstreamUnavailable {
            reason: "an earlier attempt's call may still take effect; retry with the same key".into(),
            retry_after: u64::try_from(left).unwrap_or(1).max(1),
        });
    }
    Ok(())
}

pub(crate) fn now_micros() -> i64 {
    idempotency::now().timestamp_micros()
}

/// Microseconds in `d`, saturating.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Deletes the VMs in `extra`, which carry the tag of a boot whose VM `keep` was adopted:
/// calls that landed after the settle window. Each one deleted is counted.
pub(crate) async fn destroy_duplicates(hypervisor: &HypervisorClient, tag: &str, keep: &str, extra: &[String]) {
    for vm_id in extra {
        // Counted when the delete was done or may have been (a slow hypervisor's delete can
        // time out and still land); a VM already gone is not counted again.
        let deleted = match hypervisor.delete(vm_id).await {
            Ok(existed) => existed,
            Err(e) => {
                tracing::warn!(%tag, %vm_id, error = %ErrorChain(&e), "deleting a duplicate VM failed; checking again next tick");
                e.may_have_happened()
            }
        };
        if deleted {
            metrics::counter!(DUPLICATE_VMS_DESTROYED_TOTAL).increment(1);
            tracing::warn!(%tag, %vm_id, kept = %keep,
                "a second VM for one boot (a call landed after the settle window): deleted it; \
                 --hypervisor-settle is shorter than the hypervisor takes");
        }
    }
}
