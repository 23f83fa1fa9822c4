//! The properties the fuzz targets check, as plain functions: each `fuzz_targets/*.rs` is one
//! line that hands libFuzzer's input to one of them, and any other driver (a replay of the
//! committed corpus, a debugger) calls the same code. A failed property panics; under libFuzzer
//! that panic is the crash it reports and saves.

pub mod fingerprint;
pub mod key;
pub mod layer;
pub mod worker;
