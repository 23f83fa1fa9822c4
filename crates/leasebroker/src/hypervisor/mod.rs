//! The hypervisor API (docs/protocol.md#hypervisor-api): the HTTP client leasebroker uses and the simulator.
//!
//! Like many real hypervisors, this API does not accept caller-supplied ids: it picks each VM's id
//! and echoes back a free-form `tag`. leasebroker puts a derived sub-key in that tag and, after an
//! ambiguous failure ([`HvError::may_have_happened`]), finds out what happened by listing VMs by tag.
//!
//! - [`sim`]: the simulator, an axum app with injectable faults and the counters the fault harness
//!   checks ([`SimStats`]).
//! - [`client`]: [`HypervisorClient`], which tells a definite failure from an ambiguous one; its
//!   VM calls go to a [`Vms`]: the HTTP API's `/v1/vms`, or a libvirt host.
//! - [`redfish`]: the BMCs behind a Redfish service instead of the HTTP API
//!   (`--bmc-url redfish+http://HOST:PORT`), for firmware flashes.
//! - `libvirt` (cargo feature `libvirt`): the VMs on a real libvirt/QEMU host instead of the HTTP
//!   API (`--hypervisor-url libvirt+qemu:///system`).
//! - [`url`]: `--hypervisor-url` and `--bmc-url`, parsed once into [`HypervisorUrl`](url::HypervisorUrl)
//!   and [`BmcUrl`](url::BmcUrl); the service picks its backends by matching on them.
//!
//! ```no_run
//! use std::time::Duration;
//! use leasebroker::hypervisor::{BootRequest, HypervisorClient, SimConfig, Simulator, serve};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let url = format!("http://{}", listener.local_addr()?);
//! let sim = Simulator::new(SimConfig::default());
//! tokio::spawn(serve(listener, sim.clone(), std::future::pending()));
//!
//! let client = HypervisorClient::new(&url, Duration::from_secs(10))?;
//! let req = BootRequest { image: "ubuntu-24.04".into(), cpu: 4, memory_gb: 16, tag: "sub-key".into() };
//! match client.boot(&req).await {
//!     Ok(vm) => println!("booted {}", vm.vm_id),
//!     // Maybe booted: look for it by tag before booting again.
//!     Err(e) if e.may_have_happened() => println!("found {:?}", client.list_by_tag("sub-key").await?),
//!     Err(e) => return Err(e.into()),
//! }
//! assert_eq!(sim.stats().boots_total, 1);
//! # Ok(()) }
//! ```

mod api;
pub mod client;
mod error;
mod http;
#[cfg(feature = "libvirt")]
pub mod libvirt;
pub mod redfish;
pub mod sim;
pub mod url;
mod vms;

pub use api::{
    BmcList, BmcNode, BmcState, BootRequest, FlashRequest, RebootRequest, SimStats, Vm, VmDetail, VmList, VmState,
};
pub use client::{HvError, HypervisorClient, Vms};
pub use redfish::RedfishBmc;
pub use sim::{RedfishOptions, SimConfig, Simulator, serve};
