#![doc = include_str!("../README.md")]
//!
//! The parts: [`Client`] (built by a [`ClientBuilder`], answering a [`Response`] or an
//! [`Error`]), the [`retry`] core with its [`OpKey`] and [`RetryPolicy`], and the [`journal`].

mod client;
mod error;
pub mod journal;
pub mod retry;
mod types;

pub use client::{Client, ClientBuilder, Mutation, Response};
pub use error::{Error, IN_PROGRESS, KEY_REUSED, Problem, retry_after};
pub use retry::{OpKey, RetryPolicy};
pub use types::{CreateWorker, Fleet, InvalidWorkerId, RebootResult, Worker, WorkerId, WorkerPage, WorkerState};
