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
