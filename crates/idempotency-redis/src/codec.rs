//! How a record maps to a Redis key and hash fields, and back.

use std::collections::HashMap;

use chrono::DateTime;
use idempotency::{
    BodyEncoding, Endpoint, Fingerprint, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, StoreError,
    StoredBody, StoredResponse, Timestamp,
};
use redis::Value;
use sha2::{Digest, Sha256};

/// The record's key: the prefix and the hex SHA-256 of the length-prefixed principal, endpoint
/// and key. A digest, not the raw parts, so that keys have a bounded length and no part a
/// client chose can contain a `{...}` hash tag that pins records to one cluster slot.
pub(crate) fn record_key(prefix: &str, scope: &Scope) -> String {
    let mut h = Sha256::new();
    for part in [scope.principal.as_str(), scope.endpoint.as_str(), scope.key.as_str()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    format!("{prefix}{}", hex::encode(h.finalize()))
}

/// The sign bit: flipping it maps `i64` order onto `u64` order.
const SIGN: u64 = 1 << 63;

/// A timestamp as stored: its microseconds since the epoch as 20 digits that sort in time order
/// (the `i64` with its sign bit flipped, zero-padded), so the scripts can compare timestamps as
/// strings, exactly, over the whole range.
pub(crate) fn encode_ts(t: Timestamp) -> String {
    format!("{:020}", t.timestamp_micros().cast_unsigned() ^ SIGN)
}

/// Parses [`encode_ts`]'s form.
pub(crate) fn decode_ts(s: &[u8]) -> Option<Timestamp> {
    if s.len() != 20 {
        return None;
    }
    let v: u64 = std::str::from_utf8(s).ok()?.parse().ok()?;
    DateTime::from_timestamp_micros((v ^ SIGN).cast_signed())
}

/// The first whole millisecond at or after `t`, for `PEXPIREAT`: the key lives at least until
/// `t`, never a moment less than the record.
pub(crate) fn expiry_millis(t: Timestamp) -> i64 {
    let us = t.timestamp_micros();
    us.div_euclid(1000) + i64::from(us.rem_euclid(1000) != 0)
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// The hash a script returned (`HGETALL`: a flat array of field, value; or a map under RESP3)
/// as fields. `None` when it is empty (no record).
pub(crate) fn hash_fields(v: Value) -> Result<Option<HashMap<String, Vec<u8>>>, StoreError> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Nil => return Ok(None),
        Value::Array(items) => {
            if items.len() % 2 != 0 {
                return Err(corrupt("a hash reply with an odd number of items"));
            }
            let mut it = items.into_iter();
            let mut pairs = Vec::new();
            while let (Some(f), Some(v)) = (it.next(), it.next()) {
                pairs.push((f, v));
            }
            pairs
        }
        Value::Map(pairs) => pairs,
        other => return Err(corrupt(format!("unexpected reply {other:?}"))),
    };
    if pairs.is_empty() {
        return Ok(None);
    }
    let mut fields = HashMap::with_capacity(pairs.len());
    for (f, v) in pairs {
        match (f, v) {
            (Value::BulkString(f), Value::BulkString(v)) => {
                let f = String::from_utf8(f).map_err(|_| corrupt("a field name that is not UTF-8"))?;
                fields.insert(f, v);
            }
            _ => return Err(corrupt("a hash reply item that is not a string")),
        }
    }
    Ok(Some(fields))
}

/// Validates a record's fields into a [`Record`]; anything unexpected is
/// [`StoreError::Corrupt`].
pub(crate) fn decode_record(mut f: HashMap<String, Vec<u8>>) -> Result<Record, StoreError> {
    let mut text = |name: &str| -> Result<String, StoreError> {
        let v = f.remove(name).ok_or_else(|| corrupt(format!("field {name} is missing")))?;
        String::from_utf8(v).map_err(|_| corrupt(format!("field {name} is not UTF-8")))
    };
    let principal = text("p")?;
    let endpoint = text("e")?;
    let key = text("k")?;
    let record_id = text("rid")?;
    let fingerprint = text("fp")?;
    let state = text("st")?;
    let generation = text("gen")?;
    let ts = |name: &str, v: String| decode_ts(v.as_bytes()).ok_or_else(|| corrupt(format!("{name} {v:?}")));
    let created_at = ts("created_at", text("cat")?)?;
    let started_at = ts("started_at", text("sat")?)?;
    let expires_at = ts("expires_at", text("eat")?)?;

    let key = IdempotencyKey::try_from(key.as_str()).map_err(|e| corrupt(format!("stored key: {e}")))?;
    let record_id = RecordId::from_hex(&record_id).ok_or_else(|| corrupt(format!("record id {record_id:?}")))?;
    let state = RecordState::from_stored(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?;
    let generation: i64 = generation.parse().map_err(|_| corrupt(format!("generation {generation:?}")))?;
    let response = match (f.remove("rs"), f.remove("rh"), f.remove("rb"), f.remove("re")) {
        (None, None, None, None) => None,
        (Some(status), Some(headers), Some(body), Some(encoding)) => {
            let status = std::str::from_utf8(&status)
                .ok()
                .and_then(|s| s.parse::<u16>().ok())
                .ok_or_else(|| corrupt("response status"))?;
            let headers =
                std::str::from_utf8(&headers).map_err(|_| corrupt("response headers are not UTF-8")).and_then(|h| {
                    StoredResponse::headers_from_json(h).map_err(|e| corrupt(format!("response headers: {e}")))
                })?;
            let encoding = std::str::from_utf8(&encoding)
                .ok()
                .and_then(BodyEncoding::from_stored)
                .ok_or_else(|| corrupt("unknown body encoding"))?;
            Some(StoredResponse { status, headers, body: StoredBody::from_stored(encoding, body) })
        }
        _ => return Err(corrupt("a response stored in part")),
    };
    state.check_response(response.as_ref()).map_err(corrupt)?;
    Ok(Record {
        scope: Scope::new(Principal::new(principal), Endpoint::from_stored(endpoint), key),
        record_id,
        fingerprint: Fingerprint::from_stored(fingerprint),
        state,
        generation,
        response,
        created_at,
        started_at,
        expires_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_sort_as_strings_and_round_trip() {
        let times = [
            DateTime::<chrono::Utc>::MIN_UTC,
            DateTime::from_timestamp_micros(-1).unwrap(),
            DateTime::from_timestamp_micros(0).unwrap(),
            DateTime::from_timestamp_micros(1).unwrap(),
            idempotency::now(),
            DateTime::<chrono::Utc>::MAX_UTC,
        ];
        let encoded: Vec<String> = times.iter().map(|t| encode_ts(*t)).collect();
        for w in encoded.windows(2) {
            assert!(w[0] < w[1], "{} !< {}", w[0], w[1]);
            assert_eq!(w[0].len(), 20);
        }
        for (t, e) in times.iter().zip(&encoded) {
            // MIN/MAX carry nanoseconds; what is stored is their microsecond.
            assert_eq!(decode_ts(e.as_bytes()).unwrap().timestamp_micros(), t.timestamp_micros());
        }
        assert_eq!(decode_ts(b"123"), None);
        assert_eq!(decode_ts(b"9999999999999999999x"), None);
    }

    #[test]
    fn expiry_rounds_up_to_the_millisecond() {
        let t = |us| DateTime::from_timestamp_micros(us).unwrap();
        assert_eq!(expiry_millis(t(5_000)), 5);
        assert_eq!(expiry_millis(t(5_001)), 6);
        assert_eq!(expiry_millis(t(-1)), 0);
        assert_eq!(expiry_millis(t(-1_000)), -1);
    }

    #[test]
    fn keys_separate_the_parts() {
        let s = |p: &str, e: &str| {
            Scope::new(Principal::new(p), Endpoint::new("POST", e), IdempotencyKey::try_from("k").unwrap())
        };
        let a = record_key("idem:", &s("ab", "/c"));
        let b = record_key("idem:", &s("a", "b/c"));
        assert_ne!(a, b);
        assert!(a.starts_with("idem:") && a.len() == 5 + 64);
        assert_eq!(a, record_key("idem:", &s("ab", "/c")));
    }
}
