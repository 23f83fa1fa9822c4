//! The HTTP client leasebroker uses to drive a hypervisor (docs/protocol.md#hypervisor-api): the simulator or a real one.
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

#[cfg(test)]
mod tests;

pub use super::error::HvError;
use super::http::{Endpoint, check, check_success};

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
        let Endpoint { keyed, base } = Endpoint::new(base_url, timeout, headers, ca_cert, pool_idle)?;
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
    /// listed `stopped` under a boot's tag is one whose start never ran, or is still under way
    /// in libvirtd (the start of a process killed mid-boot): it is started, or waited for.
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
