//! The header names the layer reads and writes, in one place.

use http::HeaderName;

/// The request header that carries the key (SPEC 1.1).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replay (`Idempotent-Replayed: true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response header that tells until when the key's record is kept (SPEC 1.3): the record's
/// expiry as an IMF-fixdate, on every response to a keyed request that has a record.
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

/// The request header of RFC 7240 preferences; the layer honours `wait=N`.
pub const PREFER: HeaderName = HeaderName::from_static("prefer");

/// The response header that says which preferences were honoured (RFC 7240 section 3).
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
