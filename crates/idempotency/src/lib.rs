#![doc = include_str!("../README.md")]
//!
//! # Where things are
//!
//! The parsed [`IdempotencyKey`]; the record [`Scope`] ([`Principal`], [`Endpoint`], key); the
//! request [`Fingerprint`] made by a [`Fingerprinter`]; the [`Record`], its [`RecordState`] and
//! the [`Decision`] a retry gets; the [`ResponsePolicy`]; the [`Store`] trait and the
//! [`MemoryStore`]; [`derive`](fn@derive)d sub-keys for each side effect; the background
//! [`Sweeper`]; the names of the RFC 9457 [`problems`] the layer answers with. With feature
//! `conformance`, the store conformance suite (`conformance`) and a store that fails on demand
//! (`faulty`).

mod admin;
mod cache;
mod canonical_json;
mod changes;
mod derive;
mod fingerprint;
mod key;
mod memory;
mod policy;
pub mod problems;
mod record;
mod record_id;
mod scope;
mod store;
mod sweeper;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod faulty;

pub use admin::{Forget, MAX_PAGE, RecordPage, RecordQuery, Resolve};
pub use cache::{DEFAULT_REPLAY_CACHE_BYTES, REPLAY_CACHE_HITS_TOTAL, ReplayCache};
pub use changes::{Change, ChangeObserver, ChangeSubscription, RecordChanges, change_tag};
pub use derive::{SubKey, derive};
pub use fingerprint::{DEFAULT_MAX_BODY, Fingerprint, FingerprintError, FingerprintMode, Fingerprinter, RequestParts};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use memory::MemoryStore;
pub use policy::{DEFAULT_TERMINAL_4XX, NEVER_STORED, ResponsePolicy};
pub use record::{
    BodyEncoding, Claim, ClaimOutcome, ClaimRequest, Decision, ReclaimRequest, Record, RecordState, Renewal,
    StoredBody, StoredResponse, Timestamp, later, now, stale_after,
};
pub use record_id::RecordId;
pub use scope::{Endpoint, Principal, STORED_AS_IS_MAX, STORED_COMPONENT_MAX, Scope, normalize_path, stored_component};
pub use store::{ErrorChain, NotAcknowledged, Store, StoreError};
pub use sweeper::{DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_PAUSE, Sweeper};
