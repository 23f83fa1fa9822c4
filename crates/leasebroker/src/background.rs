//! Everything leasebroker runs beside its requests, started in one place and stopped together
//! when the server stops ([`Background`]):
//!
//! | task | every | what it does |
//! |---|---|---|
//! | `reaper` | `--sweep-interval` | deletes expired idempotency records, then one reaper pass ([`crate::reaper`]): the inventory sweep (late landings, orphans), the operations due (roll back, finish, forget), pruning |
//! | `watcher` | `--operation-poll` | follows running firmware flashes to their end ([`crate::firmware::Watcher`]) |
//! | `console-sampler` | ten seconds | samples the outcome counters for the console's chart ([`crate::console::History`]) |
//! | `simulator` | | the private hypervisor simulator, when no `--hypervisor-url` is given |

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tracing::Instrument;

/// Work done in passes, one at a time.
pub trait Pass: Send + Sync + 'static {
    /// One pass; what goes wrong in it is logged there and tried again on the next.
    fn pass(&self) -> impl Future<Output = ()> + Send;
}

/// The running background tasks. Dropping it (or [`Background::stop`]) aborts them.
#[derive(Debug, Default)]
pub struct Background {
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

impl Background {
    /// None running yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `pass` now and then every `interval`. A pass that overruns its interval delays the
    /// next one; none is skipped or run twice at once.
    pub fn every(&mut self, name: &'static str, interval: Duration, pass: impl Pass) {
        let task = async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                pass.pass().await;
            }
        };
        self.adopt(name, tokio::spawn(task.instrument(tracing::info_span!("background", task = name))));
    }

    /// Keeps a task started elsewhere, to stop it with the others.
    pub fn adopt(&mut self, name: &'static str, task: JoinHandle<()>) {
        self.tasks.push((name, task));
    }

    /// The tasks' names, in the order they started.
    pub fn names(&self) -> Vec<&'static str> {
        self.tasks.iter().map(|(name, _)| *name).collect()
    }

    /// Aborts every task.
    pub fn stop(self) {}
}

impl Drop for Background {
    fn drop(&mut self) {
        for (_, task) in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Count(Arc<AtomicUsize>);

    impl Pass for Count {
        async fn pass(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pass_runs_at_once_then_every_interval_until_stopped() {
        let n = Arc::new(AtomicUsize::new(0));
        let mut background = Background::new();
        background.every("count", Duration::from_secs(10), Count(n.clone()));
        tokio::time::sleep(Duration::from_secs(25)).await;
        assert_eq!(n.load(Ordering::SeqCst), 3, "at 0, 10 and 20 s");
        assert_eq!(background.names(), ["count"]);
        background.stop();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(n.load(Ordering::SeqCst), 3, "none after the stop");
    }
}
