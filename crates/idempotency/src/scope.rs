//! Who asked, and where: the scope that identifies a record.

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
/// (`POST /v1/workers/wkr-1/reboot`).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint(Arc<str>);

impl Endpoint {
    /// Builds the endpoint from a method and a path. Anything after a `?` in `path` is dropped.
    pub fn new(method: &str, path: &str) -> Self {
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        let mut s = String::with_capacity(method.len() + 1 + path.len());
        s.extend(method.chars().map(|c| c.to_ascii_uppercase()));
        s.push(' ');
        s.push_str(path);
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
    fn endpoint_drops_the_query_and_uppercases_the_method() {
        assert_eq!(Endpoint::new("post", "/v1/workers?x=1").as_str(), "POST /v1/workers");
        assert_eq!(Endpoint::new("POST", "/v1/workers/wkr-1/reboot").as_str(), "POST /v1/workers/wkr-1/reboot");
    }
}
