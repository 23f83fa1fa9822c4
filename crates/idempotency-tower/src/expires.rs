//! `Idempotency-Key-Expires` (SPEC 1.3): until when a retry with the key is answered from its
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
    if let Ok(value) = HeaderValue::from_str(&http_date(expires_at)) {
        res.headers_mut().insert(IDEMPOTENCY_KEY_EXPIRES, value);
    }
    res
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
    fn an_expiry_beyond_the_year_9999_is_its_last_second() {
        assert_eq!(http_date(chrono::DateTime::<Utc>::MAX_UTC), "Fri, 31 Dec 9999 23:59:59 GMT");
    }
}
