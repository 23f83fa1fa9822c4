//! `IdempotencyKey::parse_header` on arbitrary bytes.

use idempotency::{IdempotencyKey, MAX_KEY_LEN};

/// Never panics; whatever it accepts is 1-128 visible ASCII; both spellings of an accepted key
/// (bare and RFC 9651 quoted; bare only without a comma) parse back to it; and a bare value that
/// is already 1-128 visible ASCII without a comma is accepted as it is.
pub fn check(raw: &[u8]) {
    let trimmed = trim_ows(raw);
    match IdempotencyKey::parse_header(raw) {
        Ok(key) => {
            let s = key.as_str();
            assert!((1..=MAX_KEY_LEN).contains(&s.len()), "accepted a key of {} bytes: {s:?}", s.len());
            assert!(s.bytes().all(is_visible), "accepted a key outside visible ASCII: {s:?}");
            let quoted = format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
            assert_eq!(IdempotencyKey::parse_header(quoted.as_bytes()).as_ref(), Ok(&key), "quoted form of {s:?}");
            // A comma is refused in the bare form (SPEC 1.1: it cannot be told apart from two
            // merged header lines); only the quoted form carries one.
            if !s.starts_with('"') && !s.contains(',') {
                assert_eq!(IdempotencyKey::parse_header(s.as_bytes()).as_ref(), Ok(&key), "bare form of {s:?}");
            }
        }
        Err(e) => {
            // Displaying the error must not panic either (it ends up in a problem's detail).
            let _ = e.to_string();
            let plain_bare = trimmed.first() != Some(&b'"')
                && (1..=MAX_KEY_LEN).contains(&trimmed.len())
                && trimmed.iter().copied().all(is_visible)
                && !trimmed.contains(&b',');
            assert!(!plain_bare, "refused a plain bare key {:?}: {e}", String::from_utf8_lossy(trimmed));
        }
    }
}

fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}
