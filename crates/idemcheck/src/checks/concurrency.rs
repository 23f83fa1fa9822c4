//! Duplicates while the first request runs: many at once run once, one in flight is a `409` with
//! `Retry-After`, or waits with `Prefer: wait`.

use std::time::Duration;

use futures::future::join_all;
use serde_json::Value;

use crate::client::Answer;
use crate::profile::Req;

use super::{Ctx, Step, fail, na};

/// Sends `n` copies of `req` with `key` at once.
async fn burst(ctx: &mut Ctx<'_>, req: &Req, key: &str, n: usize, extra: &[(&str, &[u8])]) -> Step<Vec<Answer>> {
    if !ctx.target.has_token(req.token) {
        return Err(na("needs a token"));
    }
    let target = ctx.target;
    let sends = (0..n).map(|_| async move {
        let mut log = Vec::new();
        let got = target.send(req, Some(key.as_bytes()), extra, &mut log).await;
        (got, log)
    });
    let mut answers = Vec::with_capacity(n);
    for (got, log) in join_all(sends).await {
        ctx.log.extend(log);
        answers.push(got.map_err(fail)?);
    }
    Ok(answers)
}

pub(super) async fn concurrent(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let n = ctx.vector.params.get("n").and_then(Value::as_u64).unwrap_or(32) as usize;
    let key = ctx.key();
    let before = ctx.count().await?;
    let answers = burst(ctx, &req, &key, n, &[]).await?;
    let after = ctx.count().await?;
    // Only the last exchanges are worth a report: keep the burst short in it.
    let successes: Vec<&Answer> = answers.iter().filter(|a| a.is_success()).collect();
    let in_progress = answers.iter().filter(|a| a.status == 409).count();
    if successes.len() + in_progress != n {
        let odd = answers.iter().find(|a| !a.is_success() && a.status != 409).map(Answer::summary);
        return Err(fail(format!("an answer was neither 2xx nor 409: {}", odd.unwrap_or_default())));
    }
    // The counter first: it says how many times, where the answers only say "more than once".
    if let (Some(b), Some(a)) = (before, after)
        && a - b != 1
    {
        return Err(fail(format!("{n} duplicates at once ran {} times (the counter went {b} -> {a})", a - b)));
    }
    if let Some(first) = successes.first()
        && successes.iter().any(|a| a.body != first.body)
    {
        return Err(fail("the 2xx answers differ: the request ran more than once"));
    }
    if successes.is_empty() {
        return Err(fail("no duplicate got a 2xx"));
    }
    Ok(())
}

/// Starts the primary request with a new key, and while it runs sends a duplicate with `extra`
/// headers. Tries a few times when the first one ends before the duplicate arrives.
/// Returns (first, duplicate).
pub(super) async fn overlap(ctx: &mut Ctx<'_>, extra: &[(&str, &[u8])]) -> Step<(Answer, Answer)> {
    let req = ctx.primary()?;
    for _ in 0..5 {
        let key = ctx.key();
        let target = ctx.target;
        let (first, second) = {
            let (req, key) = (&req, &key);
            let first = async move {
                let mut log = Vec::new();
                (target.send(req, Some(key.as_bytes()), &[], &mut log).await, log)
            };
            let second = async move {
                // The duplicate is sent a moment after, so the first one has claimed the key.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut log = Vec::new();
                (target.send(req, Some(key.as_bytes()), extra, &mut log).await, log)
            };
            tokio::join!(first, second)
        };
        ctx.log.extend(first.1);
        ctx.log.extend(second.1);
        let (first, second) = (first.0.map_err(fail)?, second.0.map_err(fail)?);
        if !first.is_success() {
            return Err(fail(format!("the first request answered {}", first.summary())));
        }
        // The first one had ended before the duplicate arrived: a plain replay, try again.
        if ctx.looks_replayed(&first, &second) && second.header("preference-applied").is_none() {
            continue;
        }
        return Ok((first, second));
    }
    Err(na("the route answers faster than a duplicate can arrive (5 tries); give a slower --route"))
}

pub(super) async fn in_flight(ctx: &mut Ctx<'_>) -> Step<()> {
    let (_, dup) = overlap(ctx, &[]).await?;
    ctx.expect_problem(&dup, 409, "request-in-progress")?;
    match dup.header("retry-after") {
        Some(v) if v.trim().parse::<u64>().is_ok() || httpdate::parse_http_date(v).is_ok() => Ok(()),
        other => Err(fail(format!("the 409 has no valid Retry-After ({other:?})"))),
    }
}

pub(super) async fn prefer_wait(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.prefer_wait {
        return Err(na("the profile does not promise Prefer: wait"));
    }
    let (first, dup) = overlap(ctx, &[("prefer", b"wait=30")]).await?;
    if dup.status == 409 {
        return Err(fail(format!("a duplicate that prefers to wait 30 s got {}", dup.summary())));
    }
    ctx.expect_replay(&first, &dup, "a duplicate that waited")?;
    match dup.header("preference-applied") {
        Some(v) if v.trim().to_ascii_lowercase().starts_with("wait=") => Ok(()),
        other => Err(fail(format!("the waited replay has no Preference-Applied: wait=W ({other:?})"))),
    }
}
