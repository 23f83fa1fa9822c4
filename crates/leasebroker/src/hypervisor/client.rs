//! The HTTP client leasebroker uses to drive a hypervisor (SPEC 3.3): the simulator or a real one.
//!
//! Its errors say whether the call may have taken effect downstream ([`HvError::may_have_happened`]),
//! because that decides what the service does with a pending intent: an ambiguous failure leaves it
//! pending for reconciliation by tag, only a definite one marks it failed.

use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use super::api::{BmcNode, BmcState, BootRequest, FlashRequest, SimStats, Vm, VmDetail, VmState};
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
    /// A setting of a BMC backend is unusable (`--bmc-url`, `--firmware-images`). Definite.
    #[error("{flag} {value:?}: {reason}")]
    InvalidSetting {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The CA certificate file given to [`HypervisorClient::with_ca_cert`] is unusable. Definite.
    #[error("hypervisor CA certificate {}: {reason}", path.display())]
    InvalidCaCert {
        /// The file as given.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The request could not be built or no connection could be made (refused, unreachable, DNS,
    /// connect timeout): nothing was sent. Definite.
    #[error("could not reach the hypervisor")]
    Connect(#[source] reqwest::Error),
    /// No complete answer arrived within the per-call timeout. Ambiguous: the request may have
    /// been received and acted on.
    #[error("hypervisor call timed out")]
    Timeout(#[source] reqwest::Error),
    /// The connection failed after the request went out (reset, closed before or during the
    /// answer). Ambiguous.
    #[error("hypervisor connection failed mid-request")]
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
    #[error("could not decode the hypervisor's answer")]
    Decode(#[source] reqwest::Error),
    /// A client middleware failed the call (the key propagation never does). Ambiguous: where in
    /// the chain it failed is not known.
    #[error("hypervisor call failed in the client: {message}")]
    Middleware {
        /// The middleware's message.
        message: String,
    },
    /// A libvirt call failed (`--hypervisor-url libvirt+...`). Definite when libvirt refused it
    /// before acting (no such domain, an invalid definition, no connection); ambiguous when the
    /// connection was lost mid-call, the call timed out, or libvirt failed inside.
    #[error("{message}")]
    Libvirt {
        /// libvirt's message (bounded).
        message: String,
        /// The HTTP status the refusal stands for (404: no such domain; 422: a definition
        /// libvirt refused), so the service answers as it would for the HTTP hypervisor.
        status: Option<StatusCode>,
        /// Whether libvirt certainly did nothing.
        definite: bool,
    },
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
            Self::InvalidUrl { .. } | Self::InvalidSetting { .. } | Self::InvalidCaCert { .. } | Self::Connect(_) => {
                false
            }
            Self::Status { status, .. } => !status.is_client_error(),
            Self::Timeout(_) | Self::Transport(_) | Self::Decode(_) | Self::Middleware { .. } => true,
            Self::Libvirt { definite, .. } => !definite,
        }
    }

    /// The HTTP status the hypervisor answered with, if it answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Status { status, .. } => Some(*status),
            Self::Libvirt { status, .. } => *status,
            Self::InvalidUrl { .. }
            | Self::InvalidSetting { .. }
            | Self::InvalidCaCert { .. }
            | Self::Connect(_)
            | Self::Timeout(_)
            | Self::Transport(_)
            | Self::Decode(_)
            | Self::Middleware { .. } => None,
        }
    }

    /// Classifies an error of the client with middleware like [`HvError::from_transport`].
    pub(super) fn from_middleware(err: reqwest_middleware::Error) -> Self {
        match err {
            reqwest_middleware::Error::Reqwest(err) => Self::from_transport(err),
            reqwest_middleware::Error::Middleware(err) => Self::Middleware { message: format!("{err:#}") },
        }
    }

    /// Classifies a transport-level error by whether the request could have reached the server.
    pub(super) fn from_transport(err: reqwest::Error) -> Self {
        // Connect first: a connect timeout is also a timeout, but nothing was sent. A failed TLS
        // handshake (an untrusted certificate) is part of connecting, so it lands here too.
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
/// An `https` hypervisor is verified with rustls against the system's roots and, with
/// [`HypervisorClient::with_ca_cert`], a private CA.
#[derive(Debug, Clone)]
pub struct HypervisorClient {
    /// The HTTP client with the key propagation: a boot, reboot or flash carries its tag (the derived
    /// sub-key) as `Idempotency-Key: "<tag>"`, so a hypervisor that honours the header
    /// deduplicates it natively.
    keyed: reqwest_middleware::ClientWithMiddleware,
    base: Url,
    /// Where the VMs live when not behind the HTTP API: a libvirt host.
    #[cfg(feature = "libvirt")]
    libvirt: Option<super::libvirt::LibvirtVms>,
    /// Where the BMCs are when not behind the HTTP API: a Redfish service.
    redfish: Option<super::redfish::RedfishBmc>,
}

impl HypervisorClient {
    /// A client for the hypervisor at `base_url` (e.g. `http://127.0.0.1:8090`; a path prefix is
    /// kept), giving each call at most `timeout` from sending the request to reading the answer.
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, HvError> {
        Self::build(base_url, timeout, reqwest::header::HeaderMap::new(), None, None)
    }

    /// Like [`HypervisorClient::new`], sending `headers` on every call (say, the secret of a
    /// simulator that only its own service may use), and keeping an idle connection at most
    /// `pool_idle` (shorter than the server's own keep-alive limit, so the client never reuses a
    /// connection the server is closing).
    pub fn with_headers(
        base_url: &str,
        timeout: Duration,
        headers: reqwest::header::HeaderMap,
        pool_idle: Duration,
    ) -> Result<Self, HvError> {
        Self::build(base_url, timeout, headers, None, Some(pool_idle))
    }

    /// [`HypervisorClient::new`], also trusting the CA certificates in the PEM file `ca_cert` (when
    /// given) for an `https` hypervisor, besides the system's roots.
    pub fn with_ca_cert(base_url: &str, timeout: Duration, ca_cert: Option<&Path>) -> Result<Self, HvError> {
        Self::build(base_url, timeout, reqwest::header::HeaderMap::new(), ca_cert, None)
    }

    fn build(
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
        let keyed = reqwest_middleware::ClientBuilder::new(http.clone())
            .with(idempotency_tower::PropagateIdempotencyKey)
            .build();
        Ok(Self {
            keyed,
            base,
            #[cfg(feature = "libvirt")]
            libvirt: None,
            redfish: None,
        })
    }

    /// This client with its BMCs behind a Redfish service instead of the HTTP API's `/v1/bmc`
    /// (the VM calls stay where they were). The firmware flow asks [`HypervisorClient::redfish`]
    /// which one to drive.
    pub fn with_redfish(mut self, bmc: super::redfish::RedfishBmc) -> Self {
        self.redfish = Some(bmc);
        self
    }

    /// The Redfish BMC the flashes go to, when one was given (`--bmc-url redfish+...`).
    pub fn redfish(&self) -> Option<&super::redfish::RedfishBmc> {
        self.redfish.as_ref()
    }

    /// The HTTP client (its timeout, TLS roots and no-redirect policy) with the key propagation
    /// middleware.
    pub(super) fn keyed(&self) -> &reqwest_middleware::ClientWithMiddleware {
        &self.keyed
    }

    /// This client with its VMs on a libvirt host instead of the HTTP API's `/v1/vms` (the BMC
    /// calls still go to the HTTP API).
    #[cfg(feature = "libvirt")]
    pub fn with_libvirt(mut self, vms: super::libvirt::LibvirtVms) -> Self {
        self.libvirt = Some(vms);
        self
    }

    /// Boots a VM (`POST /v1/vms`), stamping `req.tag` on it. Any `2xx` is success; of its body
    /// only `vm_id` is read (the tag is the one sent, and the VM runs).
    pub async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.boot(req).await;
        }
        #[derive(serde::Deserialize)]
        struct Booted {
            vm_id: String,
        }
        let response = self.send(Method::POST, &["v1", "vms"], None, Some(req), Some(&req.tag)).await?;
        let booted: Booted = expect_success(response).await?;
        Ok(Vm { vm_id: booted.vm_id, tag: req.tag.clone(), state: VmState::Running })
    }

    /// The VMs whose tag is exactly `tag` (`GET /v1/vms?tag=T`).
    pub async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.list_by_tag(tag).await;
        }
        let response = self.send::<()>(Method::GET, &["v1", "vms"], Some(tag), None, None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// Every VM (`GET /v1/vms`).
    pub async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.list_all().await;
        }
        let response = self.send::<()>(Method::GET, &["v1", "vms"], None, None, None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// One VM in full (`GET /v1/vms/{vm_id}`), or `None` when the hypervisor has no such VM.
    pub async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.get(vm_id).await;
        }
        let response = self.send::<()>(Method::GET, &["v1", "vms", vm_id], None, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        expect(response, StatusCode::OK).await.map(Some)
    }

    /// Makes an adopted VM run. A VM the HTTP API lists was booted by one call that started it,
    /// so there is nothing to do; on libvirt a boot is a define and then a start, and a domain
    /// listed `stopped` under a boot's tag is one whose start never ran: it is started.
    pub async fn ensure_running(&self, vm: &Vm) -> Result<(), HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt
            && vm.state == VmState::Stopped
        {
            return vms.start(&vm.vm_id).await;
        }
        let _ = vm;
        Ok(())
    }

    /// [`HypervisorClient::ensure_running`] of the VM `vm_id`, read first (on libvirt only:
    /// elsewhere there is nothing to do and nothing is called).
    pub async fn ensure_running_by_id(&self, vm_id: &str) -> Result<(), HvError> {
        #[cfg(feature = "libvirt")]
        if self.libvirt.is_some()
            && let Some(vm) = self.get(vm_id).await?
        {
            return self.ensure_running(&vm.summary()).await;
        }
        let _ = vm_id;
        Ok(())
    }

    /// Reboots a VM (`POST /v1/vms/{vm_id}/reboot`), stamping `tag` on the reboot; any `2xx` is
    /// success. A VM that does not exist is [`HvError::Status`] with `404` (definite).
    pub async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.reboot(vm_id, tag).await;
        }
        let body = RebootRequest { tag: tag.to_owned() };
        let response = self.send(Method::POST, &["v1", "vms", vm_id, "reboot"], None, Some(&body), Some(tag)).await?;
        expect_success_status(response).await
    }

    /// Deletes a VM (`DELETE /v1/vms/{vm_id}`): `true` if it existed (any `2xx`), `false` on `404`.
    pub async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        #[cfg(feature = "libvirt")]
        if let Some(vms) = &self.libvirt {
            return vms.delete(vm_id).await;
        }
        let response = self.send::<()>(Method::DELETE, &["v1", "vms", vm_id], None, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        expect_success_status(response).await.map(|()| true)
    }

    /// Starts a firmware flash on the BMC of `node_id` (`POST /v1/bmc/{node_id}/flash`), stamping
    /// `req.tag` on it. The BMC answers `202` as the flash starts; it writes on after that. Any
    /// `2xx` is success, whatever its body holds or lacks: the contract promises nothing more.
    pub async fn flash(&self, node_id: &str, req: &FlashRequest) -> Result<(), HvError> {
        let response =
            self.send(Method::POST, &["v1", "bmc", node_id, "flash"], None, Some(req), Some(&req.tag)).await?;
        expect_success_status(response).await
    }

    /// The BMC of `node_id` (`GET /v1/bmc/{node_id}`), or `None` when it has no such node.
    pub async fn bmc(&self, node_id: &str) -> Result<Option<BmcNode>, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "bmc", node_id], None, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        expect(response, StatusCode::OK).await.map(Some)
    }

    /// How many BMCs hold the tag `tag` among their flashes (`GET /v1/bmc?tag=T`). Only the
    /// list's length is read, not what each entry holds.
    pub async fn bmcs_by_tag(&self, tag: &str) -> Result<usize, HvError> {
        #[derive(serde::Deserialize)]
        struct Holding {
            nodes: Vec<serde::de::IgnoredAny>,
        }
        let response = self.send::<()>(Method::GET, &["v1", "bmc"], Some(tag), None, None).await?;
        Ok(expect::<Holding>(response, StatusCode::OK).await?.nodes.len())
    }

    /// The simulator's counters (`GET /v1/stats`); a real hypervisor may not serve them.
    pub async fn stats(&self) -> Result<SimStats, HvError> {
        let response = self.send::<()>(Method::GET, &["v1", "stats"], None, None, None).await?;
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

    /// One call; `key` (a side effect's tag, its derived sub-key) goes out as its
    /// `Idempotency-Key` through the key propagation middleware.
    async fn send<B: Serialize>(
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
async fn expect<T: DeserializeOwned>(response: reqwest::Response, want: StatusCode) -> Result<T, HvError> {
    let response = check(response, want).await?;
    response.json().await.map_err(HvError::from_transport)
}

/// Reads a success (any `2xx`) answer's JSON body, or turns any other answer into an error.
async fn expect_success<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, HvError> {
    let response = check_success(response).await?;
    response.json().await.map_err(HvError::from_transport)
}

/// Checks for a success (any `2xx`) answer, reading (and dropping) its body whatever it holds.
async fn expect_success_status(response: reqwest::Response) -> Result<(), HvError> {
    let response = check_success(response).await?;
    response.bytes().await.map(drop).map_err(HvError::from_transport)
}

pub(super) async fn check_success(response: reqwest::Response) -> Result<reqwest::Response, HvError> {
    let status = response.status();
    check(response, if status.is_success() { status } else { StatusCode::OK }).await
}

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

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;

    use super::*;
    use crate::hypervisor::sim::{SimConfig, Simulator, serve};

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// Serves a fresh simulator on an ephemeral loopback port, with a client for it.
    async fn start(config: SimConfig) -> (Simulator, HypervisorClient) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let sim = Simulator::new(config);
        tokio::spawn(serve(listener, sim.clone(), std::future::pending()));
        (sim, HypervisorClient::new(&url, TIMEOUT).expect("client"))
    }

    fn boot_req(tag: &str) -> BootRequest {
        BootRequest { image: "debian-13".into(), cpu: 8, memory_gb: 32, tag: tag.into() }
    }

    #[tokio::test]
    async fn boot_list_get_reboot_delete_round_trip() {
        let (sim, client) = start(SimConfig::default()).await;
        let vm = client.boot(&boot_req("boot-1")).await.expect("boot");
        assert_eq!(vm.tag, "boot-1");
        assert_eq!(vm.state, VmState::Running);
        assert!(vm.state == "running");
        let other = client.boot(&boot_req("boot-2")).await.expect("boot");
        assert_ne!(vm.vm_id, other.vm_id);

        assert_eq!(client.list_by_tag("boot-1").await.expect("list"), std::slice::from_ref(&vm));
        assert!(client.list_by_tag("boot-3").await.expect("list").is_empty());
        assert_eq!(client.list_all().await.expect("list"), [vm.clone(), other.clone()]);

        client.reboot(&vm.vm_id, "reboot-1").await.expect("reboot");
        let detail = client.get(&vm.vm_id).await.expect("get").expect("exists");
        assert_eq!(detail.summary(), vm);
        assert_eq!(detail.reboot_tags, ["reboot-1"]);
        assert_eq!((detail.image.as_deref(), detail.cpu, detail.memory_gb), (Some("debian-13"), Some(8), Some(32)));

        assert!(client.delete(&vm.vm_id).await.expect("delete"), "it existed");
        assert!(!client.delete(&vm.vm_id).await.expect("delete again"), "already gone");
        assert_eq!(client.get(&vm.vm_id).await.expect("get"), None);
        assert_eq!(client.list_all().await.expect("list"), [other]);

        let stats = client.stats().await.expect("stats");
        assert_eq!(stats, sim.stats());
        assert_eq!((stats.boots_total, stats.running, stats.reboots_total), (2, 1, 1));
    }

    #[tokio::test]
    async fn stats_count_a_repeated_boot_tag_and_a_repeated_reboot_tag() {
        let (_sim, client) = start(SimConfig::default()).await;
        let vm = client.boot(&boot_req("same")).await.expect("boot");
        client.boot(&boot_req("same")).await.expect("boot");
        client.reboot(&vm.vm_id, "r").await.expect("reboot");
        client.reboot(&vm.vm_id, "r").await.expect("reboot");
        let stats = client.stats().await.expect("stats");
        assert_eq!(
            stats,
            SimStats {
                boots_total: 2,
                running: 2,
                duplicate_boot_tags: 1,
                reboots_total: 2,
                duplicate_reboot_tags: 1,
                // Each call carried its tag as its Idempotency-Key (key propagation).
                tag_keyed_calls: 4,
                ..SimStats::default()
            }
        );
    }

    /// Key propagation (SPEC 1.3): a boot, a reboot and a flash each carry their tag as
    /// `Idempotency-Key: "<tag>"`, which the simulator counts; reads carry none, and a call
    /// made without the client (no header) is not counted.
    #[tokio::test]
    async fn boot_reboot_and_flash_carry_their_tag_as_their_idempotency_key() {
        let (sim, client) = start(SimConfig::default()).await;
        let vm = client.boot(&boot_req("wkr-1.boot")).await.expect("boot");
        client.reboot(&vm.vm_id, "wkr-1.reboot").await.expect("reboot");
        let flash = FlashRequest { version: "2.0.1".into(), tag: "node-1.flash".into() };
        client.flash("node-1", &flash).await.expect("flash");
        client.list_by_tag("wkr-1.boot").await.expect("list");
        assert_eq!(sim.stats().tag_keyed_calls, 3, "{:?}", sim.stats());
        let url = client.base.as_str().trim_end_matches('/').to_owned();
        let raw =
            reqwest::Client::new().post(format!("{url}/v1/vms")).json(&boot_req("raw")).send().await.expect("raw boot");
        assert_eq!(raw.status(), StatusCode::CREATED);
        // A bare key is not the structured field string form: not counted either.
        let bare = reqwest::Client::new()
            .post(format!("{url}/v1/vms"))
            .header("idempotency-key", "bare")
            .json(&boot_req("bare"))
            .send()
            .await
            .expect("bare boot");
        assert_eq!(bare.status(), StatusCode::CREATED);
        let stats = sim.stats();
        assert_eq!((stats.boots_total, stats.reboots_total, stats.flashes_total), (3, 1, 1), "{stats:?}");
        assert_eq!(stats.tag_keyed_calls, 3, "{stats:?}");
    }

    #[tokio::test]
    async fn fail_before_is_an_ambiguous_5xx_and_nothing_boots() {
        let (sim, client) = start(SimConfig { fail_before: 1.0, ..SimConfig::default() }).await;
        let err = client.boot(&boot_req("fb")).await.expect_err("503");
        assert!(matches!(err, HvError::Status { status: StatusCode::SERVICE_UNAVAILABLE, .. }), "{err:?}");
        assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
        assert!(err.may_have_happened(), "a 5xx says nothing about whether the work was done");
        assert_eq!(sim.stats().boots_total, 0);
        assert!(client.list_by_tag("fb").await.expect("reads are not faulted").is_empty());
    }

    #[tokio::test]
    async fn fail_after_is_ambiguous_and_the_vm_exists() {
        let (sim, client) = start(SimConfig { fail_after: 1.0, ..SimConfig::default() }).await;
        let err = client.boot(&boot_req("fa")).await.expect_err("answer lost");
        assert!(matches!(err, HvError::Transport(_)), "{err:?}");
        assert_eq!(err.status(), None);
        assert!(err.may_have_happened());
        let found = client.list_by_tag("fa").await.expect("list");
        assert_eq!(found.len(), 1, "the boot happened: reconciliation by tag finds it");

        // The same holds for reboot and delete: done, then the answer is lost.
        let vm_id = found[0].vm_id.clone();
        let err = client.reboot(&vm_id, "r").await.expect_err("answer lost");
        assert!(err.may_have_happened(), "{err:?}");
        assert_eq!(sim.stats().reboots_total, 1);
        let err = client.delete(&vm_id).await.expect_err("answer lost");
        assert!(err.may_have_happened(), "{err:?}");
        assert_eq!(sim.stats().running, 0);
    }

    #[tokio::test]
    async fn a_timeout_is_ambiguous() {
        // The client's timeout leaves a busy machine time to send the request; the latency makes
        // sure the answer comes after it.
        let (sim, patient) = start(SimConfig { latency: Duration::from_millis(2000), ..SimConfig::default() }).await;
        let client = HypervisorClient::new(patient.base.as_str(), Duration::from_millis(500)).expect("client");
        let err = client.boot(&boot_req("slow")).await.expect_err("timeout");
        assert!(matches!(err, HvError::Timeout(_)), "{err:?}");
        assert!(err.may_have_happened());
        // And it does happen, after the client gave up (polled: the machine may be busy).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while sim.stats().boots_total == 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(sim.stats().boots_total, 1);
    }

    #[tokio::test]
    async fn connection_refused_is_definite() {
        // Bind then drop a listener so the port has nothing listening on it.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let client = HypervisorClient::new(&format!("http://{addr}"), TIMEOUT).expect("client");
        let err = client.boot(&boot_req("nowhere")).await.expect_err("refused");
        assert!(matches!(err, HvError::Connect(_)), "{err:?}");
        assert!(!err.may_have_happened());
        let err = client.list_by_tag("nowhere").await.expect_err("refused");
        assert!(!err.may_have_happened(), "{err:?}");
    }

    /// A downstream that answers each call with another success than the simulator and only
    /// what the contract promises (issue 24, hole 5): every call succeeds.
    #[tokio::test]
    async fn terse_successes_are_successes() {
        use axum::routing::{delete, get, post};
        let app = axum::Router::new()
            .route("/v1/vms", post(|| async { (StatusCode::OK, axum::Json(serde_json::json!({"vm_id": "vm-1"}))) }))
            .route("/v1/vms/{vm_id}/reboot", post(|| async { StatusCode::NO_CONTENT }))
            .route("/v1/vms/{vm_id}", delete(|| async { (StatusCode::OK, "deleted") }))
            .route("/v1/bmc/{node}/flash", post(|| async { (StatusCode::ACCEPTED, "{\"node_id\":\"n\"}") }))
            .route("/v1/bmc", get(|| async { axum::Json(serde_json::json!({"nodes": [{"node_id": "n"}]})) }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = HypervisorClient::new(&url, TIMEOUT).expect("client");
        let vm = client.boot(&boot_req("t")).await.expect("a 200 with only vm_id is a boot");
        assert_eq!((vm.vm_id.as_str(), vm.tag.as_str()), ("vm-1", "t"));
        client.reboot("vm-1", "r").await.expect("a 204 is a reboot");
        assert!(client.delete("vm-1").await.expect("a 200 is a delete"));
        client.flash("n", &FlashRequest { version: "2".into(), tag: "f".into() }).await.expect("a terse 202");
        assert_eq!(client.bmcs_by_tag("f").await.expect("a terse listing"), 1);
    }

    #[tokio::test]
    async fn refusals_are_definite_and_a_missing_vm_is_none() {
        let (sim, client) = start(SimConfig::default()).await;
        assert_eq!(client.get("vm-0123456789abcdef").await.expect("get"), None);
        // An id that would escape its path segment is encoded, not routed elsewhere.
        assert_eq!(client.get("x/reboot").await.expect("get"), None);

        let err = client.reboot("vm-0123456789abcdef", "r").await.expect_err("404");
        assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
        assert!(!err.may_have_happened());

        let err = client.boot(&BootRequest { cpu: 0, ..boot_req("bad") }).await.expect_err("422");
        assert!(matches!(&err, HvError::Status { status, body } if *status == 422 && body.contains("cpu")), "{err:?}");
        assert!(!err.may_have_happened());
        assert_eq!(sim.stats(), SimStats::default());
    }

    #[test]
    fn only_4xx_statuses_are_definite() {
        let status =
            |code: u16| HvError::Status { status: StatusCode::from_u16(code).expect("code"), body: String::new() };
        for code in [400, 404, 409, 422, 429] {
            assert!(!status(code).may_have_happened(), "{code}");
        }
        for code in [200, 302, 500, 502, 503, 504] {
            assert!(status(code).may_have_happened(), "{code}");
        }
    }

    #[test]
    fn unusable_base_urls_are_rejected_up_front() {
        for url in ["", "not a url", "ftp://host", "mailto:a@b", "http://host/?q=1"] {
            let err = HypervisorClient::new(url, TIMEOUT).expect_err(url);
            assert!(matches!(err, HvError::InvalidUrl { .. }), "{url}: {err:?}");
            assert!(!err.may_have_happened());
        }
        assert!(HypervisorClient::new("http://127.0.0.1:8090/", TIMEOUT).is_ok());
    }

    /// Serves a fresh simulator over TLS on an ephemeral loopback port, with a certificate for
    /// 127.0.0.1 from a fresh private CA: its URL, the simulator and the CA's PEM file.
    async fn start_tls(dir: &Path) -> (String, Simulator, std::path::PathBuf) {
        start_tls_with(dir, Simulator::new(SimConfig::default())).await
    }

    /// [`start_tls`] with a given simulator.
    async fn start_tls_with(dir: &Path, sim: Simulator) -> (String, Simulator, std::path::PathBuf) {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().expect("key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "hypervisor test CA");
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().expect("key");
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("params")
            .signed_by(&leaf_key, &issuer)
            .expect("leaf");
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, ca_cert.pem()).expect("write CA");
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(leaf_key.serialize_der());
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone()], key.into())
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));

        // The simulator on a plain port, behind a TLS-terminating proxy.
        let plain = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = plain.local_addr().expect("addr");
        tokio::spawn(serve(plain, sim.clone(), std::future::pending()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("https://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut plain) = tokio::net::TcpStream::connect(upstream).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        (url, sim, ca_file)
    }

    #[tokio::test]
    async fn an_https_hypervisor_works_with_its_ca_and_an_untrusted_one_is_definite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (url, sim, ca_file) = start_tls(dir.path()).await;
        let client = HypervisorClient::with_ca_cert(&url, TIMEOUT, Some(&ca_file)).expect("client");
        let vm = client.boot(&boot_req("tls-1")).await.expect("boot over https");
        assert_eq!(client.list_by_tag("tls-1").await.expect("list"), [vm]);

        // Without the CA the handshake fails: nothing was sent, so it is definite.
        let untrusted = HypervisorClient::new(&url, TIMEOUT).expect("client");
        let err = untrusted.boot(&boot_req("tls-2")).await.expect_err("untrusted certificate");
        assert!(matches!(err, HvError::Connect(_)), "{err:?}");
        assert!(!err.may_have_happened());
        assert_eq!(sim.stats().boots_total, 1);

        for bad in [Path::new("/dev/null"), &dir.path().join("missing.pem")] {
            let err = HypervisorClient::with_ca_cert(&url, TIMEOUT, Some(bad)).expect_err("not a CA file");
            assert!(matches!(err, HvError::InvalidCaCert { .. }), "{err:?}");
        }
    }

    /// `--bmc-url redfish+https://...` with `--bmc-ca-cert`: the same TLS as the hypervisor's.
    #[tokio::test]
    async fn a_redfish_bmc_over_https_works_with_its_ca_and_an_untrusted_one_is_definite() {
        use crate::hypervisor::redfish::{RedfishBmc, Target, TaskLookup, TaskOutcome};
        use crate::hypervisor::sim::RedfishOptions;
        let dir = tempfile::tempdir().expect("tempdir");
        let sim = Simulator::new(SimConfig::default())
            .with_flash_time(Duration::from_millis(200))
            .with_redfish(RedfishOptions { systems: 2, ..RedfishOptions::default() });
        let (url, sim, ca_file) = start_tls_with(dir.path(), sim).await;
        let bmc_url = format!("redfish+{url}");
        let images = "https://images.test/fw";
        let bmc = RedfishBmc::new(&bmc_url, TIMEOUT, Some(&ca_file), images).expect("client");
        let target = bmc.target("node-0002").await.expect("systems over https");
        assert_eq!(target, Target::System("/redfish/v1/Systems/node-0002".into()));
        bmc.flash(&target, "4.2", "tls-flash").await.expect("flash over https");
        let TaskLookup::Found(task) = bmc.find_task("tls-flash").await.expect("tasks") else { panic!("remembered") };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while bmc.task_outcome(&task).await.expect("task") == TaskOutcome::Running {
            assert!(tokio::time::Instant::now() < deadline, "the flash did not end");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(bmc.runs_version(&target, "node-0002", "4.2").await.expect("inventory"));

        let untrusted = RedfishBmc::new(&bmc_url, TIMEOUT, None, images).expect("client");
        let err = untrusted.flash(&target, "4.3", "tls-untrusted").await.expect_err("untrusted certificate");
        assert!(matches!(err, HvError::Connect(_)), "{err:?}");
        assert!(!err.may_have_happened());
        assert_eq!(sim.stats().flashes_total, 1);
        // The flash carried its tag as its Idempotency-Key (key propagation).
        assert_eq!(sim.stats().tag_keyed_calls, 1);
    }

    #[tokio::test]
    async fn a_base_path_prefix_is_kept() {
        let (_sim, client) = start(SimConfig::default()).await;
        let prefixed = HypervisorClient::new(&format!("{}hv/", client.base), TIMEOUT).expect("client");
        assert_eq!(prefixed.url(&["v1", "vms", "a b"], Some("t&u")).path(), "/hv/v1/vms/a%20b");
        assert_eq!(prefixed.url(&["v1", "vms"], Some("t&u")).query(), Some("tag=t%26u"));
        // Against the simulator (no prefix), a prefixed path is an unknown route: a definite 404.
        let err = prefixed.list_all().await.expect_err("no such route");
        assert_eq!(err.status(), Some(StatusCode::NOT_FOUND));
    }
}
