//! The `Idempotency-Key` header value.

use std::fmt;
use std::sync::Arc;

/// The longest key accepted, in characters after unquoting.
pub const MAX_KEY_LEN: usize = 128;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] visible ASCII characters (0x21-0x7E).
///
/// The key is opaque: it is compared byte for byte and never interpreted.
///
/// ```
/// use idempotency::IdempotencyKey;
///
/// // The IETF draft's Structured Field String and the bare form name the same key.
/// let quoted = IdempotencyKey::parse_header(br#""7c3f5d1e-91a4""#).unwrap();
/// let bare = IdempotencyKey::parse_header(b"7c3f5d1e-91a4").unwrap();
/// assert_eq!(quoted, bare);
/// assert!(IdempotencyKey::parse_header(b"").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

/// Why a header value is not a valid idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty (after unquoting).
    #[error("the key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the key is {0} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong(usize),
    /// The key holds a byte outside visible ASCII (0x21-0x7E): a space, a control character or
    /// a non-ASCII byte.
    #[error("the key holds a character outside visible ASCII (0x21-0x7E) at position {0}")]
    InvalidCharacter(usize),
    /// The value starts with a quote but is not a valid RFC 9651 String item.
    #[error("the quoted key is not a valid structured field string: {0}")]
    Malformed(String),
    /// The structured field is an item of another type, or carries parameters.
    #[error("the structured field must be a plain String item without parameters")]
    NotAString,
    /// The header was sent more than once.
    #[error("the Idempotency-Key header was sent more than once")]
    Repeated,
    /// A bare (unquoted) key holds a comma, which cannot be told apart from two header lines
    /// merged into one (RFC 9110 5.3). The quoted form may carry commas.
    #[error("the unquoted key holds a comma at position {0}; send a key with commas as a quoted string")]
    CommaInBareKey(usize),
}

impl IdempotencyKey {
    /// Parses a raw header value in either accepted form.
    ///
    /// A value that starts with `"` is parsed as an RFC 9651 Structured Field Item that must be a
    /// String without parameters (the IETF draft's form); anything else is taken as the bare key
    /// that Stripe-style clients send, which may not hold a comma: a proxy may join two header
    /// lines into one with a comma (RFC 9110 5.3), and `a,b` could be the keys `a` and `b`. Either
    /// way the key must then be 1-128 visible ASCII.
    pub fn parse_header(raw: &[u8]) -> Result<Self, KeyError> {
        let trimmed = trim_ows(raw);
        if let Some(plain) = plain_sf_string(trimmed) {
            // The common form, `"key"` with nothing to unescape and no parameters: the String it
            // is, without the structured-field parser.
            return Self::try_from(plain);
        }
        if trimmed.first() == Some(&b'"') {
            Self::parse_sf_string(trimmed)
        } else {
            let s = std::str::from_utf8(trimmed).map_err(|e| KeyError::InvalidCharacter(e.valid_up_to()))?;
            let key = Self::try_from(s)?;
            match s.find(',') {
                Some(pos) => Err(KeyError::CommaInBareKey(pos)),
                None => Ok(key),
            }
        }
    }

    /// `raw` read by the structured-field parser: an RFC 9651 String without parameters.
    fn parse_sf_string(raw: &[u8]) -> Result<Self, KeyError> {
        let item = sfv::Parser::new(raw).parse_item().map_err(|e| KeyError::Malformed(e.to_string()))?;
        let sfv::Item { bare_item, params } = item;
        if !params.is_empty() {
            return Err(KeyError::NotAString);
        }
        let Some(s) = bare_item.as_string() else {
            return Err(KeyError::NotAString);
        };
        Self::try_from(s.as_str())
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The content of `raw` when it is an RFC 9651 String of visible ASCII with no escape and no
/// parameters (`"abc"`): exactly the String the structured-field parser would read, or `None`
/// for anything else (which the parser then reads, or refuses).
fn plain_sf_string(raw: &[u8]) -> Option<&str> {
    let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    if inner.iter().all(|&b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\') {
        // Visible ASCII, so UTF-8.
        std::str::from_utf8(inner).ok()
    } else {
        None
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = KeyError;

    fn try_from(s: &str) -> Result<Self, KeyError> {
        if s.is_empty() {
            return Err(KeyError::Empty);
        }
        if let Some(pos) = s.bytes().position(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(KeyError::InvalidCharacter(pos));
        }
        if s.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(s.len()));
        }
        Ok(Self(Arc::from(s)))
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse_header(s.as_bytes())
    }

    /// The fast path for `"key"` answers what the structured-field parser answers.
    #[test]
    fn a_plain_quoted_key_reads_as_the_structured_field_parser_reads_it() {
        let long = format!("\"{}\"", "k".repeat(129));
        let cases: [&[u8]; 12] = [
            b"\"abc\"",
            b"\"\"",
            b"\"",
            b"\"a b\"",
            b"\"a\\\"b\"",
            b"\"a\";p=1",
            b"\"a\"\"b\"",
            b"\"~!#$%&'()*+,-./:;<=>?@[]^_`{|}\"",
            b"\"\xc3\xa9\"",
            b"\"a\x7fb\"",
            b"\"abc",
            long.as_bytes(),
        ];
        for raw in cases {
            let fast = IdempotencyKey::parse_header(raw);
            let slow = IdempotencyKey::parse_sf_string(raw);
            assert_eq!(fast.is_ok(), slow.is_ok(), "{:?}: {fast:?} / {slow:?}", String::from_utf8_lossy(raw));
            if let (Ok(fast), Ok(slow)) = (&fast, &slow) {
                assert_eq!(fast, slow);
            }
        }
        assert!(plain_sf_string(b"\"abc\"").is_some(), "the common form takes the fast path");
        assert!(plain_sf_string(b"\"a\\\"b\"").is_none(), "an escape takes the parser");
    }

    #[test]
    fn both_forms_give_the_same_key() {
        let key = "7c3f5d1e-91a4-4b8c-9f02-1c4a8e5b6d10";
        assert_eq!(parse(key).unwrap().as_str(), key);
        assert_eq!(parse(&format!("\"{key}\"")).unwrap().as_str(), key);
    }

    #[test]
    fn structured_escapes_are_unquoted() {
        assert_eq!(parse(r#""a\"b\\c""#).unwrap().as_str(), r#"a"b\c"#);
    }

    #[test]
    fn bounds() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert!(parse(&"k".repeat(128)).is_ok());
        assert_eq!(parse(&"k".repeat(129)), Err(KeyError::TooLong(129)));
        assert!(parse(&format!("\"{}\"", "k".repeat(128))).is_ok());
        assert_eq!(parse(&format!("\"{}\"", "k".repeat(129))), Err(KeyError::TooLong(129)));
    }

    #[test]
    fn rejects_what_is_not_visible_ascii() {
        assert_eq!(parse("a b"), Err(KeyError::InvalidCharacter(1)));
        assert_eq!(parse("\"a b\""), Err(KeyError::InvalidCharacter(1)));
        assert_eq!(parse("ab\u{7f}"), Err(KeyError::InvalidCharacter(2)));
        assert!(matches!(parse("é"), Err(KeyError::InvalidCharacter(_))));
        assert!(IdempotencyKey::parse_header(b"a\x00b").is_err());
        assert!(IdempotencyKey::parse_header(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn rejects_malformed_structured_values() {
        assert!(matches!(parse("\"unterminated"), Err(KeyError::Malformed(_))));
        assert_eq!(parse("\"abc\";x=1"), Err(KeyError::NotAString));
        assert!(matches!(parse("\"abc\" trailing"), Err(KeyError::Malformed(_))));
    }

    #[test]
    fn a_bare_key_may_not_hold_a_comma_a_quoted_one_may() {
        assert_eq!(parse("a,b"), Err(KeyError::CommaInBareKey(1)));
        assert_eq!(parse(","), Err(KeyError::CommaInBareKey(0)));
        assert_eq!(parse("abc,"), Err(KeyError::CommaInBareKey(3)));
        // Two quoted lines merged by a proxy are not one String item either.
        assert!(matches!(parse(r#""a", "b""#), Err(KeyError::Malformed(_))));
        assert_eq!(parse(r#""a,b""#).unwrap().as_str(), "a,b");
        // The comma check comes after the usual ones: a too-long key is still TooLong.
        assert_eq!(parse(&format!("{},", "k".repeat(128))), Err(KeyError::TooLong(129)));
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(parse("  abc\t").unwrap().as_str(), "abc");
    }
}
