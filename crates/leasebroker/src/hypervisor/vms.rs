//! [`Vms`]: where the VMs live, one small trait with two homes: the hypervisor API over HTTP
//! ([`HttpVms`], `/v1/vms`: the simulator or a real hypervisor) and a libvirt host
//! (`LibvirtVms`, cargo feature `libvirt`). [`HypervisorClient`](super::HypervisorClient) holds
//! one and calls it.

use async_trait::async_trait;
use reqwest::{Method, StatusCode};

use super::api::{BootRequest, RebootRequest, Vm, VmDetail, VmList, VmState};
use super::error::HvError;
use super::http::{Endpoint, expect, expect_success, expect_success_status};

/// The VM calls of a hypervisor. Each error says whether the call may have taken effect
/// ([`HvError::may_have_happened`]).
#[async_trait]
pub trait Vms: Send + Sync + std::fmt::Debug {
    /// Boots a VM carrying `req.tag`.
    async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError>;

    /// The VMs whose tag is exactly `tag`.
    async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError>;

    /// Every VM.
    async fn list_all(&self) -> Result<Vec<Vm>, HvError>;

    /// One VM in full, or `None` when there is no such VM.
    async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError>;

    /// Makes an adopted VM run. Default: nothing, for a hypervisor whose listed VMs were booted
    /// by one call that started them.
    async fn ensure_running(&self, vm: &Vm) -> Result<(), HvError> {
        let _ = vm;
        Ok(())
    }

    /// [`Vms::ensure_running`] of the VM `vm_id`. Default: nothing, and nothing is called.
    async fn ensure_running_by_id(&self, vm_id: &str) -> Result<(), HvError> {
        let _ = vm_id;
        Ok(())
    }

    /// Reboots a VM, stamping `tag` on the reboot. A VM that does not exist is a definite
    /// [`HvError::Status`] with `404`.
    async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError>;

    /// Deletes a VM: `true` if it existed, `false` if not.
    async fn delete(&self, vm_id: &str) -> Result<bool, HvError>;
}

/// The VMs behind the hypervisor API's `/v1/vms`.
#[derive(Debug, Clone)]
pub(super) struct HttpVms(pub(super) Endpoint);

#[async_trait]
impl Vms for HttpVms {
    /// `POST /v1/vms`. Any `2xx` is success; of its body only `vm_id` is read (the tag is the one
    /// sent, and the VM runs).
    async fn boot(&self, req: &BootRequest) -> Result<Vm, HvError> {
        #[derive(serde::Deserialize)]
        struct Booted {
            vm_id: String,
        }
        let response = self.0.send(Method::POST, &["v1", "vms"], None, Some(req), Some(&req.tag)).await?;
        let booted: Booted = expect_success(response).await?;
        Ok(Vm { vm_id: booted.vm_id, tag: req.tag.clone(), state: VmState::Running })
    }

    /// `GET /v1/vms?tag=T`.
    async fn list_by_tag(&self, tag: &str) -> Result<Vec<Vm>, HvError> {
        let response = self.0.send::<()>(Method::GET, &["v1", "vms"], Some(tag), None, None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// `GET /v1/vms`.
    async fn list_all(&self) -> Result<Vec<Vm>, HvError> {
        let response = self.0.send::<()>(Method::GET, &["v1", "vms"], None, None, None).await?;
        Ok(expect::<VmList<Vm>>(response, StatusCode::OK).await?.vms)
    }

    /// `GET /v1/vms/{vm_id}`; `404` is `None`.
    async fn get(&self, vm_id: &str) -> Result<Option<VmDetail>, HvError> {
        let response = self.0.send::<()>(Method::GET, &["v1", "vms", vm_id], None, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        expect(response, StatusCode::OK).await.map(Some)
    }

    /// `POST /v1/vms/{vm_id}/reboot`; any `2xx` is success.
    async fn reboot(&self, vm_id: &str, tag: &str) -> Result<(), HvError> {
        let body = RebootRequest { tag: tag.to_owned() };
        let response = self.0.send(Method::POST, &["v1", "vms", vm_id, "reboot"], None, Some(&body), Some(tag)).await?;
        expect_success_status(response).await
    }

    /// `DELETE /v1/vms/{vm_id}`: any `2xx` is `true`, `404` is `false`.
    async fn delete(&self, vm_id: &str) -> Result<bool, HvError> {
        let response = self.0.send::<()>(Method::DELETE, &["v1", "vms", vm_id], None, None, None).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(false);
        }
        expect_success_status(response).await.map(|()| true)
    }
}
