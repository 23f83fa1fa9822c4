//! The names of the problems the idempotency layer answers with: the last segment of an RFC 9457
//! problem's `type` URI (`/problems/request-in-progress`).
//!
//! One vocabulary for both ends of the wire: the layer (`idempotency-tower`) sends these names,
//! and a client compares a problem's name against them. The values are part of the protocol;
//! they never change.
//!
//! ```
//! assert_eq!(idempotency::problems::IN_PROGRESS, "request-in-progress");
//! ```

/// `400`: a mutating request on a route whose policy is `required` carries no key.
pub const KEY_MISSING: &str = "idempotency-key-missing";

/// `400`: the key is empty, longer than 128 characters, not visible ASCII, sent more than once,
/// a bare key with a comma, or two key sources carry different keys.
pub const KEY_INVALID: &str = "idempotency-key-invalid";

/// `409` by default (configurable to `422` or `400`): the key was first used with a different
/// request (method, path, query, content type or body), in any state of its record.
pub const KEY_REUSED: &str = "idempotency-key-reused";

/// `409` with `Retry-After`: the first request with this key is still running (its claim is not
/// stale yet); a retry with the same key later gets its answer.
pub const IN_PROGRESS: &str = "request-in-progress";

/// `503` with `Retry-After`: the record store did not answer, so the request was not processed;
/// the same name on every route.
pub const STORE_UNAVAILABLE: &str = "store-unavailable";

/// `429` with `Retry-After`: the principal holds as many records as it may, or is over its rate
/// of mutating requests; nothing was stored.
pub const TOO_MANY_REQUESTS: &str = "too-many-requests";

/// `410`: the request with this key ran, but its response was larger than the layer keeps for
/// replay, so it cannot be replayed (and does not run again).
pub const RESPONSE_TOO_LARGE: &str = "response-too-large";

/// `412`: `Repeatability-First-Sent` is older than the retention, so the request may have run
/// already and its record be gone; it is not run.
pub const REPEATABILITY_EXPIRED: &str = "repeatability-expired";

/// `413`: the request body exceeds the limit the layer reads (and fingerprints) a body up to.
pub const BODY_TOO_LARGE: &str = "body-too-large";

/// `400`: the request body broke off before its end; nothing was stored.
pub const BODY_UNREADABLE: &str = "body-unreadable";

/// `408`: the request body did not arrive in time; nothing was stored.
pub const BODY_TIMEOUT: &str = "body-timeout";

/// `401`: the request carries no principal to scope its key to (the layer never falls back to a
/// shared anonymous scope unless told to).
pub const PRINCIPAL_MISSING: &str = "principal-missing";

/// `500`: the handler panicked; nothing was stored, so a retry with the same key runs it again.
pub const HANDLER_PANICKED: &str = "handler-panicked";

/// `500`: the handler's response body failed while it was read; nothing was stored.
pub const RESPONSE_BODY_FAILED: &str = "response-body-failed";

/// `500`: the response stored under this key cannot be read back to replay it.
pub const STORED_RESPONSE_CORRUPT: &str = "stored-response-corrupt";

/// `500`: an unexpected failure that is no fault of the request (such as a handler that reads
/// the idempotency context on a route without the layer); nothing was stored.
pub const INTERNAL: &str = "internal";

/// `409` (a retry of it, held), `504` (the attempt that lost its answer) or `503` with
/// `Retry-After` (a probe could not tell): the request was sent on and nobody knows whether it
/// acted, so it is not run again on a guess; the `detail` names the record id an operator
/// resolves.
pub const OUTCOME_UNCERTAIN: &str = "outcome-uncertain";
