//! Requests waiting (`Prefer: wait`) for a record in flight in this process: woken the moment its
//! owner completes or fails it, instead of when their next poll of the store comes round.
//!
//! This serves every store within one process (memory, SQLite, and a PostgreSQL or Redis
//! shared by replicas for the requests each replica owns). A waiter whose record is owned by
//! another process is not woken: it polls the store with backoff, and holds nothing (no
//! connection, no lock) between polls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idempotency::Scope;
use tokio::sync::Notify;

/// One [`Notify`] per record somebody waits for.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<Scope, Arc<Notify>>>,
}

impl Waiters {
    /// Registers interest in `scope`'s record until the returned handle is dropped.
    pub(crate) fn subscribe(self: &Arc<Self>, scope: &Scope) -> Subscription {
        let notify = self.lock().entry(scope.clone()).or_default().clone();
        Subscription { waiters: self.clone(), scope: scope.clone(), notify }
    }

    /// Wakes every request waiting for `scope`'s record: its state changed.
    pub(crate) fn wake(&self, scope: &Scope) {
        let map = self.lock();
        if let Some(notify) = map.get(scope) {
            notify.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Arc<Notify>>> {
        // A panic while holding this lock leaves the map consistent (every operation is one call).
        self.map.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A waiter's handle; the entry goes when its last waiter does.
#[derive(Debug)]
pub(crate) struct Subscription {
    waiters: Arc<Waiters>,
    scope: Scope,
    notify: Arc<Notify>,
}

impl Subscription {
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = self.waiters.lock();
        // The map's reference and this one: nobody else waits.
        if map.get(&self.scope).is_some_and(|n| Arc::strong_count(n) == 2) {
            map.remove(&self.scope);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency::{Endpoint, IdempotencyKey, Principal};

    fn scope(key: &str) -> Scope {
        Scope {
            principal: Principal::new("p"),
            endpoint: Endpoint::new("POST", "/x"),
            key: IdempotencyKey::try_from(key).expect("key"),
        }
    }

    #[tokio::test]
    async fn a_wake_reaches_the_waiters_of_that_record_only() {
        let waiters = Arc::new(Waiters::default());
        let a = waiters.subscribe(&scope("a"));
        let b = waiters.subscribe(&scope("b"));
        let mut wa = std::pin::pin!(a.notify().notified());
        let mut wb = std::pin::pin!(b.notify().notified());
        wa.as_mut().enable();
        wb.as_mut().enable();
        waiters.wake(&scope("a"));
        assert!(futures::poll!(wa.as_mut()).is_ready());
        assert!(futures::poll!(wb.as_mut()).is_pending());
    }

    #[test]
    fn the_entry_goes_with_its_last_waiter() {
        let waiters = Arc::new(Waiters::default());
        let one = waiters.subscribe(&scope("a"));
        let two = waiters.subscribe(&scope("a"));
        drop(one);
        assert_eq!(waiters.lock().len(), 1);
        drop(two);
        assert!(waiters.lock().is_empty());
    }
}
