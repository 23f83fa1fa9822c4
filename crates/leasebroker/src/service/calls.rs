//! Time: the clock at the ledger's precision, and the longest wait a settle window can ask of a
//! client.

use std::time::Duration;

/// The longest `Retry-After` a retry is told while an earlier call may still land, under a settle
/// window of `settle`: the window counts from the send stamp, which lies up to
/// [`idempotency_effects::DEFAULT_SEND_AHEAD`] ahead of the clock, and is rounded up to whole
/// seconds.
pub(crate) fn longest_settle_retry_after(settle: Duration) -> Duration {
    let window = settle.saturating_add(idempotency_effects::DEFAULT_SEND_AHEAD);
    Duration::from_secs(window.as_secs() + u64::from(window.subsec_nanos() > 0))
}

pub(crate) fn now_micros() -> i64 {
    idempotency::now().timestamp_micros()
}

/// Microseconds in `d`, saturating.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
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
