#![doc = include_str!("../README.md")]
//!
//! The parts, in the order a request meets them: [`GatewayService`] (the route matcher) puts the
//! request's route options into its extensions and hands it to that route's
//! [`IdempotencyLayer`](idempotency_tower::IdempotencyLayer), whose inner service is the
//! [`Proxy`](proxy::Proxy). [`Gateway`] builds them from a [`Config`] and serves them with the
//! admin listener ([`admin`]).

pub mod admin;
mod app;
pub mod config;
mod principal;
pub mod proxy;
pub mod routes;
pub mod settings;
pub mod store;

pub use app::{Gateway, GatewayService};
pub use config::{Args, Config, ConfigError};
