//! leasebroker: hands out worker nodes from a pool, safe to retry with `Idempotency-Key`.

pub mod hypervisor;
