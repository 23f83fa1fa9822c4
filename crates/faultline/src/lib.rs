//! The fault harness: real processes, real faults, and a count of what was duplicated or lost.
//!
//! `faultline` starts real `leasebroker` processes on loopback (a standalone hypervisor simulator
//! and one `serve` replica on SQLite, or several on one PostgreSQL database), puts a
//! fault-injecting TCP proxy in front of each replica, and drives a mix of create, reboot and
//! delete operations through it, with the four client-side failure modes of the design (the
//! request never arrives, the response is lost after the work, the client gives up mid-flight,
//! the client process is killed and rerun), server replicas killed with SIGKILL mid-request, the
//! simulator failing before or after doing the work, calls slower than the server's timeout
//! (landing after it gave up), definite refusals, clients that abandon an operation for good, and
//! a database that restarts mid-run, boots that land after the servers' settle window (held by a
//! proxy of its own in front of the simulator, [`late`]) and replicas paused with SIGSTOP past
//! their claims. Then it waits out the servers' abandon window and their inventory sweep, reads
//! the ground truth (the fleet, the simulator's counters and VMs, the BMCs, every worker) and
//! checks that nothing was duplicated, lost or left held, and that nothing runs that nobody owns.
//! An operation whose client spent its retry budget is sent again with its key once the faults
//! are over, and must be answered what the service stored for it; the report says why it gave up,
//! attempt by attempt, against the run's [`timeline`] of kills, pauses and database restarts.
//!
//! The same workload runs twice: with clients that keep one key per logical operation (the SDK,
//! `lbctl --op-id`), where every invariant must hold, and with naive clients that make a fresh
//! key per attempt, to count what idempotency prevents.
//!
//! ```
//! use clap::Parser;
//! let cli = faultline::cli::Cli::try_parse_from([
//!     "faultline", "run", "--ops", "150", "--concurrency", "8", "--client-faults", "0.3",
//!     "--server-kills", "1", "--hv-fail-before", "0.1", "--hv-fail-after", "0.1",
//! ])
//! .unwrap();
//! assert!(matches!(cli.command, faultline::cli::Command::Run(_)));
//! ```

pub mod cli;
pub mod cluster;
pub mod gateway;
pub mod late;
pub mod libvirt;
pub mod pg;
pub mod proxy;
pub mod report;
pub mod run;
pub mod timeline;
pub mod verify;
pub mod workload;
