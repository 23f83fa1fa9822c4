//! The gateway's integration tests: the real `idempotency-gateway` binary (started through the
//! test kit) in front of upstreams written in Python and Node (`tests/upstreams/`), which count
//! their own side effects. Every claim of "ran once" is the upstream's own count.
//!
//! - `proxy`: concurrency (32 identical requests, two replicas on one PostgreSQL), forwarding,
//!   the protocol's answers (missing key, mismatch, missing principal), large responses;
//! - `outcomes`: the outcome rules of docs/protocol.md#gateway (never reached, 5xx, timeout, reset, a gateway
//!   SIGKILLed mid-request) and the retries of an uncertain record (hold, resend, probe) with
//!   the operator's resolutions;
//! - `config`: bad configurations exit 2 with one line naming the setting.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod config;
mod outcomes;
mod proxy;
mod support;
