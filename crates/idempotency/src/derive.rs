//! Sub-keys: one stable id per side effect of a request.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::Record;

/// A stable identifier for one side effect of one record, such as a node allocation or a VM boot.
///
/// It is the same on every retry of the record, in every process and every version of this
/// crate, and differs between principals, endpoints, keys and records (a key used again after its
/// record expired gets a new record and so new sub-keys). Shown as `sk-` and 32 hex digits.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubKey(String);

impl SubKey {
    /// The sub-key as a string (`sk-<32 hex>`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SubKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SubKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SubKey({})", self.0)
    }
}

/// Derives the sub-key for the side effect `label` of `record`.
///
/// SHA-256 over a version tag and the length-prefixed principal, endpoint, key, record id and
/// label, truncated to 128 bits. The record id is minted when the record is created, so the
/// derivation covers the record's whole identity.
///
/// ```
/// # use idempotency::*;
/// let scope = Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"),
///                        IdempotencyKey::try_from("k1").unwrap());
/// let t = now();
/// let req = ClaimRequest { scope, fingerprint: Fingerprint::from_stored("sha256:00"), now: t, expires_at: t };
/// let record = req.new_record();
/// assert_eq!(derive(&record, "alloc"), derive(&record.clone(), "alloc"));
/// assert_ne!(derive(&record, "alloc"), derive(&record, "lease"));
/// ```
pub fn derive(record: &Record, label: &str) -> SubKey {
    let mut h = Sha256::new();
    for field in [
        b"idempotency/derive/v1".as_slice(),
        record.scope.principal.as_str().as_bytes(),
        record.scope.endpoint.as_str().as_bytes(),
        record.scope.key.as_str().as_bytes(),
        record.record_id.as_bytes(),
        label.as_bytes(),
    ] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    let digest = h.finalize();
    SubKey(format!("sk-{}", hex::encode(&digest[..16])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RecordId, Scope, now};

    fn record(principal: &str, endpoint: &str, key: &str, id: RecordId) -> Record {
        let t = now();
        let mut r = ClaimRequest {
            scope: Scope::new(
                Principal::new(principal),
                Endpoint::new("POST", endpoint),
                IdempotencyKey::try_from(key).unwrap(),
            ),
            fingerprint: Fingerprint::from_stored("sha256:00"),
            now: t,
            expires_at: t,
        }
        .new_record();
        r.record_id = id;
        r
    }

    #[test]
    fn stable_across_versions() {
        // A fixed vector: if this changes, every in-flight operation in the field would lose
        // track of its side effects. Never change it.
        let id = RecordId::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        let r = record("team-a", "/v1/workers", "k1", id);
        assert_eq!(derive(&r, "alloc").as_str(), FIXED_VECTOR);
    }

    const FIXED_VECTOR: &str = "sk-e74cfa33dbf23f045c1411e0d687144f";

    #[test]
    fn differs_across_every_part_of_the_identity() {
        let id = RecordId::random();
        let base = derive(&record("a", "/x", "k", id), "alloc");
        assert_ne!(base, derive(&record("b", "/x", "k", id), "alloc"));
        assert_ne!(base, derive(&record("a", "/y", "k", id), "alloc"));
        assert_ne!(base, derive(&record("a", "/x", "k2", id), "alloc"));
        assert_ne!(base, derive(&record("a", "/x", "k", RecordId::random()), "alloc"));
        assert_ne!(base, derive(&record("a", "/x", "k", id), "lease"));
    }
}
