//! Who a request runs as (docs/protocol.md#gateway, "Principal"): its records are scoped to it.

use http::header::AUTHORIZATION;
use http::request::Parts;
use idempotency::Principal;
use sha2::{Digest, Sha256};

use crate::settings::PrincipalSource;

/// The longest principal a trusted header may carry.
const MAX_HEADER_PRINCIPAL: usize = 256;

impl PrincipalSource {
    /// The principal of a request, or `None` (the layer then answers `401 principal-missing`
    /// and forwards nothing).
    ///
    /// `bearer`: `sha256:<hex>` of the whole `Authorization` value, so the gateway never keeps
    /// a credential and two credentials never share a record. `header:NAME`: the header's value,
    /// trimmed, 1 to 256 visible characters. A header sent twice has no principal: which of
    /// the two would be the caller is not for the gateway to guess.
    pub fn principal_of(&self, parts: &Parts) -> Option<Principal> {
        match self {
            Self::Bearer => {
                let value = single(parts, &AUTHORIZATION)?;
                let value = value.as_bytes();
                (!value.is_empty()).then(|| Principal::new(format!("sha256:{}", hex::encode(Sha256::digest(value)))))
            }
            Self::Header(name) => {
                let value = single(parts, name)?.to_str().ok()?.trim();
                (!value.is_empty() && value.len() <= MAX_HEADER_PRINCIPAL).then(|| Principal::new(value))
            }
        }
    }
}

fn single<'a>(parts: &'a Parts, name: &http::HeaderName) -> Option<&'a http::HeaderValue> {
    let mut values = parts.headers.get_all(name).iter();
    let first = values.next()?;
    values.next().is_none().then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut req = http::Request::builder().method("POST").uri("/x");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.body(()).expect("request").into_parts().0
    }

    #[test]
    fn bearer_principals_are_hashes_of_the_credentials() {
        let a = PrincipalSource::Bearer.principal_of(&parts(&[("authorization", "Bearer a")])).expect("a");
        let b = PrincipalSource::Bearer.principal_of(&parts(&[("authorization", "Bearer b")])).expect("b");
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("sha256:") && a.as_str().len() == 7 + 64, "{a}");
        assert!(!a.as_str().contains("Bearer"), "the credential is never kept");
        assert_eq!(PrincipalSource::Bearer.principal_of(&parts(&[])), None);
        assert_eq!(PrincipalSource::Bearer.principal_of(&parts(&[("authorization", "")])), None);
        let twice = parts(&[("authorization", "Bearer a"), ("authorization", "Bearer b")]);
        assert_eq!(PrincipalSource::Bearer.principal_of(&twice), None);
    }

    #[test]
    fn header_principals_are_the_trusted_headers_value() {
        let source: PrincipalSource = "header:x-user".parse().expect("valid");
        assert_eq!(source.principal_of(&parts(&[("x-user", " alice ")])), Some(Principal::new("alice")));
        assert_eq!(source.principal_of(&parts(&[("authorization", "Bearer a")])), None);
        assert_eq!(source.principal_of(&parts(&[("x-user", "")])), None);
        assert_eq!(source.principal_of(&parts(&[("x-user", &"a".repeat(257))])), None);
    }
}
