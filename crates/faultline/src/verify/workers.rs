//! The invariants on the workers and what they hold: none phantom, lost or listed under another
//! principal; one node, one lease and one VM each; as many boots and reboots as the clients were
//! told of (and what abandoned operations and late landings may add).

use std::collections::HashMap;

use leasebroker_client::{Worker, WorkerId};

use super::{Damage, GroundTruth, Invariant};
use crate::workload::{Known, Ledger};

/// The create operation a listed worker belongs to, from its label.
fn op_of(worker: &Worker) -> Option<u64> {
    worker.labels.get(crate::workload::OP_LABEL)?.parse().ok()
}

/// The listed workers whose VM the hypervisor does not run, each with what the clients know of
/// it (for the report: a worker without its VM holds a node and a lease for nothing).
pub fn workers_without_vm(ledger: &Ledger, truth: &GroundTruth) -> Vec<String> {
    let mut out: Vec<String> = truth
        .workers
        .iter()
        .filter(|(_, (_, w))| w.vm_id.as_ref().is_none_or(|vm| !truth.vms.contains_key(vm)))
        .map(|(id, (_, w))| {
            let known = match ledger.workers.get(id) {
                Some(k) if k.delete_abandoned => "its delete was abandoned",
                Some(k) if k.delete_unknown => "its delete did not succeed",
                Some(_) => "held by a client",
                None => "no client knows it",
            };
            format!("{id} (vm {}): {known}", w.vm_id.as_deref().unwrap_or("none"))
        })
        .collect();
    out.sort();
    out
}

/// Compares the ground truth with the clients' ledger.
pub fn check(
    ledger: &Ledger,
    truth: &GroundTruth,
    gets: &[(WorkerId, anyhow::Result<Option<Worker>>)],
    reboots_ok: u64,
    late_boots: u64,
    on_libvirt: bool,
) -> (Damage, Vec<Invariant>) {
    let (phantom_workers, abandoned_creates_finished) = phantoms(ledger, truth);
    let held = held_workers(ledger, truth, gets);
    let fleet = &truth.fleet;
    let sim = &truth.sim;
    let diff = |a: u64, b: u64| a as i64 - b as i64;
    let damage = Damage {
        phantom_workers,
        lost_workers: held.lost,
        leaked_leases: diff(fleet.leases_active, fleet.workers_active),
        leaked_nodes: diff(fleet.nodes_allocated, fleet.workers_active),
        leaked_vms: diff(sim.running, fleet.workers_active),
        duplicate_boot_tags: sim.duplicate_boot_tags,
        extra_boots: diff(
            sim.boots_total,
            ledger.workers.len() as u64 + ledger.abandoned_creates.len() as u64 + late_boots,
        )
        .max(0),
        duplicate_reboot_tags: sim.duplicate_reboot_tags,
        extra_reboots: diff(sim.reboots_total, reboots_ok + ledger.abandoned_reboots).max(0),
        reboot_count_mismatches: held.reboot_count_mismatches,
        same_id_twice: ledger.same_id_twice,
        delete_unknown: ledger.workers.values().filter(|k| k.delete_unknown && !k.deleted).count() as u64,
        abandoned_creates_finished,
        bricked_nodes: 0,
        duplicate_flash_tags: 0,
        stuck_operations: 0,
        extra_flashes: 0,
        vms_without_worker: 0,
        flashes_without_operation: 0,
        acknowledged_records_lost: 0,
        acknowledged_flash_ops_lost: 0,
        failed_ops_not_completed: 0,
        reruns_not_stored_answer: 0,
    };
    let mut invariants = worker_invariants(ledger, truth, &damage, &held, late_boots);
    invariants.extend(boot_and_reboot_bounds(
        ledger,
        truth,
        abandoned_creates_finished,
        reboots_ok,
        late_boots,
        on_libvirt,
    ));
    (damage, invariants)
}

/// Whether a client holds `k` (neither deleted nor of unknown existence).
fn held(k: &Known) -> bool {
    !k.deleted && !k.delete_unknown
}

/// Whether `count` is the reboot count a client expects of `k`: its successful reboots, plus
/// at most its abandoned ones.
fn count_fits(k: &Known, count: u64) -> bool {
    (k.reboots_ok..=k.reboots_ok + k.reboots_abandoned).contains(&count)
}

/// The phantoms, and the abandoned creates the server finished anyway. A listed worker no client
/// knows is the one worker of an abandoned create the server finished anyway, or a phantom (a
/// second worker for one operation, or one nobody asked for).
fn phantoms(ledger: &Ledger, truth: &GroundTruth) -> (u64, u64) {
    let mut finished_abandoned: HashMap<u64, u64> = HashMap::new();
    let mut phantom_workers = 0;
    for (id, (_, w)) in &truth.workers {
        if ledger.workers.contains_key(id) {
            continue;
        }
        match op_of(w).filter(|op| ledger.abandoned_creates.contains(op)) {
            Some(op) => *finished_abandoned.entry(op).or_default() += 1,
            None => phantom_workers += 1,
        }
    }
    phantom_workers += finished_abandoned.values().map(|n| n - 1).sum::<u64>();
    (phantom_workers, finished_abandoned.len() as u64)
}

/// What the ground truth says of the workers the clients hold (and of those they deleted).
struct HeldWorkers {
    /// Held, not listed.
    lost: u64,
    /// Held, listed under another principal.
    listed_wrong: u64,
    /// Held, listed with a reboot count the clients do not expect (plus reboot answers that
    /// had one).
    reboot_count_mismatches: u64,
    /// Deleted by a client, still listed.
    deleted_but_listed: u64,
    /// Held, and a GET of it does not return it with its id and the expected reboot count.
    get_mismatches: u64,
}

fn held_workers(
    ledger: &Ledger,
    truth: &GroundTruth,
    gets: &[(WorkerId, anyhow::Result<Option<Worker>>)],
) -> HeldWorkers {
    let mut out = HeldWorkers {
        lost: 0,
        listed_wrong: 0,
        reboot_count_mismatches: ledger.reboot_count_mismatches,
        deleted_but_listed: 0,
        get_mismatches: 0,
    };
    for (id, known) in ledger.workers.iter().filter(|(_, k)| held(k)) {
        match truth.workers.get(id) {
            Some((principal, w)) => {
                out.listed_wrong += u64::from(*principal != known.principal);
                out.reboot_count_mismatches += u64::from(!count_fits(known, w.reboot_count));
            }
            None => out.lost += 1,
        }
    }
    // A worker a client deleted must be gone.
    out.deleted_but_listed =
        ledger.workers.iter().filter(|(id, k)| k.deleted && truth.workers.contains_key(*id)).count() as u64;
    out.get_mismatches = gets
        .iter()
        .filter(|(id, got)| !matches!(got, Ok(Some(w)) if w.id == *id && ledger.workers.get(id).is_some_and(|k| count_fits(k, w.reboot_count))))
        .count() as u64;
    out
}

/// The invariants that are exact counts: no phantom, nothing lost or held twice.
fn worker_invariants(
    ledger: &Ledger,
    truth: &GroundTruth,
    damage: &Damage,
    held_workers: &HeldWorkers,
    late_boots: u64,
) -> Vec<Invariant> {
    let (fleet, sim) = (&truth.fleet, &truth.sim);
    let known_active = ledger.workers.values().filter(|k| held(k)).count() as u64;
    let mut invariants = Vec::new();
    let mut eq = |name: &str, expected: u64, actual: u64| {
        invariants.push(Invariant { name: name.to_owned(), expected, actual, at_most: false, ok: expected == actual });
    };
    eq("workers listed that no client created (phantoms)", 0, damage.phantom_workers);
    // A worker whose delete did not succeed may or may not exist; the ones listed count as held.
    let unknown_listed = ledger
        .workers
        .iter()
        .filter(|(id, k)| k.delete_unknown && !k.deleted && truth.workers.contains_key(*id))
        .count() as u64;
    eq(
        "workers_active == created - deleted by clients (+ abandoned creates finished)",
        known_active + unknown_listed + damage.abandoned_creates_finished,
        fleet.workers_active,
    );
    eq("workers a client holds that the server lacks", 0, held_workers.lost);
    eq("workers a client deleted that are still listed", 0, held_workers.deleted_but_listed);
    eq("workers listed under another principal", 0, held_workers.listed_wrong);
    eq("nodes_allocated == workers_active", fleet.workers_active, fleet.nodes_allocated);
    eq("leases_active == workers_active", fleet.workers_active, fleet.leases_active);
    if late_boots == 0 {
        eq("duplicate_boot_tags", 0, sim.duplicate_boot_tags);
    }
    eq("VMs running == workers_active", fleet.workers_active, sim.running);
    eq("fleet vms_running == workers_active", fleet.workers_active, fleet.vms_running);
    eq("duplicate_reboot_tags", 0, sim.duplicate_reboot_tags);
    eq("reboot_count mismatches", 0, held_workers.reboot_count_mismatches);
    eq("ops told another op's worker id", 0, ledger.same_id_twice);
    eq("GET of each held worker returns it with its id", 0, held_workers.get_mismatches);
    invariants
}

/// The invariants that are bounds: boots and reboots, which abandoned operations and late
/// landings may add to (and libvirt may show fewer of).
fn boot_and_reboot_bounds(
    ledger: &Ledger,
    truth: &GroundTruth,
    abandoned_creates_finished: u64,
    reboots_ok: u64,
    late_boots: u64,
    on_libvirt: bool,
) -> Vec<Invariant> {
    let (fleet, sim) = (&truth.fleet, &truth.sim);
    let known_active = ledger.workers.values().filter(|k| held(k)).count() as u64;
    let known_created = ledger.workers.len() as u64;
    let abandoned_creates = ledger.abandoned_creates.len() as u64;
    let abandoned_reboots = ledger.abandoned_reboots;
    let mut invariants = Vec::new();
    let mut within = |name: &str, low: u64, high: u64, actual: u64| {
        let exact = low == high;
        let ok = (low..=high).contains(&actual);
        invariants.push(Invariant { name: name.to_owned(), expected: high, actual, at_most: !exact, ok });
    };
    // An abandoned create booted at most once (its VM since rolled back, or kept with its worker).
    // A boot held past the settle window may land beside the one a retry made after the window
    // (a second VM of its tag, which the service destroys) or after its create was rolled back
    // (an orphan): at most one more boot and one more boot of a tag each.
    if on_libvirt {
        // A domain shows its boot by its `Started` event, which libvirt sends once the start has
        // completed. A create a retry adopted after a SIGKILL answers as soon as libvirt lists the
        // domain active, which it does from QEMU's launch on; a delete of that worker before the
        // start completed destroys it mid-start (libvirt logs `reason=failed`) and no `Started`
        // event ever comes. So fewer boots than workers created may be seen, never fewer than the
        // workers still held (their domains run), never more than one per create.
        within(
            "libvirt boots (Started) <= workers created (+ at most one per abandoned create), >= workers held",
            known_active,
            known_created + abandoned_creates,
            sim.boots_total,
        );
    } else if late_boots == 0 {
        within(
            "hypervisor boots == workers created (+ at most one per abandoned create)",
            known_created + abandoned_creates_finished,
            known_created + abandoned_creates,
            sim.boots_total,
        );
    } else {
        within("duplicate_boot_tags (at most one per late landing)", 0, late_boots, sim.duplicate_boot_tags);
        within(
            "hypervisor boots == workers created (+ at most one per abandoned create and per late landing)",
            known_created + abandoned_creates_finished,
            known_created + abandoned_creates + late_boots,
            sim.boots_total,
        );
    }
    if on_libvirt {
        // A reset leaves no trace but its event: a server killed after it recorded the reboot's
        // tag on the domain and before the reset reads the reboot as done on the retry (the
        // libvirt backend's documented "at most once"), so fewer resets than reboots may be.
        within(
            "libvirt resets <= successful reboot ops (+ at most one per abandoned reboot)",
            0,
            reboots_ok + abandoned_reboots,
            sim.reboots_total,
        );
    } else {
        within(
            "hypervisor reboots == successful reboot ops (+ at most one per abandoned reboot)",
            reboots_ok,
            reboots_ok + abandoned_reboots,
            sim.reboots_total,
        );
    }
    within(
        "fleet reboots_total == successful reboot ops (+ at most one per abandoned reboot)",
        reboots_ok,
        reboots_ok + abandoned_reboots,
        fleet.reboots_total,
    );
    invariants
}
