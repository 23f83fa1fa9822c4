#![doc = include_str!("../README.md")]
//!
//! # Where things are
//!
//! What a service supplies: an [`Effect`] (probe, undo, list, poll) and, per request, the
//! `send` given to [`Attempt::run`], whose errors it classifies as a [`CallError`]
//! (definite or ambiguous). The runner: [`Effects`], an [`Operation`] per idempotency record,
//! an [`Attempt`] per handler run. The ledger: the [`Ledger`] trait, [`MemoryLedger`] and
//! [`SqlLedger`] (SQLite, PostgreSQL). Background work: [`Reaper`], [`InventorySweep`],
//! [`Watcher`]. With feature `conformance`, the ledger conformance suite
//! ([`ledger_conformance_suite!`]) and its counting downstream.

mod attempt;
mod effect;
mod ledger;
mod memory;
mod reaper;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod sql;
mod sweep;
mod watch;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use attempt::{Attempt, DEFAULT_SEND_AHEAD, DEFAULT_SETTLE, EffectError, Effects, Made, Operation, Outcome};
pub use effect::{CallError, Effect, Progress, Sent, Tagged, Undone};
pub use ledger::{Decided, Intent, IntentState, Ledger, LedgerError, Mark, NewIntent, OperationRow, Ownership};
pub use memory::MemoryLedger;
pub use reaper::{Abandoned, Disposal, Pass, Reaper, ReaperConfig};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use sql::{MIGRATIONS_TABLE, SqlLedger, migrator};
pub use sweep::{InventorySweep, Owner, SweepError, Swept, TAG_PREFIX};
pub use watch::{Watched, Watcher};

/// Microseconds since the epoch, now, at the precision the ledgers keep.
pub(crate) fn now_micros() -> i64 {
    idempotency::now().timestamp_micros()
}

/// Microseconds in `d`, saturating.
pub(crate) fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}
