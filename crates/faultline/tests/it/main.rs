//! faultline's integration tests: the real `faultline` binary against real `leasebroker` and
//! `lbctl` processes.

mod lost;
mod owners;
mod smoke;
mod support;
