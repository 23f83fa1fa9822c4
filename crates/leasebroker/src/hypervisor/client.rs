//! The HTTP client leasebroker uses to drive a hypervisor (SPEC 3.3): the simulator or a real one.
//!
//! Its errors say whether the call may have taken effect downstream ([`HvError::may_have_happened`]),
//! because that decides what the service does with a pending intent: an ambiguous failure leaves it
//! pending for reconciliation by tag, only a definite one marks it failed.

use std::time::Duration;

use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use super::api::{BootRequest, SimStats, Vm, VmDetail, VmState};
use super::api::{RebootRequest, VmList};

/// The most of an error body kept in an [`HvError`], so a misbehaving hypervisor cannot bloat logs.
const MAX_ERROR_BODY: usize = 2048;

/// Why a hypervisor call failed.
///
/// The variants fall in two classes, told apart by [`HvError::may_have_happened`]: *definite*
/// failures, where the hypervisor certainly did nothing, and *ambiguous* ones, where the call may
/// have taken effect even though no answer came back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HvError {
    /// The base URL given to [`HypervisorClient::new`] is unusable. Definite.
    #[error("invalid hypervisor URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The request could not be built or no connection could be made (refused, unreachable, DNS,
    /// connect timeout): nothing was sent. Definite.
    #[error("could not reach the hypervisor: {0}")]
    Connect(#[source] reqwest::Error),
    /// No complete answer arrived within the per-call timeout. Ambiguous: the request may have
    /// been received and acted on.
    #[error("hypervisor call timed out: {0}")]
    Timeout(#[source] reqwest::Error),
    /// The connection failed after the request went out (reset, closed before or during the
    /// answer). Ambiguous.
    #[error("hypervisor connection failed mid-request: {0}")]
    Transport(#[source] reqwest::Error),
    /// The hypervisor answered with a status other than the one the call expects. A 4xx (such
    /// as 404 or 422) is a refusal and definite; anything else (any 5xx, 503 included, a redirect,
    /// an unknown success code) is ambiguous, since it says nothing reliable about whether the work
    /// was done.
    #[error("hypervisor answered {status}: {body}")]
    Status {
        /// The status.
        status: StatusCode,
        /// The start of the answer's body (empty if it could not be read).
        body: String,
    },
    /// A success status whose body could not be read as the expected JSON. Ambiguous: the work
    /// was done, but its result (the VM id) is unknown.
    #[error("could not decode the hypervisor's answer: {0}")]
    Decode(#[source] reqwest::Error),
}

impl HvError {
    /// Whether the call may have taken effect on the hypervisor despite the error.
    ///
    /// `false` only when the hypervisor certainly did nothing: the request was refused with a 4xx,
    /// or never left this process (bad URL, connection not established). Everything else (a
    /// timeout, a connection lost mid-request, any 5xx, an unreadable success) is `true`: the
    /// caller must reconcile before concluding the work did not happen.
    pub fn may_have_happened(&self) -> bool {
        match self {
            Self::InvalidUrl { .. } | Self::Connect(_) => false,
            Self::Status { status, .. } => !status.is_client_error(),
            Self::Timeout(_) | Self::Transport(_) | Self::Decode(_) => true,
        }
    }

    /// The HTTP status the hypervisor answered with, if it answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Status { status, .. } => Some(*status),
            Self::InvalidUrl { .. } | Self::Connect(_) | Self::Timeout(_) | Self::Transport(_) | Self::Decode(_) => {
                None
            }
        }
    }

    /// Classifies a transport-level error by whether the request could have reached the server.
    fn from_transport(err: reqwest::Error) -> Self {
        // Connect first: a connect timeout is also a timeout, but nothing was sent.
        if err.is_connect() || err.is_builder() {
            Self::Connect(err)
        } else if err.is_timeout() {
            Self::Timeout(err)
        } else if err.is_decode() {
            Self::Decode(err)
        } else {
            Self::Transport(err)
        }
    }
}

/// A client for one hypervisor, with a per-call timeout.
///
/// Cheap to clone (the connection pool is shared). Redirects are not followed: a hypervisor that
/// redirects a `POST` gets an ambiguous [`HvError::Status`] rather than a silently re-sent request.
#[derive(Debug, Clone)]
pub struct HypervisorClient {
    http: reqwest::Client,
    base: Url,
}

impl HypervisorClient {
    /// A client for the hypervisor at `base_url` (e.g. `http://127.0.0.1:8090`; a path prefix is
    /// kept), giving each call at most `timeout` from sending the request to reading the answer.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, HvError> {
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
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| invalid(&e.to_string()))?;
        Ok(Self { http, base })
    }

    /// Boots a VM (`POST /v1/vms`), stamping `req.tag` on it.
    pub async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        let response = self.send(Method::POST, &["v1", "vms"], None, Some(req)).await?;
        expect(response, StatusCode::CREATED).await
    }

    /// The VMs whose tag is exactly `tag` (`GET /v1/vms?tag=T`).
    pub async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "vms"], Some(tag), None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// Every VM (`GET /v1/vms`).
    pub async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "vms"], None, None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// One VM in full (`GET /v1/vms/{vm_id}`), or `None` when the hypervisor has no such VM.
    pub async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "vms", vm_id], None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        expect(response, StatusCode::OK).await.map(Some)
    }

    /// Reboots a VM (`POST /v1/vms/{vm_id}/reboot`), stamping `tag` on the reboot. A VM that does
    /// not exist is [`HvError::Status`] with `404` (definite).
    pub async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        let body = RebootRequest { tag: tag.to_owned() };
        let response = self.send(Method::POST, &["v1", "vms", vm_id, "reboot"], None, Some(&body)).await?;
        expect_status(response, StatusCode::ACCEPTED).await
    }

    /// Deletes a VM (`DELETE /v1/vms/{vm_id}`): `true` if it existed, `false` on `404`.
    pub async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        let response = self.send::<()>(Method::DELETE, &["v1", "vms", vm_id], None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        expect_status(response, StatusCode::NO_CONTENT).await.map(|()| true)
    }

    /// The simulator's counters (`GET /v1/stats`); a real hypervisor may not serve them.
    pub async fn stats(&self) -> Result<SimStats, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "stats"], None, None).await?;
        expect(response, StatusCode::OK).await
    }

    /// The base URL extended by `segments` (each percent-encoded, so an id cannot smuggle in a
    /// `/` or `?`), with an optional `tag` query.
    fn url(&self, segments: &[&str], tag: Option<&str>) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        if let Some(tag) = tag {
            url.query_pairs_mut().append_pair("tag", tag);
        }
        url
    }

    async fn send<B: Serialize>(
        &self,
        method: Method,
        segments: &[&str],
        tag: Option<&str>,
        body: Option<&B>,
    ) -> Result<reqwest::Response, HvError> {
        let url = self.url(segments, tag);
        let mut request = self.http.request(method.clone(), url);
        if let Some(body) = body {
            request = request.json(body);
        }
        let result = request.send().await;
        if let Err(err) = &result {
            tracing::debug!(%method, error = %err, "hypervisor call failed");
        }
        result.map_err(HvError::from_transport)
    }
}

/// Reads a `want` answer's JSON body, or turns any other answer into an error.
async fn expect<T: DeserializeOwned>(response: reqwest::Response, want: StatusCode) -> Result<T, HvError> {
    let response = check(response, want).await?;
    response.json().await.map_err(HvError::from_transport)
}

/// Checks for a `want` answer, reading (and dropping) its body so the connection can be reused and
/// a connection lost mid-body still counts as a failure.
async fn expect_status(response: reqwest::Response, want: StatusCode) -> Result<(), HvError> {
    let response = check(response, want).await?;
    response.bytes().await.map(drop).map_err(HvError::from_transport)
}

async fn check(response: reqwest::Response, want: StatusCode) -> Result<reqwest::Response, HvError> {
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
