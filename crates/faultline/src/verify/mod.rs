//! Ground truth and the invariants: what the servers and the hypervisor hold once they have
//! settled, compared with what the clients were told.
//!
//! A [`Reader`] reads the servers and the simulator directly (no proxy, no faults) into a
//! [`GroundTruth`]. Each family of invariants has its check, which states its [`Invariant`]s and
//! counts its [`Damage`]: the workers and what they hold ([`check`]), the flashes
//! ([`check_flashes`]), nothing runs that nobody owns ([`check_owners`]), nothing acknowledged
//! is lost ([`check_acknowledged`]) and every operation ends, a rerun with its key answering
//! what the service stored for it ([`check_reruns`]).

mod acknowledged;
mod flashes;
mod outcome;
mod owners;
mod reader;
mod reruns;
mod truth;
mod workers;

pub use acknowledged::{ACKNOWLEDGED_RECORDS_LOST, check_acknowledged, drop_records, records_lost};
pub use flashes::{check_flashes, redfish_task_flash};
pub use leasebroker_api::SimStats;
pub use outcome::{Damage, Invariant};
pub use owners::{PLANTED_PREFIX, check_owners, flash_keys};
pub use reader::{Bmcs, Reader, Vms};
pub use reruns::{NOT_COMPLETED, NOT_THE_STORED_ANSWER, check_reruns};
pub use truth::{GroundTruth, ServerCounters};
pub use workers::{check, workers_without_vm};
