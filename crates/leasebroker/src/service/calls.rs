//! Calls to a downstream that may land late: the send stamp taken ahead of the clock, the settle
//! window, and the clean-up of a second VM that landed past it.

use idempotency::ErrorChain;
use std::time::Duration;

use super::{DUPLICATE_VMS_DESTROYED_TOTAL, ServiceError};
use crate::hypervisor::client::HypervisorClient;

/// The right to send a fenced call (boot, reboot, flash), as the send-stamp compare-and-set
/// answered it (`Domain::stamp_intent`, `Domain::stamp_flash`, or a new intent born with its
/// stamp): `None` (another attempt acted on the call since it was read) answers 503 and sends
/// nothing; a stamp whose commit came back after the stamped moment too (see
/// [`stamped_in_time`]). Returns the stamp.
pub(crate) fn may_send(tag: &str, stamp: Option<i64>) -> Result<i64, ServiceError> {
    let Some(stamp) = stamp else {
        tracing::warn!(tag, "another attempt acted on this call since it was read; not sending it");
        return Err(ServiceError::upstream(
            "another attempt of this request is calling the downstream; retry with the same key",
        ));
    };
    stamped_in_time(tag, stamp)?;
    Ok(stamp)
}

/// Errs with 503 when the commit of the send stamp `stamp` came back after the stamped moment
/// (the stamp is taken a little ahead of the clock, inside the transaction, once it holds its
/// lock): then the call is not sent, and the retry waits out the settle window from the stamp.
pub(crate) fn stamped_in_time(tag: &str, stamp: i64) -> Result<(), ServiceError> {
    if now_micros() >= stamp {
        tracing::warn!(tag, "recording the call took too long; not sending it");
        return Err(ServiceError::upstream(
            "the database was too slow to record the call before sending it; nothing was sent",
        ));
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

/// The longest `Retry-After` [`settled_since`] gives for a call sent under a settle window of
/// `settle`: the window counts from the send stamp, which lies up to
/// [`crate::domain::SEND_STAMP_AHEAD`] ahead of the clock, and is rounded up to whole seconds.
pub(crate) fn longest_settle_retry_after(settle: Duration) -> Duration {
    let window = settle.saturating_add(crate::domain::SEND_STAMP_AHEAD);
    Duration::from_secs(window.as_secs() + u64::from(window.subsec_nanos() > 0))
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
            crate::activity::record(
                crate::activity::ActionKind::DuplicateDestroyed,
                format!("VM {vm_id} (tag {tag}; kept {keep})"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_settle_retry_after_counts_the_stamp_ahead_and_rounds_up() {
        let secs = |s: f64| longest_settle_retry_after(Duration::from_secs_f64(s)).as_secs();
        // 1.5 s + 1 s ahead = 2.5 s -> 3; 4.5 s (faultline's smoke run) -> 6; whole seconds stay.
        assert_eq!((secs(1.5), secs(4.5), secs(30.0), secs(0.0)), (3, 6, 31, 1));
    }
}
