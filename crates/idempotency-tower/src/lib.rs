//! A tower/axum layer that makes mutating endpoints safe to retry with Idempotency-Key
