//! The header names the layer reads and writes, in one place.

use http::HeaderName;

/// The request header that carries the key (docs/protocol.md#the-key).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replay (`Idempotent-Replayed: true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response header that tells until when the key's record is kept (docs/protocol.md#records): the record's
/// expiry as an IMF-fixdate, on every response to a keyed request that has a record.
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

/// The response header of a replay whose response was too large to store, so that only its status
/// and headers were kept ([`OversizeResponse::HeadersOnly`](crate::OversizeResponse::HeadersOnly)):
/// `Idempotency-Body-Omitted: true`, and an empty body.
pub const IDEMPOTENCY_BODY_OMITTED: HeaderName = HeaderName::from_static("idempotency-body-omitted");

/// The request header of RFC 7240 preferences; the layer honours `wait=N`.
pub const PREFER: HeaderName = HeaderName::from_static("prefer");

/// The response header that says which preferences were honoured (RFC 7240 section 3).
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// The request header of OASIS Repeatable Requests (and Azure's guidelines) that carries the key
/// on routes that accept it ([`KeySources::repeatability`](crate::KeySources::repeatability)).
pub const REPEATABILITY_REQUEST_ID: HeaderName = HeaderName::from_static("repeatability-request-id");

/// The request header that says when the client first sent the request (an HTTP-date), sent
/// with `Repeatability-Request-ID`.
pub const REPEATABILITY_FIRST_SENT: HeaderName = HeaderName::from_static("repeatability-first-sent");

/// The response header that answers a request keyed by `Repeatability-Request-ID`: `accepted`
/// (the request was executed or replayed) or `rejected` (the layer refused it).
pub const REPEATABILITY_RESULT: HeaderName = HeaderName::from_static("repeatability-result");
