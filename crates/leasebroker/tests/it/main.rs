//! leasebroker's integration tests, one test binary (one link of the service) with a module per
//! theme: `service` (the binary's protocol, replicas, restarts, limits, logs; `service::database`
//! when the database goes away), `effects` (one side effect per key when the hypervisor is slow,
//! refuses, or the client walks away), `fences` (the holes of issue 24: orphans, a fair reaper,
//! a queue for the database, terse upstreams), `tenants` (quotas, rate limits, timeouts, secrets) and
//! `shares` (each principal's share of the process, the per-source connection cap, what the
//! record limit counts).
//! `support` starts the real binary and reads ground truth.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod bounds;
mod console;
mod deploy;
mod edges;
mod effects;
mod expiry;
mod fences;
mod flashes;
#[cfg(feature = "libvirt")]
mod libvirt;
mod openapi;
mod protocol;
mod readme;
mod records;
mod redfish;
mod service;
mod shares;
mod store_bounds;
mod store_tls;
mod support;
mod tenants;
mod traces;
mod webdriver;
