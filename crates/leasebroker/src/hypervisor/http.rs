//! What every HTTP backend of the hypervisor and the BMC shares: a client built from a base URL
//! (its timeout, TLS roots, no redirects, the key propagation), and the reading of an answer's
//! status into an [`HvError`].

use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::HvError;

/// The most of an error body kept in an [`HvError`], so a misbehaving hypervisor cannot bloat logs.
const MAX_ERROR_BODY: usize = 2048;

/// An HTTP service's base URL and the client that calls it. Cheap to clone (the pool is shared).
#[derive(Debug, Clone)]
pub(super) struct Endpoint {
    /// The HTTP client with the key propagation: a boot, reboot or flash carries its tag (the
    /// derived sub-key) as `Idempotency-Key: "<tag>"`, so a service that honours the header
    /// deduplicates it natively.
    pub(super) keyed: reqwest_middleware::ClientWithMiddleware,
    pub(super) base: Url,
}

impl Endpoint {
    /// The endpoint at `base_url` (`http` or `https`, with a host, without a query), giving each
    /// call at most `timeout`, sending `headers` on every call, trusting `ca_cert` (PEM) besides
    /// the system's roots, and keeping an idle connection at most `pool_idle` when given.
    pub(super) fn new(
        base_url: &str,
        timeout: Duration,
        headers: reqwest::header::HeaderMap,
        ca_cert: Option<&Path>,
        pool_idle: Option<Duration>,
    ) -> Result<Self, HvError> {
        let roots = match ca_cert {
            Some(path) => {
                let invalid = |reason: String| HvError::InvalidCaCert { path: path.to_path_buf(), reason };
                let pem = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
                let roots = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| invalid(e.to_string()))?;
                if roots.is_empty() {
                    return Err(invalid("no PEM CERTIFICATE block found".to_owned()));
                }
                roots
            }
            None => Vec::new(),
        };
        let invalid = |reason: &str| HvError::InvalidUrl { url: base_url.to_owned(), reason: reason.to_owned() };
        let base = Url::parse(base_url).map_err(|e| invalid(&e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https"));
        }
        if base.cannot_be_a_base() || base.host().is_none() {
            return Err(invalid("the URL has no host"));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(invalid("the URL must not have a query or fragment"));
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .tls_backend_rustls();
        let http = match pool_idle {
            Some(idle) => http.pool_idle_timeout(idle),
            None => http,
        };
        // Redirects are off, so an http hypervisor never needs TLS: skip loading the system's roots
        // (a host without them can still use one).
        let http = if base.scheme() == "https" { http.tls_certs_merge(roots) } else { http.tls_certs_only(roots) }
            .build()
            .map_err(|e| invalid(&e.to_string()))?;
        let keyed =
            reqwest_middleware::ClientBuilder::new(http).with(idempotency_tower::PropagateIdempotencyKey).build();
        Ok(Self { keyed, base })
    }

    /// The base URL extended by `segments` (each percent-encoded, so an id cannot smuggle in a
    /// `/` or `?`), with an optional `tag` query.
    pub(super) fn url(&self, segments: &[&str], tag: Option<&str>) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        if let Some(tag) = tag {
            url.query_pairs_mut().append_pair("tag", tag);
        }
        url
    }

    /// One call; `key` (a side effect's tag, its derived sub-key) goes out as its
    /// `Idempotency-Key` through the key propagation middleware.
    pub(super) async fn send<B: Serialize>(
        &self,
        method: Method,
        segments: &[&str],
        tag: Option<&str>,
        body: Option<&B>,
        key: Option<&str>,
    ) -> Result<reqwest::Response, HvError> {
        let url = self.url(segments, tag);
        let mut request = self.keyed.request(method.clone(), url);
        if let Some(body) = body {
            request = request.json(body);
        }
        if let Some(key) = key {
            request = request.with_extension(idempotency_tower::CallKey::new(key));
        }
        // One span per downstream call (target `leasebroker::downstream`, exported as a trace's
        // child span): the method and the route's first segment, never the URL (credentials).
        let span = tracing::info_span!(
            target: "leasebroker::downstream",
            "hypervisor.call",
            otel.name = %format!("{method} hypervisor /{}", segments.first().copied().unwrap_or("")),
            otel.kind = "client",
            http.request.method = %method,
            http.response.status_code = tracing::field::Empty,
        );
        let result = tracing::Instrument::instrument(request.send(), span.clone()).await;
        if let Ok(response) = &result {
            span.record("http.response.status_code", response.status().as_u16());
        }
        if let Err(err) = &result {
            // reqwest's error names the URL, which may carry credentials.
            tracing::debug!(%method, error = %crate::db::redact(&err.to_string()), "hypervisor call failed");
        }
        result.map_err(HvError::from_middleware)
    }
}

/// Reads a `want` answer's JSON body, or turns any other answer into an error.
pub(super) async fn expect<T: DeserializeOwned>(response: reqwest::Response, want: StatusCode) -> Result<T, HvError> {
    let response = check(response, want).await?;
    response.json().await.map_err(HvError::from_transport)
}

/// Reads a success (any `2xx`) answer's JSON body, or turns any other answer into an error.
pub(super) async fn expect_success<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, HvError> {
    let response = check_success(response).await?;
    response.json().await.map_err(HvError::from_transport)
}

/// Checks for a success (any `2xx`) answer, reading (and dropping) its body whatever it holds.
pub(super) async fn expect_success_status(response: reqwest::Response) -> Result<(), HvError> {
    let response = check_success(response).await?;
    response.bytes().await.map(drop).map_err(HvError::from_transport)
}

/// The answer when it is a success (any `2xx`), or an [`HvError::Status`] with its body.
pub(super) async fn check_success(response: reqwest::Response) -> Result<reqwest::Response, HvError> {
    let status = response.status();
    check(response, if status.is_success() { status } else { StatusCode::OK }).await
}

/// The answer when its status is `want`, or an [`HvError::Status`] with (the start of) its body.
pub(super) async fn check(response: reqwest::Response, want: StatusCode) -> Result<reqwest::Response, HvError> {
    let status = response.status();
    if status == want {
        return Ok(response);
    }
    // The body is only for the message; failing to read it does not change the class.
    let mut body = response.text().await.unwrap_or_default();
    if body.len() > MAX_ERROR_BODY {
        let mut end = MAX_ERROR_BODY;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
        body.truncate(end);
    }
    Err(HvError::Status { status, body })
}
