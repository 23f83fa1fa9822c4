//! The names of leasebroker's own problems: the last segment of an RFC 9457 problem's `type`
//! URI (`/problems/capacity-exhausted`), shared by the service that sends them and the client
//! that tells them apart. The idempotency protocol's names (`request-in-progress`,
//! `store-unavailable`, ...) are in `idempotency::problems`. The values never change.
//!
//! ```
//! assert_eq!(leasebroker_api::problems::OPERATION_CONFLICT, "operation-conflict");
//! ```

/// `401` with `WWW-Authenticate: Bearer`: no bearer token, or one the service does not know.
pub const UNAUTHORIZED: &str = "unauthorized";

/// `422`: the body parsed but a field is out of bounds or of the wrong type.
pub const VALIDATION_FAILED: &str = "validation-failed";

/// `400`: the body is not JSON.
pub const MALFORMED_JSON: &str = "malformed-json";

/// `415`: the body is not sent as `application/json`.
pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported-media-type";

/// `400`: a query parameter is not valid (a `limit` out of range, a cursor the service did not
/// give out).
pub const INVALID_QUERY: &str = "invalid-query";

/// `404`: no such route, worker, node, operation or record (for this principal).
pub const NOT_FOUND: &str = "not-found";

/// `405`: the route does not take this method.
pub const METHOD_NOT_ALLOWED: &str = "method-not-allowed";

/// `414`: the request path is too long; nothing was processed.
pub const URI_TOO_LONG: &str = "uri-too-long";

/// `431`: the request's header fields are too many or too large; nothing was processed.
pub const HEADERS_TOO_LARGE: &str = "headers-too-large";

/// `400`: a percent-escape in the request path is malformed or does not decode to UTF-8;
/// nothing was processed.
pub const INVALID_PATH: &str = "invalid-path";

/// `503` with `Retry-After`: no free node can take the worker.
pub const CAPACITY_EXHAUSTED: &str = "capacity-exhausted";

/// `403`: the principal holds as many workers as `--max-workers-per-principal` allows; nothing
/// was taken.
pub const QUOTA_EXCEEDED: &str = "quota-exceeded";

/// `503` with `Retry-After` (the hypervisor could not complete the call) or `502` (it refused
/// the call).
pub const UPSTREAM_UNAVAILABLE: &str = "upstream-unavailable";

/// `410`: a retried create whose worker was deleted since; a retry never brings it back.
pub const WORKER_DELETED: &str = "worker-deleted";

/// `409`: a flash of a node that a worker holds, without `"force": true`.
pub const NODE_IN_USE: &str = "node-in-use";

/// `409`, never retried: another operation already runs on the node, or ended `uncertain` there
/// (until an operator resolves it); the problem's extension member `operation_id` names it (and
/// `Link` points at it).
pub const OPERATION_CONFLICT: &str = "operation-conflict";

/// `409`, never retried: a resolve of an operation that is not `uncertain` (it runs, or it ended
/// already); the problem's extension member `operation_id` names it.
pub const OPERATION_NOT_UNCERTAIN: &str = "operation-not-uncertain";

/// `409`: an admin asked to forget a record whose request is still running.
pub const RECORD_IN_FLIGHT: &str = "record-in-flight";
