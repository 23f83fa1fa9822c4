//! Idempotency keys for infrastructure APIs: the core.
//!
//! A client that loses a response cannot tell whether the server did the work. This crate holds
//! what makes a retry safe, with no I/O of its own: the parsed [`IdempotencyKey`], the record
//! [`Scope`] (principal, endpoint, key), the request [`Fingerprint`], the [`Record`] and its
//! state machine, the [`ResponsePolicy`] that says which responses are stored, the [`Store`]
//! trait with one method per transition, the [`MemoryStore`], [`derive`]d sub-keys for each
//! side effect, and the background [`Sweeper`].
//!
//! The HTTP layer is `idempotency-tower`; the SQLite and PostgreSQL stores are
//! `idempotency-sqlx`.
//!
//! ```
//! use std::time::Duration;
//! use idempotency::*;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let key = IdempotencyKey::parse_header(br#""7c3f5d1e-91a4-4b8c""#)?;
//! let scope = Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"), key);
//! let fingerprint = Fingerprinter::default().fingerprint(&RequestParts {
//!     method: "POST", path: "/v1/workers", query: "",
//!     content_type: b"application/json", body: br#"{"cpu":16}"#,
//! })?;
//! let t = now();
//! let req = ClaimRequest { scope, fingerprint: fingerprint.clone(), now: t, expires_at: t + chrono::Duration::hours(24) };
//!
//! // The first request owns the key and runs the handler...
//! let ClaimOutcome::Owned(claim) = store.claim(req.clone()).await? else { unreachable!() };
//! let alloc_id = claim.derive("alloc"); // the same on every retry of this record
//! let response = StoredResponse { status: 201, headers: vec![], body: StoredBody::encode("{}".into(), 1024) };
//! store.complete(&claim, &response, req.expires_at).await?;
//!
//! // ...and a retry gets the stored response back.
//! let ClaimOutcome::Existing(record) = store.claim(req).await? else { unreachable!() };
//! assert_eq!(record.decide(&fingerprint, now(), Duration::from_secs(300)), Decision::Replay(response));
//! assert_eq!(derive(&record, "alloc"), alloc_id);
//! # Ok(()) }
//! ```

mod derive;
mod fingerprint;
mod key;
mod memory;
mod policy;
mod record;
mod scope;
mod store;
mod sweeper;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod faulty;

pub use derive::{SubKey, derive};
pub use fingerprint::{DEFAULT_MAX_BODY, Fingerprint, FingerprintError, FingerprintMode, Fingerprinter, RequestParts};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use memory::MemoryStore;
pub use policy::{DEFAULT_TERMINAL_4XX, NEVER_STORED, ResponsePolicy};
pub use record::{
    BodyEncoding, Claim, ClaimOutcome, ClaimRequest, Decision, Record, RecordId, RecordState, StoredBody,
    StoredResponse, Timestamp, now, stale_after,
};
pub use scope::{Endpoint, Principal, Scope};
pub use store::{Store, StoreError};
pub use sweeper::{DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_PAUSE, Sweeper};
