//! The effect ledger's integration tests: the conformance suite on every backend, and the
//! example adopter started as a real process.
//!
//! PostgreSQL tests need `TEST_POSTGRES_URL` (a server URL; every test creates and drops its
//! own database). Without it they print a loud SKIPPED line and pass, unless `CI=true`.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod adopter;
mod ledgers;
