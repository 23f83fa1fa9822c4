//! Integration tests of the SDK: the retry core and the typed client against a scripted HTTP
//! server on 127.0.0.1:0, and the journal on temp SQLite files.

// A test is one scenario read top to bottom; the 100-line rule is for the code it tests.
#![allow(clippy::too_many_lines)]

mod client;
mod journal;
mod operations;
mod retry;
mod server;

/// The message and every `source()` after it, joined as `{:#}` of an anyhow chain prints them.
pub(crate) fn full_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(e) = cause {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cause = e.source();
    }
    out
}
