//! The cases. Each takes a fresh [`Fixture`] and counts side effects on a [`Downstream`].

use std::time::Duration;

use super::SETTLE;
use crate::{Ledger, Mark, ReaperConfig};

mod attempts;
mod background;
mod reaping;

pub use attempts::*;
pub use background::*;
pub use reaping::*;

fn reaper_config() -> ReaperConfig {
    ReaperConfig {
        settle: SETTLE,
        abandon_after: Duration::ZERO,
        in_flight_ttl: Duration::from_secs(1),
        retention: Duration::from_secs(3600),
        batch: 500,
    }
}

async fn mark_of(ledger: &dyn Ledger, op_id: &str) -> Option<Mark> {
    ledger.operation(op_id).await.expect("read operation").map(|o| o.mark)
}
