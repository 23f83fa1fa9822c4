//! The request fingerprint: what makes "the same request" the same.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::canonical_json::canonical_json;

/// The default largest body the fingerprint reads (1 MiB).
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// A SHA-256 request fingerprint, shown and stored as `sha256:<hex>`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(Arc<str>);

/// How the body enters the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FingerprintMode {
    /// The raw body bytes, as sent. The safe default: two requests that differ by one byte differ.
    #[default]
    Raw,
    /// Canonical JSON: object keys sorted and insignificant whitespace ignored, so
    /// `{"a":1, "b":2}` and `{"b":2,"a":1}` match. `{}`, `null` and an absent field stay distinct,
    /// and so do `1` and `1.0`. A body that is not JSON, or that holds a number other than a
    /// 64-bit integer (which a float could not keep exactly), is fingerprinted raw.
    CanonicalJson,
}

/// The parts of a request that make up its fingerprint.
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    /// The method, e.g. `POST`.
    pub method: &'a str,
    /// The path, without the query string. It enters the fingerprint normalized
    /// ([`crate::normalize_path`]), as it enters the record's endpoint: two spellings of one path
    /// are one request.
    pub path: &'a str,
    /// The query string without the `?`, or `""`.
    pub query: &'a str,
    /// The `Content-Type` header, or `""` when absent.
    pub content_type: &'a [u8],
    /// The whole body, as received.
    pub body: &'a [u8],
}

/// Why a fingerprint could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// The body is larger than the fingerprinter reads.
    #[error("the request body is {size} bytes; at most {limit} are accepted")]
    BodyTooLarge {
        /// The body's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
}

/// Computes fingerprints with a mode and a body limit.
///
/// ```
/// use idempotency::{Fingerprinter, FingerprintMode, RequestParts};
///
/// let parts = |body: &'static [u8]| RequestParts {
///     method: "POST", path: "/v1/workers", query: "",
///     content_type: b"application/json", body,
/// };
/// let raw = Fingerprinter::default();
/// assert_ne!(raw.fingerprint(&parts(br#"{"a":1,"b":2}"#))?, raw.fingerprint(&parts(br#"{"b":2,"a":1}"#))?);
///
/// let canonical = Fingerprinter::new(FingerprintMode::CanonicalJson);
/// assert_eq!(
///     canonical.fingerprint(&parts(br#"{"a":1,"b":2}"#))?,
///     canonical.fingerprint(&parts(br#"{ "b": 2, "a": 1 }"#))?,
/// );
/// # Ok::<(), idempotency::FingerprintError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Fingerprinter {
    mode: FingerprintMode,
    max_body: usize,
}

impl Default for Fingerprinter {
    fn default() -> Self {
        Self::new(FingerprintMode::Raw)
    }
}

impl Fingerprinter {
    /// A fingerprinter in `mode` with the default body limit ([`DEFAULT_MAX_BODY`]).
    pub fn new(mode: FingerprintMode) -> Self {
        Self { mode, max_body: DEFAULT_MAX_BODY }
    }

    /// Sets the largest body accepted.
    pub fn max_body(mut self, limit: usize) -> Self {
        self.max_body = limit;
        self
    }

    /// The mode.
    pub fn mode(&self) -> FingerprintMode {
        self.mode
    }

    /// Fingerprints a request.
    pub fn fingerprint(&self, parts: &RequestParts<'_>) -> Result<Fingerprint, FingerprintError> {
        if parts.body.len() > self.max_body {
            return Err(FingerprintError::BodyTooLarge { size: parts.body.len(), limit: self.max_body });
        }
        let canonical = match self.mode {
            FingerprintMode::Raw => None,
            FingerprintMode::CanonicalJson => canonical_json(parts.body),
        };
        let path = crate::normalize_path(parts.path);
        let mut h = Sha256::new();
        // Each field is length-prefixed, so no two different requests can hash the same bytes.
        let tag: &[u8] = if canonical.is_some() { b"idempotency/fp/v1/json" } else { b"idempotency/fp/v1/raw" };
        for field in [
            tag,
            parts.method.as_bytes(),
            path.as_bytes(),
            parts.query.as_bytes(),
            parts.content_type,
            canonical.as_deref().unwrap_or(parts.body),
        ] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field);
        }
        let mut shown = [0u8; 7 + 64];
        shown[..7].copy_from_slice(b"sha256:");
        hex::encode_to_slice(h.finalize(), &mut shown[7..]).expect("64 hex digits fit 64 bytes");
        Ok(Fingerprint(Arc::from(std::str::from_utf8(&shown).expect("hex is ASCII"))))
    }
}

impl Fingerprint {
    /// Restores a fingerprint from its stored `sha256:<hex>` form.
    pub fn from_stored(s: impl Into<Arc<str>>) -> Self {
        Self(s.into())
    }

    /// The `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(mode: FingerprintMode, method: &str, query: &str, ct: &[u8], body: &[u8]) -> Fingerprint {
        Fingerprinter::new(mode)
            .fingerprint(&RequestParts { method, path: "/v1/workers", query, content_type: ct, body })
            .unwrap()
    }

    #[test]
    fn shape() {
        let f = fp(FingerprintMode::Raw, "POST", "", b"application/json", b"{}");
        assert!(f.as_str().starts_with("sha256:"));
        assert_eq!(f.as_str().len(), 7 + 64);
    }

    #[test]
    fn every_part_counts() {
        let base = fp(FingerprintMode::Raw, "POST", "", b"application/json", b"{}");
        assert_ne!(base, fp(FingerprintMode::Raw, "PUT", "", b"application/json", b"{}"));
        assert_ne!(base, fp(FingerprintMode::Raw, "POST", "a=1", b"application/json", b"{}"));
        assert_ne!(base, fp(FingerprintMode::Raw, "POST", "", b"text/plain", b"{}"));
        assert_ne!(base, fp(FingerprintMode::Raw, "POST", "", b"application/json", b"{ }"));
        assert_eq!(base, fp(FingerprintMode::Raw, "POST", "", b"application/json", b"{}"));
    }

    #[test]
    fn the_path_counts_normalized() {
        let at = |path| {
            Fingerprinter::default()
                .fingerprint(&RequestParts { method: "POST", path, query: "", content_type: b"", body: b"{}" })
                .unwrap()
        };
        let plain = at("/v1/workers/wkr-1/reboot");
        assert_eq!(plain, at("/v1/workers/wkr-1/%72eboot"));
        assert_eq!(plain, at("/v1/workers/wkr%2d1/reboot"));
        assert_ne!(plain, at("/v1/workers/wkr-2/reboot"));
        assert_ne!(at("/a%2Fb"), at("/a/b"));
    }

    #[test]
    fn fields_cannot_bleed_into_each_other() {
        let a = fp(FingerprintMode::Raw, "POST", "ab", b"c", b"");
        let b = fp(FingerprintMode::Raw, "POST", "a", b"bc", b"");
        assert_ne!(a, b);
    }

    #[test]
    fn canonical_json_keeps_empty_null_and_absent_apart() {
        let m = FingerprintMode::CanonicalJson;
        let ct = b"application/json";
        let empty = fp(m, "POST", "", ct, br#"{"image":"x","labels":{}}"#);
        let null = fp(m, "POST", "", ct, br#"{"image":"x","labels":null}"#);
        let absent = fp(m, "POST", "", ct, br#"{"image":"x"}"#);
        assert_ne!(empty, null);
        assert_ne!(empty, absent);
        assert_ne!(null, absent);
        assert_eq!(empty, fp(m, "POST", "", ct, b"{ \"labels\" : { } ,\n \"image\":\"x\" }"));
        assert_ne!(fp(m, "POST", "", ct, br#"{"n":1}"#), fp(m, "POST", "", ct, br#"{"n":1.0}"#));
    }

    #[test]
    fn canonical_mode_never_merges_numbers_a_float_cannot_keep_apart() {
        let m = FingerprintMode::CanonicalJson;
        let ct = b"application/json";
        assert_ne!(
            fp(m, "POST", "", ct, br#"{"n":18446744073709551616}"#),
            fp(m, "POST", "", ct, br#"{"n":18446744073709551617}"#)
        );
        assert_ne!(
            fp(m, "POST", "", ct, br#"{"n":0.1000000000000000000001}"#),
            fp(m, "POST", "", ct, br#"{"n":0.1000000000000000000002}"#)
        );
        // Integers within 64 bits still canonicalise.
        assert_eq!(
            fp(m, "POST", "", ct, br#"{"b":-7,"a":18446744073709551615}"#),
            fp(m, "POST", "", ct, br#"{ "a": 18446744073709551615, "b": -7 }"#)
        );
    }

    /// serde_json's `raw_value` feature (which axum turns on, so every service with the layer has
    /// it) reads an object whose first member is named `$serde_json::private::RawValue` as the
    /// JSON text in its value. Canonical mode must not: that body is not the body it quotes, and
    /// it is one value however its members are ordered. Found by the `fingerprint` fuzz target.
    #[test]
    fn a_member_named_like_serde_jsons_raw_value_token_is_an_ordinary_member() {
        let m = FingerprintMode::CanonicalJson;
        let ct = b"application/json";
        assert_ne!(
            fp(m, "POST", "", ct, br#"{"image":"x"}"#),
            fp(m, "POST", "", ct, br#"{"$serde_json::private::RawValue":"{\"image\":\"x\"}"}"#),
        );
        assert_ne!(
            fp(m, "POST", "", ct, br#"{"image":"x"}"#),
            fp(m, "POST", "", ct, br#"{"\u0024serde_json::private::RawValue":"{\"image\":\"x\"}"}"#),
        );
        assert_eq!(
            fp(m, "POST", "", ct, br#"{"$serde_json::private::RawValue":true,"\u0017o":3038287258508722431}"#),
            fp(
                m,
                "POST",
                "",
                ct,
                b"{ \"\\u0017o\" : 3038287258508722431 , \"$serde_json::private::RawValue\" : true }"
            ),
        );
    }

    /// Canonical bytes are what serde_json's `Value` wrote for every ordinary body, so the
    /// fingerprints stored before the layer read JSON itself still match their retries.
    #[test]
    fn canonical_bytes_are_serde_jsons_for_ordinary_bodies() {
        let bodies: [&[u8]; 9] = [
            br#"{"image":"worker-base","cpu":2,"memory_gb":4,"labels":{"team":"infra","tier":"gold"}}"#,
            br#"[1,-2,18446744073709551615,-9223372036854775808,0,true,false,null,"",[],{}]"#,
            "{\"z\":\"\u{e9}\\u00e9\\n\\\"\\/\",\"a\":{\"y\":[{\"b\":1,\"a\":2}]}}".as_bytes(),
            br#"{"dup":1,"dup":2}"#,
            br#""a string""#,
            b"  42 ",
            br#"{"\ud83d\ude00":"\u0000\u001f"}"#,
            br#"{"B":1,"a":2,"A":3,"b":4,"\u00e9":5}"#,
            br#"{"nested":{"deeper":{"deepest":[[[]]]}}}"#,
        ];
        for body in bodies {
            let value: serde_json::Value = serde_json::from_slice(body).expect("valid JSON");
            let expected = serde_json::to_vec(&value).expect("serialise");
            assert_eq!(
                canonical_json(body).map(String::from_utf8),
                Some(Ok(String::from_utf8(expected).expect("UTF-8"))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn canonical_mode_falls_back_to_raw_for_non_json() {
        let m = FingerprintMode::CanonicalJson;
        assert_eq!(
            fp(m, "POST", "", b"text/plain", b"not json"),
            fp(FingerprintMode::Raw, "POST", "", b"text/plain", b"not json")
        );
    }

    #[test]
    fn oversize_bodies_are_a_typed_error() {
        let err = Fingerprinter::default()
            .max_body(4)
            .fingerprint(&RequestParts { method: "POST", path: "/", query: "", content_type: b"", body: b"12345" })
            .unwrap_err();
        assert_eq!(err, FingerprintError::BodyTooLarge { size: 5, limit: 4 });
    }
}
