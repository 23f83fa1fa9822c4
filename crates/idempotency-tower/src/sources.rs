//! Where a route's key may come from besides `Idempotency-Key` (docs/protocol.md#records, "Other key sources"):
//! the `Repeatability-Request-ID` header of OASIS Repeatable Requests, and a field of a JSON body
//! (AIP-155's `request_id`). Each names the same record, in the same scope, as `Idempotency-Key`
//! with the same value.

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use http::request::Parts;
use http::{HeaderValue, Response};
use idempotency::{IdempotencyKey, KeyError};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::config::KeySources;
use crate::headers::{IDEMPOTENCY_KEY, REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID, REPEATABILITY_RESULT};
use crate::problem::Rejection;

/// The key the headers carry, and whether it came (also) from `Repeatability-Request-ID`, whose
/// answers then say `Repeatability-Result`.
pub(crate) struct HeaderKey {
    pub(crate) key: Option<IdempotencyKey>,
    pub(crate) repeatable: bool,
}

/// The key of the request's headers, from `Idempotency-Key` and, where the route takes it,
/// `Repeatability-Request-ID` (checked against `Repeatability-First-Sent` and `retention`).
/// The error carries whether the answer must say `Repeatability-Result: rejected`.
pub(crate) fn header_key(
    parts: &Parts,
    sources: &KeySources,
    retention: Duration,
) -> Result<HeaderKey, (Rejection, bool)> {
    if !sources.repeatability {
        let key = single(parts, IDEMPOTENCY_KEY).map_err(|e| (Rejection::InvalidKey(e), false))?;
        return Ok(HeaderKey { key, repeatable: false });
    }
    let request_id = single(parts, REPEATABILITY_REQUEST_ID);
    let repeatable = !matches!(request_id, Ok(None));
    let key = single(parts, IDEMPOTENCY_KEY).map_err(|e| (Rejection::InvalidKey(e), repeatable))?;
    let invalid = |detail: String| (Rejection::InvalidKeySource(detail), true);
    let request_id = match request_id {
        Ok(None) => return Ok(HeaderKey { key, repeatable }),
        Ok(Some(id)) => id,
        Err(KeyError::Repeated) => {
            return Err(invalid("the Repeatability-Request-ID header was sent more than once".into()));
        }
        Err(e) => return Err(invalid(format!("Repeatability-Request-ID: {e}"))),
    };
    let first_sent = parts.headers.get_all(REPEATABILITY_FIRST_SENT);
    let mut first_sent = first_sent.iter();
    let sent = match (first_sent.next(), first_sent.next()) {
        (Some(v), None) => v,
        (None, _) => {
            return Err(invalid("Repeatability-Request-ID needs Repeatability-First-Sent, an HTTP-date".into()));
        }
        (Some(_), Some(_)) => {
            return Err(invalid("the Repeatability-First-Sent header was sent more than once".into()));
        }
    };
    let sent = sent
        .to_str()
        .ok()
        .and_then(|s| httpdate::parse_http_date(s.trim()).ok())
        .ok_or_else(|| invalid("Repeatability-First-Sent is not an HTTP-date (IMF-fixdate)".into()))?;
    // A first sending in the future (the client's clock is ahead) is within the window.
    let age = SystemTime::now().duration_since(sent).unwrap_or_default();
    if age > retention {
        return Err((Rejection::RepeatabilityExpired { age, retention }, true));
    }
    let key = agree(key, Some(request_id), "Idempotency-Key", "Repeatability-Request-ID").map_err(|r| (r, true))?;
    Ok(HeaderKey { key, repeatable })
}

/// The one value of header `name` as a key: `None` when absent, an error when sent twice or
/// invalid.
fn single(parts: &Parts, name: http::HeaderName) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = parts.headers.get_all(name).iter();
    let Some(first) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse_header(first.as_bytes()).map(Some)
}

/// One key from two sources: either alone, or both when equal; two different keys are refused.
pub(crate) fn agree(
    a: Option<IdempotencyKey>,
    b: Option<IdempotencyKey>,
    a_name: &str,
    b_name: &str,
) -> Result<Option<IdempotencyKey>, Rejection> {
    match (a, b) {
        (Some(a), Some(b)) if a != b => Err(Rejection::InvalidKeySource(format!(
            "the request carries two different keys, one in {a_name} and one in {b_name}; send one key"
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

/// The key in the top-level field `field` of a JSON object body: `Ok(None)` when the body is not
/// a JSON object (the handler judges that), or has no such field, or it is `null`.
pub(crate) fn body_key(body: &[u8], field: &str) -> Result<Option<IdempotencyKey>, Rejection> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = match (FieldSeed { field }).deserialize(&mut de) {
        Ok(found) => found,
        // Not JSON, or not an object: no key here.
        Err(_) => return Ok(None),
    };
    match found {
        Found::Absent => Ok(None),
        Found::Key(value) => IdempotencyKey::try_from(value.as_str())
            .map(Some)
            .map_err(|e| Rejection::InvalidKeySource(format!("body field {field:?}: {e}"))),
        Found::NotAString => {
            Err(Rejection::InvalidKeySource(format!("body field {field:?} must be a string (the request's key)")))
        }
        Found::Twice => Err(Rejection::InvalidKeySource(format!("body field {field:?} appears more than once"))),
    }
}

enum Found {
    Absent,
    Key(String),
    NotAString,
    Twice,
}

/// Reads one field of a JSON object, skipping every other value without building it.
struct FieldSeed<'f> {
    field: &'f str,
}

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = Found;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let mut found = Found::Absent;
        while let Some(name) = map.next_key::<Cow<'de, str>>()? {
            if name != self.field {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let value = match map.next_value::<serde_json::Value>()? {
                serde_json::Value::Null => Found::Absent,
                serde_json::Value::String(s) => Found::Key(s),
                _ => Found::NotAString,
            };
            found = match (found, value) {
                (Found::Absent, v) => v,
                (Found::Key(a), Found::Key(b)) if a == b => Found::Key(a),
                (prev, Found::Absent) => prev,
                _ => Found::Twice,
            };
        }
        Ok(found)
    }
}

/// Adds `Repeatability-Result` to the answer of a request keyed by `Repeatability-Request-ID`:
/// `accepted` when the handler ran or its response was replayed, `rejected` when the layer
/// answered itself.
pub(crate) fn with_result(mut res: Response<Body>) -> Response<Body> {
    let accepted = res
        .extensions()
        .get::<crate::metrics::Outcome>()
        .is_some_and(|o| matches!(o.0, "executed" | "stale_reclaimed" | "replayed"));
    let value = if accepted { "accepted" } else { "rejected" };
    res.headers_mut().insert(REPEATABILITY_RESULT, HeaderValue::from_static(value));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> Result<Option<String>, String> {
        body_key(body.as_bytes(), "request_id").map(|k| k.map(|k| k.as_str().to_owned())).map_err(|r| format!("{r:?}"))
    }

    #[test]
    fn the_field_is_found_among_others_at_the_top_level_only() {
        assert_eq!(key(r#"{"a":{"request_id":"inner"},"request_id":"k-1","b":[1,2]}"#), Ok(Some("k-1".into())));
        assert_eq!(key(r#"{"a":1}"#), Ok(None));
        assert_eq!(key(r#"{"request_id":null}"#), Ok(None));
        assert_eq!(key(r#"[1,2]"#), Ok(None));
        assert_eq!(key("not json"), Ok(None));
        assert_eq!(key(r#"{"request\u005fid":"escaped"}"#), Ok(Some("escaped".into())));
    }

    #[test]
    fn anything_but_a_valid_key_string_is_refused() {
        for body in [
            r#"{"request_id":7}"#,
            r#"{"request_id":""}"#,
            r#"{"request_id":"a b"}"#,
            r#"{"request_id":"a","request_id":"b"}"#,
        ] {
            assert!(key(body).is_err(), "{body}");
        }
        assert_eq!(key(r#"{"request_id":"a","request_id":"a"}"#), Ok(Some("a".into())));
    }
}
