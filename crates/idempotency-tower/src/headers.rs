//! The header names the layer reads and writes, in one place.

use http::HeaderName;

/// The request header that carries the key (SPEC 1.1).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replay (`Idempotent-Replayed: true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
