//! Firmware flashes: an idempotent long-running operation (docs/protocol.md#firmware-operations).
//!
//! A second flash of a BMC while the first still writes bricks the machine, and a flash takes
//! minutes, so a flash runs as an operation: the request creates it and answers `202` as soon as
//! the BMC accepted the flash, and the [`Watcher`] follows it to its end.
//!
//! - **One operation per key.** The operation's row is keyed by the request record's derived
//!   sub-key `flash-op`; a retry of the same key finds it. The idempotency record completes with
//!   the `202` at acceptance, so a retry while the flash runs, or after, replays that `202` at
//!   once (the body shows the operation as it was then; `GET /admin/v1/operations/{id}` shows it
//!   now).
//! - **One open operation per node.** A partial UNIQUE index on the rows: a flash with another
//!   key while one runs on the node, or ended `uncertain` there, answers `409 operation-conflict`
//!   naming it, and never reaches the BMC.
//! - **The BMC call is an effect of the effect ledger** (`idempotency-effects`, as boots and
//!   reboots are): its tag is the derived sub-key `flash`; it is sent only by the attempt that
//!   recorded its intent with its send stamp, or moved that stamp by compare-and-set; a retry that
//!   finds it pending asks the BMC for nodes holding the tag before anything else, and sends again
//!   only when none does and the settle window (`--hypervisor-settle`) has passed since the last
//!   send.
//! - **The watcher** runs on every replica. An accepted flash is followed by the ledger's
//!   [`idempotency_effects::Watcher`], which holds a lease on the flash's intent, taken by
//!   compare-and-set, so several replicas never follow one flash at once, and a replica that dies
//!   leaves a lease that expires and is taken over. A pass also settles operations whose request
//!   was abandoned before acceptance: it adopts a flash the BMC holds by tag, and fails one nobody
//!   sent or retried within `--abandon-after`, after taking its ledger operation for a rollback
//!   (so no late attempt can send it).
//! - **Two kinds of BMC, one trait** ([`Bmc`], [`bmc`]): the hypervisor API's BMCs
//!   ([`ApiBmc`]) and a Redfish service keep different rules for a flash whose answer was lost,
//!   and each runs its own behind the same steps.
//! - **On a Redfish BMC** (`--bmc-url redfish+...`, [`crate::hypervisor::redfish`]) the tag rides in
//!   the image URI, and a flash whose send was stamped is never sent again. Every read the flash
//!   needs (the node's `Systems` member, whether it already runs the version) comes before the
//!   decision to send; the send step is the `SimpleUpdate` POST alone, so the send stamp guards
//!   the last network write. The task monitor's `Location` is kept with the operation in the
//!   database, so any replica's watcher follows the same task. A flash whose answer was lost is
//!   found by the tag in the tasks' payloads; where the BMC keeps none, once the settle window
//!   has passed and no task runs, the node's firmware inventory decides (the version there:
//!   succeeded; absent: failed). Where neither can be read (no task list, or no inventory), the
//!   operation ends `uncertain`, never `failed` on a guess, and the node takes no other flash
//!   until an operator resolves it (`POST /admin/v1/operations/{op_id}/resolve`). A node that
//!   already runs the version is not flashed: its operation succeeds at once, and a task that
//!   failed on a node that runs the version counts as done.
//! - **Nothing is concluded under a live attempt.** The watcher leaves an operation alone while
//!   an attempt holds its request's claim (in flight, not stale); and whoever concludes a flash
//!   without a task (the watcher or a retry) first moves its send stamp by compare-and-set from
//!   the value it decided on, so an attempt woken from a pause finds the stamp moved and sends
//!   nothing, and one that moved it first makes the conclusion wait for its window.

use leasebroker_api::OperationId;

use crate::service::{RequestRecord, public_id};

pub mod bmc;
mod call;
mod request;
mod resolve;
mod settle;
mod watcher;

pub use bmc::{ApiBmc, Bmc};
pub use request::Firmware;
pub use watcher::{WatchReport, WatchSettings, Watcher};

/// The sub-keys of one flash request: the operation's id and the BMC call's tag.
fn keys(op: &RequestRecord) -> (OperationId, String) {
    (operation_id(|label| op.derive(label)), op.derive("flash").as_str().to_owned())
}

fn operation_id(derive: impl Fn(&str) -> idempotency::SubKey) -> OperationId {
    // `op-` and hex digits: always a valid id.
    OperationId::try_from(public_id("op", &derive("flash-op"))).expect("an operation's public id is path-safe")
}

/// Where the operation a flash request's record starts can be followed: what the idempotency
/// layer puts in the `Link` of a retry's `409 request-in-progress` (the first attempt is still
/// accepting). `None` for records of other routes.
pub fn operation_link(record: &idempotency::Record) -> Option<String> {
    (crate::keyed::KeyedRoute::of_endpoint(record.scope.endpoint.as_str())
        == Some(crate::keyed::KeyedRoute::FlashFirmware))
    .then(|| operation_location(&operation_id(|label| record.derive(label))))
}

/// Where the operation `op_id` is read: its `Location`.
pub fn operation_location(op_id: &OperationId) -> String {
    format!("/admin/v1/operations/{op_id}")
}

/// Counts an operation that ended, by its outcome (`succeeded`, `failed`, `uncertain`).
fn count_end(end: &crate::domain::FlashEnd) {
    let outcome = String::from(end.state());
    metrics::counter!(crate::metric::OPERATIONS_TOTAL, "kind" => "firmware-flash", "outcome" => outcome).increment(1);
}
