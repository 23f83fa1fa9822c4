//! The checks vectors name. Each sends requests to the target and says `pass`, `fail` with why,
//! or `n/a` with what the target (or the profile) lacks.

mod concurrency;
mod ctx;
mod expiry;
mod fingerprint;
mod key_sources;
mod keys;
mod replay;
mod scope;
mod stored;

pub(crate) use ctx::Ctx;

use concurrency::{concurrent, in_flight, prefer_wait};
use expiry::expiry;
use fingerprint::{mismatch, mismatch_not_poisoning};
use key_sources::{body_key, repeatability};
use keys::{header_case, key_accepted, key_forms_equal, key_rejected, missing_key};
use replay::{replay_after_delete, replay_bytes, replay_header};
use scope::{scope_endpoint, scope_principal};
use stored::{get_ignores_key, long_running, not_stored, stored_status};

/// Every check a vector may name.
pub(crate) const KINDS: [&str; 22] = [
    "key_accepted",
    "key_rejected",
    "key_forms_equal",
    "missing_key",
    "header_case",
    "scope_principal",
    "scope_endpoint",
    "mismatch",
    "mismatch_not_poisoning",
    "replay_bytes",
    "replay_header",
    "replay_after_delete",
    "concurrent",
    "in_flight",
    "prefer_wait",
    "expiry",
    "stored_status",
    "not_stored",
    "get_ignores_key",
    "long_running",
    "repeatability",
    "body_key",
];

/// How a vector ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Pass,
    Fail(String),
    NotApplicable(String),
}

type Step<T> = Result<T, Verdict>;

fn fail(why: impl Into<String>) -> Verdict {
    Verdict::Fail(why.into())
}

fn na(why: impl Into<String>) -> Verdict {
    Verdict::NotApplicable(why.into())
}

/// Runs the vector's check.
pub(crate) async fn run(ctx: &mut Ctx<'_>) -> Verdict {
    if !ctx.vector.applies_to(ctx.profile.name) {
        return na(format!("not a rule of profile {}", ctx.profile.name));
    }
    let result = match ctx.vector.check.as_str() {
        "key_accepted" => key_accepted(ctx).await,
        "key_rejected" => key_rejected(ctx).await,
        "key_forms_equal" => key_forms_equal(ctx).await,
        "missing_key" => missing_key(ctx).await,
        "header_case" => header_case(ctx).await,
        "scope_principal" => scope_principal(ctx).await,
        "scope_endpoint" => scope_endpoint(ctx).await,
        "mismatch" => mismatch(ctx).await,
        "mismatch_not_poisoning" => mismatch_not_poisoning(ctx).await,
        "replay_bytes" => replay_bytes(ctx).await,
        "replay_header" => replay_header(ctx).await,
        "replay_after_delete" => replay_after_delete(ctx).await,
        "concurrent" => concurrent(ctx).await,
        "in_flight" => in_flight(ctx).await,
        "prefer_wait" => prefer_wait(ctx).await,
        "expiry" => expiry(ctx).await,
        "stored_status" => stored_status(ctx).await,
        "not_stored" => not_stored(ctx).await,
        "get_ignores_key" => get_ignores_key(ctx).await,
        "long_running" => long_running(ctx).await,
        "repeatability" => repeatability(ctx).await,
        "body_key" => body_key(ctx).await,
        other => Err(na(format!("unknown check {other}"))),
    };
    match result {
        Ok(()) => Verdict::Pass,
        Err(v) => v,
    }
}
