//! Places counted per key, up to a cap each: the connections of each source
//! ([`crate::serve`]), the requests in progress of each principal (`crate::api::shares`).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

/// How many places each key holds, at most `cap`. Keys holding none are forgotten, so the map
/// holds only the keys with something in progress.
#[derive(Debug)]
pub struct Places<K> {
    cap: usize,
    held: Arc<Mutex<HashMap<K, usize>>>,
}

impl<K> Clone for Places<K> {
    fn clone(&self) -> Self {
        Self { cap: self.cap, held: self.held.clone() }
    }
}

impl<K: Hash + Eq + Clone> Places<K> {
    /// At most `cap` places per key (`usize::MAX`: no cap).
    pub fn new(cap: usize) -> Self {
        Self { cap, held: Arc::new(Mutex::new(HashMap::new())) }
    }

    /// One of `key`'s places, given back when dropped; `None` when it holds `cap` already.
    pub fn enter(&self, key: K) -> Option<Place<K>> {
        let mut held = lock(&self.held);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.cap {
            if *n == 0 {
                held.remove(&key);
            }
            return None;
        }
        *n += 1;
        Some(Place { held: self.held.clone(), key })
    }

    /// How many keys hold a place.
    pub fn keys(&self) -> usize {
        lock(&self.held).len()
    }
}

fn lock<K>(held: &Mutex<HashMap<K, usize>>) -> MutexGuard<'_, HashMap<K, usize>> {
    held.lock().unwrap_or_else(|e| e.into_inner())
}

/// A place [`Places::enter`] gave; given back when dropped.
#[derive(Debug)]
pub struct Place<K: Hash + Eq> {
    held: Arc<Mutex<HashMap<K, usize>>>,
    key: K,
}

impl<K: Hash + Eq> Drop for Place<K> {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_at_most_its_cap_and_keys_holding_none_are_forgotten() {
        let places = Places::new(2);
        let (a1, a2) = (places.enter("a").expect("a's first"), places.enter("a").expect("a's second"));
        assert!(places.enter("a").is_none(), "a third place beyond the cap");
        let b = places.enter("b").expect("b holds places of its own");
        drop(a1);
        let a3 = places.enter("a").expect("a place given back is taken again");
        assert_eq!(places.keys(), 2);
        drop((a2, a3, b));
        assert_eq!(places.keys(), 0, "keys holding nothing are forgotten");
        let none = Places::new(0);
        assert!(none.enter("a").is_none(), "a cap of 0 gives nothing");
        assert_eq!(none.keys(), 0);
    }
}
