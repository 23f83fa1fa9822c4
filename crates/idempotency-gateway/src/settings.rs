//! The typed settings the gateway is configured with: each closed set an enum, each value parsed
//! once at the edge (the command line or the `--config` file), never a string tested later.

use std::fmt;
use std::str::FromStr;

use http::{HeaderName, Method, Uri};

/// Where a request's principal comes from (`--principal`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrincipalSource {
    /// SHA-256 (hex) of the `Authorization` header's value: the caller's credentials scope its
    /// records, so two tokens never share one and the gateway needs no user list.
    Bearer,
    /// The value of this header, set by an authenticating proxy in front of the gateway. Safe
    /// only where that proxy removes the header from its clients' requests (docs/gateway.md).
    Header(HeaderName),
}

impl FromStr for PrincipalSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "bearer" => Ok(Self::Bearer),
            Some(("header", name)) => HeaderName::from_str(name)
                .map(Self::Header)
                .map_err(|_| "header:NAME needs a valid header name".to_owned()),
            _ => Err("expected bearer or header:NAME".to_owned()),
        }
    }
}

impl fmt::Display for PrincipalSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bearer => f.write_str("bearer"),
            Self::Header(name) => write!(f, "header:{name}"),
        }
    }
}

/// What the upstream receives as `Idempotency-Key` on a protected request (`--forward-key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ForwardKey {
    /// `"<sub-key>"` derived from the record (docs/protocol.md#side-effects): the same on every retry and every
    /// replica, different per principal, so an upstream that deduplicates by key sees one key per
    /// logical operation and never one tenant's key in another's scope.
    #[default]
    Derived,
    /// The client's own key, as sent.
    Original,
    /// No `Idempotency-Key` at all.
    None,
}

/// What a retry of a record whose outcome is unknown gets (`--on-uncertain`, a route's
/// `on-uncertain`). A route with a `probe` asks the upstream first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum UncertainMode {
    /// `409 outcome-uncertain` until an operator resolves the record on the admin listener.
    #[default]
    Hold,
    /// Forwarded again with the same derived key: for an upstream that deduplicates by it.
    Resend,
}

/// A route's policy (`policy` in a `[[route]]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Policy {
    /// A key is required (`400 idempotency-key-missing` without one).
    #[default]
    Required,
    /// A key is honoured when sent; without one the request is forwarded unprotected.
    Optional,
    /// The gateway forwards the route's requests untouched.
    Off,
}

impl From<Policy> for idempotency_tower::RoutePolicy {
    fn from(p: Policy) -> Self {
        match p {
            Policy::Required => Self::Required,
            Policy::Optional => Self::Optional,
            Policy::Off => Self::Off,
        }
    }
}

/// How a route's request body enters its fingerprint (`fingerprint` in a `[[route]]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Fingerprint {
    /// Byte for byte.
    #[default]
    Raw,
    /// Canonical JSON: key order and insignificant whitespace ignored.
    CanonicalJson,
}

impl From<Fingerprint> for idempotency::FingerprintMode {
    fn from(f: Fingerprint) -> Self {
        match f {
            Fingerprint::Raw => Self::Raw,
            Fingerprint::CanonicalJson => Self::CanonicalJson,
        }
    }
}

/// The upstream's base URL (`--upstream`): `http://` or `https://`, a host, and optionally a
/// path prefix that every forwarded path is appended to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    prefix: String,
}

impl Upstream {
    /// The URI of `path_and_query` (a path from `/`, with its query) on the upstream.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{path_and_query}", self.prefix))
            .build()
    }

    /// True for an `https://` upstream.
    pub fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }
}

impl FromStr for Upstream {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let uri = Uri::from_str(s).map_err(|_| "expected a URL such as http://127.0.0.1:8000".to_owned())?;
        let scheme = match uri.scheme_str() {
            Some("http") => http::uri::Scheme::HTTP,
            Some("https") => http::uri::Scheme::HTTPS,
            _ => return Err("expected an http:// or https:// URL".to_owned()),
        };
        let authority = uri.authority().cloned().ok_or_else(|| "the URL has no host".to_owned())?;
        if authority.as_str().contains('@') {
            return Err("the URL must not carry credentials".to_owned());
        }
        if uri.query().is_some() {
            return Err("the URL must not have a query".to_owned());
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Self { scheme, authority, prefix })
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}{}", self.scheme, self.authority, self.prefix)
    }
}

/// A method and a path template, `POST /orders/{id}/cancel` (a route's `match`, a `probe`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodPath {
    /// The method.
    pub method: Method,
    /// The path template: `{name}` matches one segment, `{*name}` the rest.
    pub template: String,
}

impl FromStr for MethodPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (method, template) = s.trim().split_once(' ').ok_or("expected METHOD /path, e.g. POST /orders/{id}")?;
        let method = Method::from_str(method.trim()).map_err(|_| format!("{method:?} is not a method"))?;
        let template = template.trim();
        if !template.starts_with('/') || template.contains(['?', '#', ' ']) {
            return Err("the path must start with / and hold no query".to_owned());
        }
        Ok(Self { method, template: template.to_owned() })
    }
}

/// A byte count: `1048576`, `512KiB`, `1MiB`, `1 MB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bytes(pub usize);

impl FromStr for Bytes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let size = bytesize::ByteSize::from_str(s.trim()).map_err(|_| "expected a size such as 1MiB".to_owned())?;
        usize::try_from(size.as_u64()).map(Self).map_err(|_| "too large".to_owned())
    }
}

/// A duration as humans write it: `30s`, `5m`, `24h`, `7d`.
pub fn duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s).map_err(|_| "expected a duration such as 30s, 5m or 24h".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn principal_sources_parse() {
        assert_eq!("bearer".parse(), Ok(PrincipalSource::Bearer));
        assert_eq!("header:X-User".parse(), Ok(PrincipalSource::Header(HeaderName::from_static("x-user"))));
        for bad in ["", "basic", "header:", "header:bad name", "Bearer"] {
            assert!(bad.parse::<PrincipalSource>().is_err(), "{bad}");
        }
    }

    #[test]
    fn upstreams_keep_their_prefix_and_refuse_what_cannot_be_forwarded_to() {
        let up: Upstream = "http://127.0.0.1:8000/api/".parse().expect("valid");
        assert_eq!(up.uri("/orders?x=1").expect("uri").to_string(), "http://127.0.0.1:8000/api/orders?x=1");
        assert_eq!(up.to_string(), "http://127.0.0.1:8000/api");
        for bad in ["127.0.0.1:8000", "ftp://h", "http://u:p@h", "http://h/?q", "not a url"] {
            assert!(bad.parse::<Upstream>().is_err(), "{bad}");
        }
    }

    #[test]
    fn method_paths_sizes_and_durations_parse() {
        let mp: MethodPath = "POST /orders/{id}/cancel".parse().expect("valid");
        assert_eq!((mp.method, mp.template.as_str()), (Method::POST, "/orders/{id}/cancel"));
        for bad in ["POST", "/orders", "POST orders", "P@ST /x", "GET /x?y"] {
            assert!(bad.parse::<MethodPath>().is_err(), "{bad}");
        }
        assert_eq!("1MiB".parse(), Ok(Bytes(1 << 20)));
        assert_eq!("2048".parse(), Ok(Bytes(2048)));
        assert!("lots".parse::<Bytes>().is_err());
        assert_eq!(duration("5m"), Ok(std::time::Duration::from_secs(300)));
        assert!(duration("soon").is_err());
    }
}
