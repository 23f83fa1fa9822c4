//! Key propagation (docs/protocol.md#records): the outgoing HTTP calls a protected handler makes carry
//! `Idempotency-Key: "<sub-key>"`, the record's derived sub-key for that call, so a downstream
//! that honours the header deduplicates the call natively when the handler runs again.

use std::borrow::Cow;

use http::{Extensions, HeaderValue};
use reqwest_middleware::{Middleware, Next};

use crate::context::IdempotencyContext;
use crate::headers::IDEMPOTENCY_KEY;

/// A [`reqwest_middleware`] middleware that adds `Idempotency-Key` to outgoing calls, in the
/// IETF draft's Structured Field String form (`"<sub-key>"`).
///
/// A call gets a key when it says which side effect it is: with [`SideEffect`] (the key is
/// [`IdempotencyContext::derive`]d from the protected request whose handler makes the call, the
/// same on every retry of that request), or with [`CallKey`] (a key derived earlier, say one
/// stored with an intent that a background task resumes). A call with neither, a call outside a
/// protected handler, and a call that sets `Idempotency-Key` itself go out unchanged: two calls
/// to one URL may be two side effects, so the middleware never guesses a name.
///
/// ```
/// use idempotency_tower::{PropagateIdempotencyKey, SideEffect};
///
/// # async fn handler() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(PropagateIdempotencyKey)
///     .build();
/// // Inside a protected handler: `Idempotency-Key: "<the record's sub-key for boot>"`.
/// client.post("http://hypervisor.internal/v1/vms").with_extension(SideEffect::new("boot")).send().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct PropagateIdempotencyKey;

/// Names the side effect an outgoing call performs; with [`PropagateIdempotencyKey`] its
/// `Idempotency-Key` is the current record's sub-key for that name. Set it with
/// `RequestBuilder::with_extension`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideEffect(Cow<'static, str>);

impl SideEffect {
    /// The side effect `name` (the label given to [`IdempotencyContext::derive`]).
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        Self(name.into())
    }
}

/// The sub-key an outgoing call carries as its `Idempotency-Key`, given outright (derived
/// earlier, e.g. the tag of a resumed intent); it wins over a [`SideEffect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallKey(String);

impl CallKey {
    /// The sub-key `key`.
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }
}

impl From<&idempotency::SubKey> for CallKey {
    fn from(key: &idempotency::SubKey) -> Self {
        Self(key.as_str().to_owned())
    }
}

#[async_trait::async_trait]
impl Middleware for PropagateIdempotencyKey {
    async fn handle(
        &self,
        mut req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        if !req.headers().contains_key(IDEMPOTENCY_KEY)
            && let Some(value) = key_for(extensions).as_deref().and_then(key_header)
        {
            req.headers_mut().insert(IDEMPOTENCY_KEY, value);
        }
        next.run(req, extensions).await
    }
}

/// The call's sub-key: given outright, or derived for its side effect from the current record.
fn key_for(extensions: &Extensions) -> Option<String> {
    if let Some(CallKey(key)) = extensions.get::<CallKey>() {
        return Some(key.clone());
    }
    let SideEffect(name) = extensions.get::<SideEffect>()?;
    IdempotencyContext::current().map(|ctx| ctx.derive(name).as_str().to_owned())
}

/// `key` as an RFC 9651 String (`"..."`, with `\` and `"` escaped): the form the IETF draft
/// gives `Idempotency-Key`. `None` for a key a String cannot hold (a control or non-ASCII
/// character), which then is not sent.
pub fn key_header(key: &str) -> Option<HeaderValue> {
    if key.is_empty() || !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return None;
    }
    let mut quoted = String::with_capacity(key.len() + 2);
    quoted.push('"');
    for c in key.chars() {
        if matches!(c, '"' | '\\') {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    HeaderValue::from_str(&quoted).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_sent_as_structured_field_strings_that_parse_back() {
        for key in ["wkr-1.boot", r#"a"b\c"#, "~!@#$%^&*()"] {
            let value = key_header(key).expect("a header");
            assert!(value.as_bytes().starts_with(b"\""), "{value:?}");
            let parsed = idempotency::IdempotencyKey::parse_header(value.as_bytes()).expect("parses back");
            assert_eq!(parsed.as_str(), key);
        }
        assert_eq!(key_header(""), None);
        assert_eq!(key_header("tab\there"), None);
        assert_eq!(key_header("é"), None);
    }
}
