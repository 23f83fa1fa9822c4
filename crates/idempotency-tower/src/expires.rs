//! `Idempotency-Key-Expires` (docs/protocol.md#records): until when a retry with the key is answered from its
//! record, so a client knows how long retrying is safe.

use std::time::SystemTime;

use axum::body::Body;
use chrono::{Datelike, TimeZone, Utc};
use http::{HeaderValue, Response};
use idempotency::Timestamp;

use crate::headers::IDEMPOTENCY_KEY_EXPIRES;

/// `expires_at` as an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110 5.6.7). An HTTP-date
/// has four year digits, so an expiry past the year 9999 (a retention of "forever") is said as
/// the last second of 9999.
pub(crate) fn http_date(expires_at: Timestamp) -> String {
    let last = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).single().unwrap_or(expires_at);
    let at = if expires_at.year() > 9999 { last } else { expires_at };
    httpdate::fmt_http_date(SystemTime::from(at))
}

/// Adds `Idempotency-Key-Expires: <expires_at>` to a response answered from (or stored in) a
/// record.
pub(crate) fn with_expiry(mut res: Response<Body>, expires_at: Timestamp) -> Response<Body> {
    if let Some(value) = expiry_value(expires_at) {
        res.headers_mut().insert(IDEMPOTENCY_KEY_EXPIRES, value);
    }
    res
}

thread_local! {
    /// The last expiry this thread formatted, by its second: the records a server creates within
    /// one second share their expiry's text (now plus the retention), and a replay's is its
    /// record's. A clone of the value is a reference count, the formatting a few hundred
    /// instructions and an allocation.
    static LAST: std::cell::RefCell<Option<(i64, HeaderValue)>> = const { std::cell::RefCell::new(None) };
}

/// The header value of `expires_at` (to the second, as an HTTP-date says it).
fn expiry_value(expires_at: Timestamp) -> Option<HeaderValue> {
    let second = expires_at.timestamp();
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((at, value)) = last.as_ref()
            && *at == second
        {
            return Some(value.clone());
        }
        let value = HeaderValue::from_str(&http_date(expires_at)).ok()?;
        *last = Some((second, value.clone()));
        Some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expiry_is_an_imf_fixdate() {
        let t = Utc.with_ymd_and_hms(1994, 11, 6, 8, 49, 37).single().expect("date");
        assert_eq!(http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
    }

    #[test]
    fn the_header_says_each_expiry_whether_or_not_its_second_was_said_before() {
        let t = Utc.with_ymd_and_hms(2026, 12, 3, 19, 0, 0).single().expect("date");
        let header = |at: Timestamp| {
            let res = with_expiry(Response::new(Body::empty()), at);
            res.headers()[IDEMPOTENCY_KEY_EXPIRES].to_str().expect("ascii").to_owned()
        };
        assert_eq!(header(t), "Thu, 03 Dec 2026 19:00:00 GMT");
        assert_eq!(header(t + chrono::Duration::milliseconds(999)), "Thu, 03 Dec 2026 19:00:00 GMT");
        assert_eq!(header(t + chrono::Duration::seconds(1)), "Thu, 03 Dec 2026 19:00:01 GMT");
        assert_eq!(header(t), "Thu, 03 Dec 2026 19:00:00 GMT");
    }

    #[test]
    fn an_expiry_beyond_the_year_9999_is_its_last_second() {
        assert_eq!(http_date(chrono::DateTime::<Utc>::MAX_UTC), "Fri, 31 Dec 9999 23:59:59 GMT");
    }
}
