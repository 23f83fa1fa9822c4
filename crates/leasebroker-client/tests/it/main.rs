//! Integration tests of the SDK: the retry core and the typed client against a scripted HTTP
//! server on 127.0.0.1:0, and the journal on temp SQLite files.

mod client;
mod journal;
mod operations;
mod retry;
mod server;
