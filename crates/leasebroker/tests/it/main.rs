//! leasebroker's integration tests, one test binary (one link of the service) with a module per
//! theme: `service` (the binary's protocol, replicas, restarts, limits, logs; `service::database`
//! when the database goes away), `effects` (one side effect per key when the hypervisor is slow,
//! refuses, or the client walks away) and `tenants` (quotas, rate limits, timeouts, secrets).
//! `support` starts the real binary and reads ground truth.

mod bounds;
mod effects;
mod flashes;
mod service;
mod store_tls;
mod support;
mod tenants;
