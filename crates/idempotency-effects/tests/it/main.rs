//! The effect ledger's integration tests: the conformance suite on every backend, and the
//! example adopter started as a real process.
//!
//! PostgreSQL tests need `TEST_POSTGRES_URL` (a server URL; every test creates and drops its
//! own database). Without it they print a loud SKIPPED line and pass, unless `CI=true`.

mod adopter;
mod ledgers;
