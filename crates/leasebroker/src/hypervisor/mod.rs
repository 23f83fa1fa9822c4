//! The hypervisor API (SPEC 3.3): the HTTP client leasebroker uses and the simulator.
