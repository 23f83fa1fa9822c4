//! What the service refuses of a request's head before anything else reads it, as RFC 9457
//! problems (issue 45): too many or too large header fields (`431 headers-too-large`), and a
//! path whose percent-escapes are malformed or do not decode to UTF-8 (`400 invalid-path`).
//!
//! hyper answers what it cannot parse itself, before any service runs, with a bare status and
//! no body: its header limits are set above the service's ([`HYPER_MAX_HEADERS`],
//! [`HYPER_H2_MAX_HEADER_LIST`]; HTTP/1's buffer stays at hyper's ~400 KB), so a request between
//! the two gets the service's problem, and only one beyond hyper's gets hyper's bare `431`. A
//! request line hyper cannot parse (a bad method, version or URI) gets its bare `400`; that
//! cannot be changed from outside hyper.

use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotency_tower::Problem;
use leasebroker_api::problems;

/// The most header fields a request may carry (`431` beyond): hyper's own default.
pub const MAX_HEADER_FIELDS: usize = 100;
/// The most bytes a request's header fields may take, names, values and line ends counted
/// (`431` beyond).
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// hyper's HTTP/1 field limit, above [`MAX_HEADER_FIELDS`] so the service answers in between.
pub const HYPER_MAX_HEADERS: usize = 256;
/// hyper's HTTP/2 header list limit (names, values and 32 bytes a field), above
/// [`MAX_HEADER_BYTES`] for the same reason (hyper's default is 16 KiB).
pub const HYPER_H2_MAX_HEADER_LIST: u32 = 128 * 1024;

/// `431 headers-too-large` or `400 invalid-path` for a request the service does not read; else
/// the request goes on. Runs right after the path's length check, before authentication, rate
/// limits or the idempotency layer: nothing is counted or stored.
pub async fn check_head(req: Request, next: Next) -> Response {
    if let Some(detail) = oversized(req.headers()) {
        return Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            problems::HEADERS_TOO_LARGE,
            "Header fields too large",
            detail,
        )
        .into_response();
    }
    if !escapes_decode(req.uri().path()) {
        return Problem::new(
            StatusCode::BAD_REQUEST,
            problems::INVALID_PATH,
            "Invalid path",
            "a percent-escape in the path is not % and two hex digits, or does not decode to UTF-8; nothing was \
             processed",
        )
        .into_response();
    }
    next.run(req).await
}

/// Why `headers` are over the limits, if they are.
fn oversized(headers: &HeaderMap) -> Option<String> {
    let fields = headers.len();
    if fields > MAX_HEADER_FIELDS {
        return Some(format!("{fields} header fields; at most {MAX_HEADER_FIELDS} are read"));
    }
    let bytes: usize = headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum();
    (bytes > MAX_HEADER_BYTES)
        .then(|| format!("the header fields take {bytes} bytes; at most {MAX_HEADER_BYTES} are read"))
}

/// Whether every `%` in `path` starts an escape of two hex digits, and the escapes decode, with
/// the rest, to UTF-8.
fn escapes_decode(path: &str) -> bool {
    if !path.contains('%') {
        return true;
    }
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            decoded.push(bytes[i]);
            i += 1;
            continue;
        }
        match bytes.get(i + 1..i + 3) {
            Some(&[hi, lo]) if hi.is_ascii_hexdigit() && lo.is_ascii_hexdigit() => {
                decoded.push((hex_value(hi) << 4) | hex_value(lo));
            }
            _ => return false,
        }
        i += 3;
    }
    std::str::from_utf8(&decoded).is_ok()
}

/// The value of an ASCII hex digit.
fn hex_value(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => c - b'A' + 10,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_escapes_must_be_two_hex_digits_that_decode_to_utf8() {
        for ok in ["/v1/workers", "/v1/workers/wkr-1", "/a%20b", "/%C3%A9t%C3%A9", "/%2F"] {
            assert!(escapes_decode(ok), "{ok}");
        }
        for bad in ["/v1/workers/%ff", "/%C0%AF", "/%zz", "/%", "/%2", "/%+1", "/x%e9"] {
            assert!(!escapes_decode(bad), "{bad}");
        }
    }

    #[test]
    fn header_limits_count_fields_and_bytes() {
        let mut h = HeaderMap::new();
        for i in 0..MAX_HEADER_FIELDS {
            h.insert(axum::http::HeaderName::try_from(format!("x-{i}")).expect("name"), "v".parse().expect("value"));
        }
        assert_eq!(oversized(&h), None);
        h.insert("x-one-more", "v".parse().expect("value"));
        assert!(oversized(&h).is_some_and(|d| d.contains("101 header fields")));
        let mut h = HeaderMap::new();
        h.insert("x-big", "v".repeat(MAX_HEADER_BYTES).parse().expect("value"));
        assert!(oversized(&h).is_some());
    }
}
