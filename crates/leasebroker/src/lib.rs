//! leasebroker: a worker-provisioning service built on the idempotency layer, with a hypervisor simulator
