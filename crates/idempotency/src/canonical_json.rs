//! Canonical JSON for the fingerprint: object members sorted by name, no insignificant
//! whitespace, only values that JSON text and this form map one to one.
//!
//! The body is read into a tree of our own rather than `serde_json::Value`: with serde_json's
//! `raw_value` feature on (axum turns it on, so every service with the layer has it), `Value`
//! reads an object whose first member is named `$serde_json::private::RawValue` as the JSON
//! text quoted in that member's value, which would make `{"$serde_json::private::RawValue":
//! "{\"a\":1}"}` and `{"a":1}` one value. Here every member is a member. The bytes written are
//! those `serde_json::to_vec` wrote for the same `Value`, so fingerprints stored before stay
//! valid.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// The canonical form of `body`, or `None` when it is not JSON or holds a number that is not a
/// 64-bit integer (parsed into an `f64`, which cannot keep every decimal text apart:
/// `18446744073709551616` and `...617` would become one value).
pub(crate) fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let value: Json = serde_json::from_slice(body).ok()?;
    serde_json::to_vec(&value).ok()
}

/// A JSON value with exact numbers only.
enum Json {
    Null,
    Bool(bool),
    Unsigned(u64),
    Negative(i64),
    String(String),
    Array(Vec<Json>),
    /// Members by name; a repeated name keeps its last value, as `serde_json::Value` does.
    Object(BTreeMap<String, Json>),
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::Unsigned(n))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        // serde_json reads every non-negative integer as u64; keep one form per number anyway.
        Ok(u64::try_from(n).map_or(Json::Negative(n), Json::Unsigned))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Json, E> {
        Err(E::custom("not an exact number"))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = BTreeMap::new();
        while let Some((name, value)) = map.next_entry::<String, Json>()? {
            members.insert(name, value);
        }
        Ok(Json::Object(members))
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Unsigned(n) => s.serialize_u64(*n),
            Json::Negative(n) => s.serialize_i64(*n),
            Json::String(text) => s.serialize_str(text),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(members) => {
                let mut map = s.serialize_map(Some(members.len()))?;
                for (name, value) in members {
                    map.serialize_entry(name, value)?;
                }
                map.end()
            }
        }
    }
}
