//! The HTTP client leasebroker uses to drive a hypervisor (docs/protocol.md#hypervisor-api): the simulator or a real one.
//!
//! Its errors say whether the call may have taken effect downstream ([`HvError::may_have_happened`]),
//! because that decides what the service does with a pending intent: an ambiguous failure leaves it
//! pending for reconciliation by tag, only a definite one marks it failed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};

pub use super::api::{BmcNode, BmcState, BootRequest, FlashRequest, SimStats, Vm, VmDetail, VmState};

#[cfg(test)]
mod tests;

pub use super::error::HvError;
use super::http::{Endpoint, expect, expect_success_status};
use super::vms::HttpVms;
pub use super::vms::Vms;

/// A client for one hypervisor, with a per-call timeout.
///
/// Cheap to clone (the connection pool is shared). Redirects are not followed: a hypervisor that
/// redirects a `POST` gets an ambiguous [`HvError::Status`] rather than a silently re-sent request.
/// An `https` hypervisor is verified with rustls against the system's roots and, with
/// [`HypervisorClient::with_ca_cert`], a private CA.
#[derive(Debug, Clone)]
pub struct HypervisorClient {
    /// The hypervisor API: its BMC calls, its counters, and its VMs unless they live elsewhere.
    http: Endpoint,
    /// Where the VMs live: the HTTP API's `/v1/vms` ([`HttpVms`]), or a libvirt host.
    vms: Arc<dyn Vms>,
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
        let http = Endpoint::new(base_url, timeout, headers, ca_cert, pool_idle)?;
        Ok(Self { vms: Arc::new(HttpVms(http.clone())), http })
    }

    /// This client with its VMs on a libvirt host instead of the HTTP API's `/v1/vms` (the BMC
    /// calls still go to the HTTP API).
    #[cfg(feature = "libvirt")]
    pub fn with_libvirt(mut self, vms: super::libvirt::LibvirtVms) -> Self {
        self.vms = Arc::new(vms);
        self
    }

    /// Boots a VM, stamping `req.tag` on it (`POST /v1/vms`, or a libvirt domain).
    pub async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        self.vms.boot(req).await
    }

    /// The VMs whose tag is exactly `tag` (`GET /v1/vms?tag=T`).
    pub async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        self.vms.list_by_tag(tag).await
    }

    /// Every VM (`GET /v1/vms`).
    pub async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        self.vms.list_all().await
    }

    /// One VM in full (`GET /v1/vms/{vm_id}`), or `None` when the hypervisor has no such VM.
    pub async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        self.vms.get(vm_id).await
    }

    /// Makes an adopted VM run ([`Vms::ensure_running`]).
    pub async fn ensure_running(&self, vm: &Vm) -> Result<(), HvError> {
        self.vms.ensure_running(vm).await
    }

    /// Makes the VM `vm_id` run ([`Vms::ensure_running_by_id`]).
    pub async fn ensure_running_by_id(&self, vm_id: &str) -> Result<(), HvError> {
        self.vms.ensure_running_by_id(vm_id).await
    }

    /// Reboots a VM (`POST /v1/vms/{vm_id}/reboot`), stamping `tag` on the reboot. A VM that does
    /// not exist is [`HvError::Status`] with `404` (definite).
    pub async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        self.vms.reboot(vm_id, tag).await
    }

    /// Deletes a VM (`DELETE /v1/vms/{vm_id}`): `true` if it existed, `false` if not.
    pub async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        self.vms.delete(vm_id).await
    }

    /// Starts a firmware flash on the BMC of `node_id` (`POST /v1/bmc/{node_id}/flash`), stamping
    /// `req.tag` on it. The BMC answers `202` as the flash starts; it writes on after that. Any
    /// `2xx` is success, whatever its body holds or lacks: the contract promises nothing more.
    pub async fn flash(&self, node_id: &str, req: &FlashRequest) -> Result<(), HvError> {
        let response =
            self.http.send(Method::POST, &["v1", "bmc", node_id, "flash"], None, Some(req), Some(&req.tag)).await?;
        expect_success_status(response).await
    }

    /// The BMC of `node_id` (`GET /v1/bmc/{node_id}`), or `None` when it has no such node.
    pub async fn bmc(&self, node_id: &str) -> Result<Option<BmcNode>, HvError> {
        let response = self.http.send::<()>(Method::GET, &["v1", "bmc", node_id], None, None, None).await?;
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
        let response = self.http.send::<()>(Method::GET, &["v1", "bmc"], Some(tag), None, None).await?;
        Ok(expect::<Holding>(response, StatusCode::OK).await?.nodes.len())
    }

    /// The simulator's counters (`GET /v1/stats`); a real hypervisor may not serve them.
    pub async fn stats(&self) -> Result<SimStats, HvError> {
        let response = self.http.send::<()>(Method::GET, &["v1", "stats"], None, None, None).await?;
        expect(response, StatusCode::OK).await
    }
}
