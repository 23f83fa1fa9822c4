//! faultline's integration tests: the real `faultline` binary against real `leasebroker` and
//! `lbctl` processes.

mod gateway;
mod gave_up;
mod libvirt;
mod lost;
mod owners;
mod redfish;
mod smoke;
mod support;
