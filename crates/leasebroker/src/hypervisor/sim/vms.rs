//! The VMs: the routes (boot, list, get, reboot, delete) and their changes to the state.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Json, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::problem::{json_rejection, problem, vm_not_found};
use super::{SimState, SimVm, Simulator};
use crate::hypervisor::api::{BootRequest, RebootRequest, Vm, VmDetail, VmList, VmState};

pub(super) async fn boot(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    body: Result<Json<BootRequest>, JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    if let Err(detail) = validate_boot(&req) {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-request", &detail);
    }
    if sim.lacks_image(&req.image) {
        return problem(StatusCode::UNPROCESSABLE_ENTITY, "image-not-found", "this hypervisor has no such image");
    }
    let keyed = Simulator::keyed_by(&headers, &req.tag);
    match sim
        .mutate(move |state| {
            state.stats.tag_keyed_calls += u64::from(keyed);
            state.boot(req)
        })
        .await
    {
        Ok(vm) => {
            let mut response = (StatusCode::CREATED, Json(&vm)).into_response();
            if let Ok(location) = HeaderValue::from_str(&format!("/v1/vms/{}", vm.vm_id)) {
                response.headers_mut().insert(header::LOCATION, location);
            }
            response
        }
        Err(response) => response,
    }
}

fn validate_boot(req: &BootRequest) -> Result<(), String> {
    if req.image.trim().is_empty() {
        return Err("image must not be empty".to_owned());
    }
    if req.cpu < 1 {
        return Err("cpu must be at least 1".to_owned());
    }
    if req.memory_gb < 1 {
        return Err("memory_gb must be at least 1".to_owned());
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
pub(super) struct ListQuery {
    tag: Option<String>,
}

pub(super) async fn list(State(sim): State<Simulator>, query: Result<Query<ListQuery>, QueryRejection>) -> Response {
    let Query(query) = match query {
        Ok(query) => query,
        Err(rejection) => return problem(rejection.status(), "invalid-query", &rejection.body_text()),
    };
    let vms = sim.state().list(query.tag.as_deref());
    Json(VmList { vms }).into_response()
}

pub(super) async fn get_vm(State(sim): State<Simulator>, vm_id: Result<Path<String>, PathRejection>) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    match sim.state().vms.get(&vm_id) {
        Some(vm) => Json(&vm.detail).into_response(),
        None => vm_not_found(&vm_id),
    }
}

pub(super) async fn reboot(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    vm_id: Result<Path<String>, PathRejection>,
    body: Result<Json<RebootRequest>, JsonRejection>,
) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    let Json(req) = match body {
        Ok(body) => body,
        Err(rejection) => return json_rejection(rejection),
    };
    let target = vm_id.clone();
    let keyed = Simulator::keyed_by(&headers, &req.tag);
    match sim
        .mutate(move |state| {
            let rebooted = state.reboot(&target, req.tag);
            if rebooted.is_some() {
                state.stats.tag_keyed_calls += u64::from(keyed);
            }
            rebooted
        })
        .await
    {
        Ok(Some(detail)) => (StatusCode::ACCEPTED, Json(detail)).into_response(),
        Ok(None) => vm_not_found(&vm_id),
        Err(response) => response,
    }
}

pub(super) async fn delete_vm(State(sim): State<Simulator>, vm_id: Result<Path<String>, PathRejection>) -> Response {
    let Path(vm_id) = match vm_id {
        Ok(path) => path,
        Err(rejection) => return problem(rejection.status(), "invalid-path", &rejection.body_text()),
    };
    let target = vm_id.clone();
    match sim.mutate(move |state| state.vms.remove(&target).is_some()).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => vm_not_found(&vm_id),
        Err(response) => response,
    }
}

impl SimState {
    pub(super) fn boot(&mut self, req: BootRequest) -> Vm {
        let vm_id = loop {
            let id = format!("vm-{:016x}", rand::random::<u64>());
            if !self.vms.contains_key(&id) {
                break id;
            }
        };
        self.stats.boots_total += 1;
        if !req.tag.is_empty() && !self.booted_tags.insert(req.tag.clone()) {
            self.stats.duplicate_boot_tags += 1;
        }
        let detail = VmDetail {
            vm_id: vm_id.clone(),
            tag: req.tag,
            state: VmState::Running,
            reboot_tags: Vec::new(),
            image: Some(req.image),
            cpu: Some(req.cpu),
            memory_gb: Some(req.memory_gb),
        };
        let vm = detail.summary();
        self.vms.insert(vm_id, SimVm { seq: self.next_seq, detail });
        self.next_seq += 1;
        vm
    }

    pub(super) fn reboot(&mut self, vm_id: &str, tag: String) -> Option<VmDetail> {
        let vm = self.vms.get_mut(vm_id)?;
        self.stats.reboots_total += 1;
        if vm.detail.reboot_tags.contains(&tag) {
            self.stats.duplicate_reboot_tags += 1;
        }
        vm.detail.reboot_tags.push(tag);
        Some(vm.detail.clone())
    }

    pub(super) fn list(&self, tag: Option<&str>) -> Vec<VmDetail> {
        let mut vms: Vec<&SimVm> = self.vms.values().filter(|vm| tag.is_none_or(|t| vm.detail.tag == t)).collect();
        vms.sort_by_key(|vm| vm.seq);
        vms.into_iter().map(|vm| vm.detail.clone()).collect()
    }
}
