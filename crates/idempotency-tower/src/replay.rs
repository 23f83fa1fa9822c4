//! Stored responses: which headers are kept, and replaying a record's response byte for byte.

use axum::body::Body;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use idempotency::StoredResponse;

use crate::config::{Config, never_replayed};
use crate::headers::IDEMPOTENT_REPLAYED;
use crate::metrics::count;
use crate::problem::{Rejection, rejection_response};

/// The least a replay may inflate a stored body to, whatever `max_stored_response` says: room
/// for the `410 response-too-large` problem stored in place of a larger response.
const MIN_REPLAY_LIMIT: usize = 64 * 1024;

/// The allowlisted headers, in order, repeated values kept. Values are stored one char per byte
/// (Latin-1), so any header value, even one with obs-text, round-trips byte for byte.
pub(crate) fn replayable_headers(cfg: &Config, headers: &http::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !never_replayed(name) && cfg.replay_headers.contains(name))
        .map(|(name, value)| (name.as_str().to_owned(), stored_value(value)))
        .collect()
}

/// A header value one char per byte. ASCII (nearly every value) is the same text either way,
/// and is copied as is.
fn stored_value(value: &HeaderValue) -> String {
    match std::str::from_utf8(value.as_bytes()) {
        Ok(ascii) if ascii.is_ascii() => ascii.to_owned(),
        _ => value.as_bytes().iter().map(|&b| char::from(b)).collect(),
    }
}

fn header_from_stored(name: &str, value: &str) -> Option<(HeaderName, HeaderValue)> {
    let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
    let value = if value.is_ascii() {
        HeaderValue::from_str(value).ok()?
    } else {
        let bytes: Option<Vec<u8>> = value.chars().map(|c| u8::try_from(c).ok()).collect();
        HeaderValue::from_bytes(&bytes?).ok()?
    };
    Some((name, value))
}

/// Replays a stored response: status, headers and body as stored, plus `Idempotent-Replayed`.
pub(crate) fn replay(cfg: &Config, stored: &StoredResponse) -> Response<Body> {
    let rebuilt = (|| {
        let status = StatusCode::from_u16(stored.status).map_err(|e| e.to_string())?;
        // Bounded, so a forged or corrupt stored body cannot inflate without limit; never below the
        // short problem the layer stores in place of a response too large to keep.
        let limit = cfg.max_stored_response.max(MIN_REPLAY_LIMIT);
        let body = stored.body.decode_at_most(limit).map_err(|e| e.to_string())?;
        let mut res = Response::new(Body::from(body));
        *res.status_mut() = status;
        for (name, value) in &stored.headers {
            let (name, value) =
                header_from_stored(name, value).ok_or_else(|| format!("stored header {name:?} is not valid"))?;
            res.headers_mut().append(name, value);
        }
        res.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        Ok::<_, String>(res)
    })();
    match rebuilt {
        Ok(res) => {
            count("replayed");
            crate::metrics::record_outcome("replayed", stored.status);
            tracing::debug!(status = stored.status, "stored response replayed");
            let mut res = res;
            res.extensions_mut().insert(crate::metrics::Outcome("replayed"));
            res
        }
        Err(e) => {
            tracing::error!(error = %e, "stored response cannot be replayed");
            rejection_response(cfg, Rejection::StoredResponseCorrupt)
        }
    }
}
