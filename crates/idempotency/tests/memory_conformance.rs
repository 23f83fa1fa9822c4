//! The store conformance suite against the in-memory store.

use std::sync::Arc;

use idempotency::MemoryStore;
use idempotency::conformance::Fixture;

idempotency::store_conformance_suite!(memory, async {
    let store = Arc::new(MemoryStore::new());
    Fixture { peer: store.clone(), store }
});
