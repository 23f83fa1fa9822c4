//! Who asked, and where: the scope that identifies a record.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::IdempotencyKey;

/// The authenticated identity a request runs as. The service supplies it; two principals never
/// share a record, even when they send the same key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Principal(Arc<str>);

impl Principal {
    /// Wraps a principal name. Any non-empty string is a principal; the service decides what it
    /// means (a token's owner, an account id, ...).
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The principal's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for Principal {
    fn from(name: String) -> Self {
        Self::new(name)
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Principal({:?})", self.0)
    }
}

/// The endpoint a request was sent to: its method and concrete path, without the query string
/// (`POST /v1/workers/wkr-1/reboot`), the path normalized by [`normalize_path`] so that every
/// spelling of one path is one endpoint.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint(Arc<str>);

impl Endpoint {
    /// Builds the endpoint from a method and a path. Anything after a `?` in `path` is dropped
    /// and the rest is normalized ([`normalize_path`]).
    ///
    /// ```
    /// use idempotency::Endpoint;
    ///
    /// let plain = Endpoint::new("POST", "/v1/workers/wkr-1/reboot");
    /// assert_eq!(Endpoint::new("post", "/v1/workers/%77kr%2D1/%72eboot?x=1"), plain);
    /// assert_eq!(plain.as_str(), "POST /v1/workers/wkr-1/reboot");
    /// ```
    pub fn new(method: &str, path: &str) -> Self {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        let path = normalize_path(path);
        let mut s = String::with_capacity(method.len() + 1 + path.len());
        s.extend(method.chars().map(|c| c.to_ascii_uppercase()));
        s.push(' ');
        s.push_str(&path);
        Self(s.into())
    }

    /// Restores an endpoint from its stored form (`METHOD /path`).
    pub fn from_stored(s: impl Into<Arc<str>>) -> Self {
        Self(s.into())
    }

    /// The stored form, `METHOD /path`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Endpoint({:?})", self.0)
    }
}

/// A request path in one canonical spelling, so that every way of writing one path names one
/// endpoint (docs/protocol.md#scope-and-fingerprint; RFC 3986 6.2.2).
///
/// Each `/`-separated segment is percent-decoded and written again the same way:
///
/// - a character that may stand unescaped in a path segment (RFC 3986 `pchar`: the unreserved
///   `A-Z a-z 0-9 - . _ ~`, the sub-delimiters `! $ & ' ( ) * + , ; =`, and `:` `@`) is written
///   as itself, whether it came escaped (`%72`, `%2D`, `%21`) or not;
/// - every other byte (`/` inside a segment, `%`, `?`, `#`, space, controls, non-ASCII) is
///   written as an escape with upper-case hex digits (`%2f` becomes `%2F`);
/// - a `%` that does not start a valid escape stands for itself and is written `%25`.
///
/// So two paths normalize to the same string exactly when their segments decode to the same
/// bytes, which is what an axum router sees: it matches the path segment by segment and hands
/// each path parameter to the handler percent-decoded, so `/v1/workers/wkr-1/reboot` and
/// `/v1/workers/%77kr%2D1/reboot` reach one handler with one worker id. An escaped `/` (`%2F`)
/// stays escaped: decoding it would split a segment in two, and routers keep it in one.
/// Nothing else is changed: case, empty segments (`//`), dot segments and a trailing `/` are
/// kept, as axum routes each of them differently.
///
/// ```
/// use idempotency::normalize_path;
///
/// assert_eq!(normalize_path("/v1/workers/wkr-1/%72eboot"), "/v1/workers/wkr-1/reboot");
/// assert_eq!(normalize_path("/a%2fb/%7e%21"), "/a%2Fb/~!");
/// assert_eq!(normalize_path("/caf%c3%a9/100%"), "/caf%C3%A9/100%25");
/// ```
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let bytes = path.as_bytes();
    if bytes.iter().all(|&b| b == b'/' || is_pchar(b)) {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let (byte, used) = match (b, bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => ((hi << 4) | lo, 3),
            (b'/', ..) => {
                out.push('/');
                i += 1;
                continue;
            }
            _ => (b, 1),
        };
        if is_pchar(byte) {
            out.push(char::from(byte));
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        i += used;
    }
    Cow::Owned(out)
}

/// RFC 3986 `pchar` minus `pct-encoded`: unreserved, sub-delims, `:` and `@`.
fn is_pchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b)
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// The most bytes of a scope component a store keeps as it is; [`stored_component`] shortens a
/// longer one to [`STORED_COMPONENT_MAX`] bytes at most.
pub const STORED_AS_IS_MAX: usize = STORED_PREFIX_MAX - 4 + STORED_HASH_MARK.len() + 64;

/// The most bytes [`stored_component`] returns.
pub const STORED_COMPONENT_MAX: usize = STORED_PREFIX_MAX + STORED_HASH_MARK.len() + 64;

/// How much of a shortened component is kept in front of its hash.
const STORED_PREFIX_MAX: usize = 1024;
/// What stands between the kept prefix and the hash of the whole.
const STORED_HASH_MARK: &str = "...sha256:";

/// A scope component (principal, endpoint or key) in the bounded form a store keeps and looks it
/// up by: the component itself when it is at most [`STORED_AS_IS_MAX`] bytes (1,094), else its
/// first 1,021 to 1,024 bytes (cut at a character boundary), `...sha256:` and the hex SHA-256 of
/// the whole component.
///
/// So a store's key never exceeds what its index takes (PostgreSQL's btree refuses index rows
/// over 2,704 bytes, which a 2 KiB path alone comes close to), a record's memory stays bounded
/// whatever length the service lets through, and an operator listing records still reads the
/// method and the start of the path. Lookups stay exact: a component kept as it is is at most
/// 1,094 bytes, a shortened one at least 1,095, so the two never meet; two shortened ones are
/// equal only when their whole components have the same SHA-256 (and the same prefix).
///
/// ```
/// use idempotency::{STORED_AS_IS_MAX, STORED_COMPONENT_MAX, stored_component};
///
/// assert_eq!(stored_component("POST /v1/workers"), "POST /v1/workers");
/// let long = format!("DELETE /v1/workers/{}", "x".repeat(2000));
/// let stored = stored_component(&long);
/// assert!(stored.len() > STORED_AS_IS_MAX && stored.len() <= STORED_COMPONENT_MAX);
/// assert!(stored.starts_with("DELETE /v1/workers/xxx"));
/// assert_ne!(stored, stored_component(&format!("{long}y")));
/// ```
pub fn stored_component(s: &str) -> Cow<'_, str> {
    if s.len() <= STORED_AS_IS_MAX {
        return Cow::Borrowed(s);
    }
    let mut cut = STORED_PREFIX_MAX;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let digest = <sha2::Sha256 as sha2::Digest>::digest(s.as_bytes());
    let mut out = String::with_capacity(cut + STORED_HASH_MARK.len() + 64);
    out.push_str(&s[..cut]);
    out.push_str(STORED_HASH_MARK);
    out.push_str(&hex::encode(digest));
    Cow::Owned(out)
}

/// What identifies one record: (principal, endpoint, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Who sent the request.
    pub principal: Principal,
    /// Where it was sent.
    pub endpoint: Endpoint,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl Scope {
    /// Builds a scope.
    pub fn new(principal: Principal, endpoint: Endpoint, key: IdempotencyKey) -> Self {
        Self { principal, endpoint, key }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_components_are_stored_shortened_and_apart() {
        let at_limit = "a".repeat(STORED_AS_IS_MAX);
        assert!(matches!(stored_component(&at_limit), Cow::Borrowed(_)));
        let over = format!("{at_limit}b");
        let stored = stored_component(&over);
        assert!(stored.len() > STORED_AS_IS_MAX && stored.len() <= STORED_COMPONENT_MAX, "{}", stored.len());
        assert!(stored.starts_with(&"a".repeat(1024)));
        // Differing only at the end: two stored forms.
        let (a, b) = (format!("{}1", "x".repeat(5000)), format!("{}2", "x".repeat(5000)));
        assert_ne!(stored_component(&a), stored_component(&b));
        // A multi-byte character across the cut: the prefix ends before it, and the form is
        // still longer than any component kept as it is.
        let wide = format!("{}é{}", "x".repeat(1023), "y".repeat(2000));
        let stored = stored_component(&wide);
        assert!(stored.starts_with(&"x".repeat(1023)) && !stored.contains('é'));
        assert!(stored.len() > STORED_AS_IS_MAX, "{}", stored.len());
        // Same input, same form.
        assert_eq!(stored_component(&wide), stored);
    }

    #[test]
    fn endpoint_drops_the_query_and_uppercases_the_method() {
        assert_eq!(Endpoint::new("post", "/v1/workers?x=1").as_str(), "POST /v1/workers");
        assert_eq!(Endpoint::new("POST", "/v1/workers/wkr-1/reboot").as_str(), "POST /v1/workers/wkr-1/reboot");
    }

    #[test]
    fn every_spelling_of_one_path_is_one_endpoint() {
        let plain = Endpoint::new("POST", "/v1/workers/wkr-1/reboot");
        for alias in [
            "/v1/workers/wkr-1/%72eboot",
            "/v1/workers/wkr%2D1/reboot",
            "/v1/workers/wkr%2d1/reboot",
            "/v1/workers/%77%6B%72-1/reboot",
            "/v1/%77orkers/wkr-1/reboo%74",
        ] {
            assert_eq!(Endpoint::new("POST", alias), plain, "{alias}");
        }
        // Sub-delimiters, ':' and '@' too: axum decodes them into the same path parameter.
        assert_eq!(normalize_path("/a/%21%24%26%27%28%29%2A%2B%2C%3B%3D%3A%40"), "/a/!$&'()*+,;=:@");
    }

    #[test]
    fn other_escapes_are_upper_cased_and_kept() {
        assert_eq!(normalize_path("/a%2fb"), "/a%2Fb");
        assert_ne!(Endpoint::new("POST", "/a%2Fb"), Endpoint::new("POST", "/a/b"), "an escaped slash is not a slash");
        assert_eq!(normalize_path("/%c3%a9%20x%3f%23"), "/%C3%A9%20x%3F%23");
        assert_eq!(normalize_path("/%25"), "/%25");
        // A '%' that starts no valid escape is the character itself.
        assert_eq!(normalize_path("/100%"), "/100%25");
        assert_eq!(normalize_path("/%zz%4"), "/%25zz%254");
        assert_eq!(normalize_path("/100%"), normalize_path("/100%25"));
    }

    #[test]
    fn what_routers_tell_apart_stays_apart() {
        for (a, b) in [("/v1/Workers", "/v1/workers"), ("/v1/workers/", "/v1/workers"), ("/v1//workers", "/v1/workers")]
        {
            assert_ne!(Endpoint::new("POST", a), Endpoint::new("POST", b));
        }
        assert!(matches!(normalize_path("/v1/workers/wkr-1/reboot"), Cow::Borrowed(_)));
    }

    #[test]
    fn normalizing_twice_changes_nothing() {
        for p in ["/a%2fb/%7E", "/100%", "/%c3%a9", "/x%2D%2d%41", "/%%%", "/a%2"] {
            let once = normalize_path(p).into_owned();
            assert_eq!(normalize_path(&once), once, "{p}");
        }
    }
}
