//! The `wait` preference of RFC 7240 (`Prefer: wait=N`): how long a client would rather wait for
//! a request in flight with its key than be told `409 request-in-progress`.

use http::HeaderMap;

use crate::headers::PREFER;

/// The first `wait` preference of the request's `Prefer` headers, in seconds (RFC 7240 4.3).
///
/// Preferences are separated by commas, within one header line or over several; names are
/// case-insensitive; spaces around `=` and a quoted value are tolerated; parameters after `;`
/// are ignored, and so are other preferences. A `wait` whose value is not a number is ignored,
/// as a preference the server does not understand (RFC 7240 2); a number too large for `u64`
/// is taken as the longest wait.
pub(crate) fn wait_preference(headers: &HeaderMap) -> Option<u64> {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|v| std::str::from_utf8(v.as_bytes()).ok())
        .flat_map(split_outside_quotes(','))
        .find_map(|preference| {
            let head = split_outside_quotes(';')(preference).next().unwrap_or_default();
            let (name, value) = head.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let value = value.trim();
            let value = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(value.parse::<u64>().unwrap_or(u64::MAX))
        })
}

/// Splits `s` at every `sep` that is not inside a quoted-string.
fn split_outside_quotes(sep: char) -> impl Fn(&str) -> std::vec::IntoIter<&str> {
    move |s: &str| {
        let mut parts = Vec::new();
        let (mut start, mut quoted, mut escaped) = (0, false, false);
        for (i, c) in s.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                c if c == sep && !quoted => {
                    parts.push(&s[start..i]);
                    start = i + c.len_utf8();
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(values: &[&str]) -> Option<u64> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(PREFER, v.parse().expect("header value"));
        }
        wait_preference(&headers)
    }

    #[test]
    fn wait_is_read_among_other_preferences_in_any_case_and_spacing() {
        assert_eq!(wait(&["wait=10"]), Some(10));
        assert_eq!(wait(&["respond-async, wait=5"]), Some(5));
        assert_eq!(wait(&["return=minimal;foo=\"a,b\", WAIT = 7 ; x=y"]), Some(7));
        assert_eq!(wait(&["handling=lenient", "Wait=\"3\""]), Some(3));
        assert_eq!(wait(&["wait=2, wait=9"]), Some(2), "the first one counts");
    }

    #[test]
    fn no_or_unreadable_wait_is_none() {
        assert_eq!(wait(&[]), None);
        assert_eq!(wait(&["respond-async"]), None);
        assert_eq!(wait(&["wait"]), None);
        assert_eq!(wait(&["wait=soon"]), None);
        assert_eq!(wait(&["wait=-1"]), None);
        assert_eq!(wait(&["wait=1.5"]), None);
        assert_eq!(wait(&["waiting=4"]), None);
        assert_eq!(wait(&["x=\"wait=4\""]), None);
    }

    #[test]
    fn a_huge_wait_is_the_longest() {
        assert_eq!(wait(&["wait=99999999999999999999999"]), Some(u64::MAX));
    }
}
