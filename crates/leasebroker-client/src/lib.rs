//! A leasebroker client that keeps one Idempotency-Key per logical operation across retries and restarts
