//! A record's creation identity, apart from the record so that sub-key derivation needs only the
//! scope and this id.

use std::fmt;

use rand::RngCore;

/// A record's creation identity: random, minted once when the record is created, kept across
/// re-claims, new when an expired key is used again. Sub-keys derive from it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecordId([u8; 16]);

impl RecordId {
    /// A fresh random id.
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        rand::rng().fill_bytes(&mut b);
        Self(b)
    }

    /// The id from its 16 raw bytes (as a store keeps it in a binary column).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The id as 32 lowercase hex digits (its stored form).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the stored form.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut b = [0u8; 16];
        hex::decode_to_slice(s, &mut b).ok()?;
        Some(Self(b))
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", self.to_hex())
    }
}
