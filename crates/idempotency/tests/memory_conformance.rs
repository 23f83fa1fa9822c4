//! The store conformance suite against the in-memory store.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

use std::sync::Arc;

use idempotency::MemoryStore;
use idempotency::conformance::Fixture;

idempotency::store_conformance_suite!(memory, async {
    let store = Arc::new(MemoryStore::new());
    Fixture { peer: store.clone(), store }
});

// The same suite through a replay cache: every claim and read of a completed record after the
// first is answered from the copy, and the answers must not change.
idempotency::store_conformance_suite!(memory_replay_cache, async {
    let store: Arc<dyn idempotency::Store> = Arc::new(idempotency::ReplayCache::local(
        Arc::new(MemoryStore::new()),
        idempotency::DEFAULT_REPLAY_CACHE_BYTES,
    ));
    Fixture { peer: store.clone(), store }
});
