//! The layer's behaviour, end to end: an axum Router driven through `oneshot`, and a real TCP
//! server where the claim is about connections. Every handler counts its own side effects. One
//! test binary, a module per theme, and one shared fixture (the counting routes).

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod concurrency;
mod fixture;
mod limits;
mod long_running;
#[cfg(feature = "reqwest")]
mod propagation;
mod protocol;
mod replay;
mod requests;
mod service;
mod sources;
mod uncertain;
