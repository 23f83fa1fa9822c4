//! Announcements that a record changed (left `in_flight`, or was forgotten), for stores that can
//! send them between processes (PostgreSQL's LISTEN/NOTIFY, Redis's PUBLISH): a request waiting
//! for another process's request with its key (`Prefer: wait`) is woken at once instead of at its
//! next poll, and a [`ReplayCache`](crate::ReplayCache) drops its copy of a forgotten record.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use sha2::{Digest, Sha256};
use tokio::sync::Notify;

use crate::Scope;

/// One [`Notify`] per record somebody waits for, woken by the store's announcements. A store
/// that announces changes owns one and hands it out through [`Store::changes`](crate::Store::changes).
#[derive(Default)]
pub struct RecordChanges {
    map: Mutex<HashMap<String, Arc<Notify>>>,
    /// Whether the store hears announcements now ([`RecordChanges::listening`]).
    listening: AtomicBool,
    /// Those who watch every record rather than one.
    observers: Mutex<Vec<Weak<dyn ChangeObserver>>>,
}

impl std::fmt::Debug for RecordChanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordChanges")
            .field("waited_for", &self.waited_for())
            .field("listening", &self.is_listening())
            .finish_non_exhaustive()
    }
}

/// What a store's announcements tell one who watches every record ([`RecordChanges::observe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Change<'a> {
    /// The record whose [`change_tag`] this is changed.
    Record(&'a str),
    /// The store stopped hearing announcements: any may be missed until [`Change::Listening`].
    Lost,
    /// The store hears announcements (again), from now on.
    Listening,
}

/// One who watches every record's announcements (a [`ReplayCache`](crate::ReplayCache)).
pub trait ChangeObserver: Send + Sync {
    /// Called for each announcement, on the task that hears it: must not block.
    fn observe(&self, change: Change<'_>);
}

/// What identifies a record in an announcement: a hash of its scope, short and free of the
/// characters a notification payload cannot carry, and no key in the clear.
pub fn change_tag(scope: &Scope) -> String {
    let mut h = Sha256::new();
    for part in [scope.principal.as_str(), scope.endpoint.as_str(), scope.key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

impl RecordChanges {
    /// A new, empty set of waiters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers interest in `scope`'s record until the subscription is dropped. Arm its
    /// [`Notify::notified`] (`enable`) before reading the record, so an announcement between the
    /// read and the wait is not missed.
    pub fn subscribe(self: &Arc<Self>, scope: &Scope) -> ChangeSubscription {
        let tag = change_tag(scope);
        let notify = self.lock().entry(tag.clone()).or_default().clone();
        ChangeSubscription { changes: self.clone(), tag, notify }
    }

    /// Wakes the waiters of the record `tag` ([`change_tag`]) names, and tells the observers.
    pub fn wake(&self, tag: &str) {
        if let Some(n) = self.lock().get(tag) {
            n.notify_waiters();
        }
        self.tell(Change::Record(tag));
    }

    /// Adds `observer`, told of every announcement until it is dropped.
    pub fn observe(&self, observer: Weak<dyn ChangeObserver>) {
        let mut observers = self.observers.lock().unwrap_or_else(|e| e.into_inner());
        observers.retain(|o| o.strong_count() > 0);
        observers.push(observer);
    }

    /// Whether the store hears announcements now: from its [`RecordChanges::listening`] to its
    /// next [`RecordChanges::lost`]. A store that never listens never is.
    pub fn is_listening(&self) -> bool {
        self.listening.load(Ordering::SeqCst)
    }

    /// For the store: it hears announcements from now on. Every waiter is woken (one that
    /// subscribed before may have missed its announcement) and the observers are told.
    pub fn listening(&self) {
        self.listening.store(true, Ordering::SeqCst);
        self.wake_all();
        self.tell(Change::Listening);
    }

    /// For the store: it stopped hearing announcements (its connection broke). Every waiter is
    /// woken (each reads its record again) and the observers are told, before any announcement
    /// can be missed unseen.
    pub fn lost(&self) {
        self.listening.store(false, Ordering::SeqCst);
        self.tell(Change::Lost);
        self.wake_all();
    }

    fn tell(&self, change: Change<'_>) {
        let observers: Vec<_> = {
            let observers = self.observers.lock().unwrap_or_else(|e| e.into_inner());
            if observers.is_empty() {
                return;
            }
            observers.iter().filter_map(Weak::upgrade).collect()
        };
        for o in observers {
            o.observe(change);
        }
    }

    /// Wakes every waiter: announcements may have been lost (the store's listening connection
    /// broke), so each one reads its record again.
    pub fn wake_all(&self) {
        for n in self.lock().values() {
            n.notify_waiters();
        }
    }

    /// How many records somebody waits for.
    pub fn waited_for(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A waiter's registration; the record's entry goes with its last waiter.
#[derive(Debug)]
pub struct ChangeSubscription {
    changes: Arc<RecordChanges>,
    tag: String,
    notify: Arc<Notify>,
}

impl ChangeSubscription {
    /// Notified when the record changes.
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for ChangeSubscription {
    fn drop(&mut self) {
        let mut map = self.changes.lock();
        if map.get(&self.tag).is_some_and(|n| Arc::strong_count(n) == 2) {
            map.remove(&self.tag);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;
    use crate::{Endpoint, IdempotencyKey, Principal};

    fn scope(p: &str, key: &str) -> Scope {
        Scope::new(Principal::new(p), Endpoint::new("POST", "/x"), IdempotencyKey::try_from(key).expect("key"))
    }

    #[test]
    fn tags_differ_per_scope_and_carry_no_key() {
        let a = change_tag(&scope("p", "k1"));
        assert_eq!(a, change_tag(&scope("p", "k1")));
        assert_ne!(a, change_tag(&scope("p", "k2")));
        assert_ne!(a, change_tag(&scope("q", "k1")));
        assert_eq!(a.len(), 32);
        assert!(!a.contains("k1"));
    }

    #[test]
    fn a_wake_reaches_that_records_waiters_and_the_entry_goes_with_them() {
        let changes = Arc::new(RecordChanges::new());
        let (a, b) = (changes.subscribe(&scope("p", "a")), changes.subscribe(&scope("p", "b")));
        {
            let mut wa = std::pin::pin!(a.notify().notified());
            let mut wb = std::pin::pin!(b.notify().notified());
            wa.as_mut().enable();
            wb.as_mut().enable();
            changes.wake(&change_tag(&scope("p", "a")));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(wa.as_mut().poll(&mut cx).is_ready());
            assert!(wb.as_mut().poll(&mut cx).is_pending());
        }
        drop(a);
        assert_eq!(changes.waited_for(), 1);
        drop(b);
        assert_eq!(changes.waited_for(), 0);
    }
}
