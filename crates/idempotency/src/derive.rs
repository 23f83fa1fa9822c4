//! Sub-keys: one stable id per side effect of a request.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::{RecordId, Scope};

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

/// Derives the sub-key for the side effect `label` of the record with `scope` and `record_id`.
///
/// SHA-256 over a version tag and the length-prefixed principal, endpoint, key, record id and
/// label, truncated to 128 bits. The record id is minted when the record is created, so the
/// derivation covers the record's whole identity. [`Record::derive`](crate::Record::derive) and
/// [`Claim::derive`](crate::Claim::derive) call it with their record's.
///
/// ```
/// # use idempotency::*;
/// let scope = Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"),
///                        IdempotencyKey::try_from("k1").unwrap());
/// let t = now();
/// let ttl = std::time::Duration::from_secs(300);
/// let req = ClaimRequest {
///     scope, fingerprint: Fingerprint::from_stored("sha256:00"), now: t, in_flight_ttl: ttl, expires_at: t,
/// };
/// let record = req.new_record();
/// assert_eq!(derive(&record.scope, &record.record_id, "alloc"), record.clone().derive("alloc"));
/// assert_ne!(record.derive("alloc"), record.derive("lease"));
/// ```
pub fn derive(scope: &Scope, record_id: &RecordId, label: &str) -> SubKey {
    let mut h = Sha256::new();
    for field in [
        b"idempotency/derive/v1".as_slice(),
        scope.principal.as_str().as_bytes(),
        scope.endpoint.as_str().as_bytes(),
        scope.key.as_str().as_bytes(),
        record_id.as_bytes(),
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
    use crate::{Endpoint, IdempotencyKey, Principal};

    fn sub(principal: &str, endpoint: &str, key: &str, id: RecordId, label: &str) -> SubKey {
        let scope = Scope::new(
            Principal::new(principal),
            Endpoint::new("POST", endpoint),
            IdempotencyKey::try_from(key).unwrap(),
        );
        derive(&scope, &id, label)
    }

    #[test]
    fn stable_across_versions() {
        // A fixed vector: if this changes, every in-flight operation in the field would lose
        // track of its side effects. Never change it.
        let id = RecordId::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        assert_eq!(sub("team-a", "/v1/workers", "k1", id, "alloc").as_str(), FIXED_VECTOR);
    }

    const FIXED_VECTOR: &str = "sk-e74cfa33dbf23f045c1411e0d687144f";

    #[test]
    fn differs_across_every_part_of_the_identity() {
        let id = RecordId::random();
        let base = sub("a", "/x", "k", id, "alloc");
        assert_ne!(base, sub("b", "/x", "k", id, "alloc"));
        assert_ne!(base, sub("a", "/y", "k", id, "alloc"));
        assert_ne!(base, sub("a", "/x", "k2", id, "alloc"));
        assert_ne!(base, sub("a", "/x", "k", RecordId::random(), "alloc"));
        assert_ne!(base, sub("a", "/x", "k", id, "lease"));
    }
}
