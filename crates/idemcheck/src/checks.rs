//! The checks vectors name. Each sends requests to the target and says `pass`, `fail` with why,
//! or `n/a` with what the target (or the profile) lacks.

use std::time::{Duration, SystemTime};

use futures::future::join_all;
use serde_json::Value;

use crate::client::{Answer, Exchange, Target};
use crate::profile::{Profile, Req};
use crate::vectors::Vector;

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

pub(crate) struct Ctx<'a> {
    pub(crate) target: &'a Target,
    pub(crate) profile: &'a Profile,
    pub(crate) vector: &'a Vector,
    pub(crate) log: Vec<Exchange>,
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

impl Ctx<'_> {
    /// A key no earlier run used.
    fn key(&self) -> String {
        let id: String = self.vector.id.chars().take(40).collect();
        format!("idemcheck-{id}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
    }

    fn primary(&self) -> Step<Req> {
        self.profile.primary.clone().ok_or_else(|| na("no route to test: give --route 'POST /path' --body JSON"))
    }

    async fn send(&mut self, req: &Req, key: Option<&str>) -> Step<Answer> {
        self.send_with(req, key.map(str::as_bytes), &[]).await
    }

    async fn send_with(&mut self, req: &Req, key: Option<&[u8]>, extra: &[(&str, &[u8])]) -> Step<Answer> {
        if !self.target.has_token(req.token) {
            return Err(na(format!("needs a token number {} (--token, repeated)", req.token + 1)));
        }
        let mut log = std::mem::take(&mut self.log);
        let r = self.target.send(req, key, extra, &mut log).await;
        self.log = log;
        r.map_err(fail)
    }

    /// The route's first answer must be a success for the check to mean anything.
    async fn first(&mut self, req: &Req, key: &str) -> Step<Answer> {
        let a = self.send(req, Some(key)).await?;
        if !a.is_success() {
            return Err(fail(format!("{} with a new key answered {}, not 2xx", req.describe(), a.summary())));
        }
        Ok(a)
    }

    /// Whether `again` is a replay of `first`: the profile's replay header when it has one,
    /// else the same status and body.
    fn is_replay(&self, first: &Answer, again: &Answer) -> bool {
        let same = first.status == again.status && first.body == again.body;
        match self.profile.replay_header {
            Some((name, value)) => same && again.header(name) == Some(value),
            None => same,
        }
    }

    /// Whether `again` looks like `first` answered again: the profile's replay header, or the
    /// same status and body even without it (the route's answers differ between executions:
    /// each carries what it created). For the checks where a replay is the failure, so that a
    /// target that replays without the header is not taken for one that ran the request.
    fn looks_replayed(&self, first: &Answer, again: &Answer) -> bool {
        let marked = self.profile.replay_header.is_some_and(|(name, value)| again.header(name) == Some(value));
        marked || (first.status == again.status && first.body == again.body)
    }

    fn expect_replay(&self, first: &Answer, again: &Answer, what: &str) -> Step<()> {
        if self.is_replay(first, again) {
            return Ok(());
        }
        let header = match self.profile.replay_header {
            Some((n, v)) => format!(" with {n}: {v}"),
            None => String::new(),
        };
        Err(fail(format!("{what}: expected a replay of {}{header}, got {}", first.summary(), again.summary())))
    }

    fn expect_problem(&self, a: &Answer, status: u16, name: &str) -> Step<()> {
        if a.status != status {
            return Err(fail(format!("expected {status} ({name}), got {}", a.summary())));
        }
        if self.profile.problem_types && a.problem_type().as_deref() != Some(name) {
            return Err(fail(format!("expected a problem of type .../{name}, got {}", a.summary())));
        }
        Ok(())
    }

    async fn count(&mut self) -> Step<Option<i64>> {
        let Some(counter) = self.profile.counter.clone() else { return Ok(None) };
        let mut total = 0i64;
        let mut path = counter.path.clone();
        for _ in 0..10_000 {
            let mut log = std::mem::take(&mut self.log);
            let got = self.target.get(&path, &mut log).await;
            self.log = log;
            let a = got.map_err(fail)?;
            if a.status != 200 {
                return Err(fail(format!("the counter {} answered {}", counter.describe, a.summary())));
            }
            let v = a.json();
            match v.pointer(&counter.pointer) {
                Some(Value::Array(items)) => total += items.len() as i64,
                Some(Value::Number(n)) => total += n.as_i64().unwrap_or_default(),
                _ => return Err(fail(format!("the counter has no {} in {}", counter.pointer, a.summary()))),
            }
            let next = counter
                .next
                .as_ref()
                .and_then(|(ptr, param)| v.pointer(ptr).and_then(Value::as_str).map(|c| (param.clone(), c.to_owned())));
            match next {
                Some((param, cursor)) => {
                    let sep = if counter.path.contains('?') { '&' } else { '?' };
                    path = format!("{}{sep}{param}={cursor}", counter.path);
                }
                None => return Ok(Some(total)),
            }
        }
        Err(fail("the counter's pages never ended"))
    }
}

async fn key_accepted(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let fresh = ctx.key();
    let key = match ctx.vector.param_str("form").unwrap_or("bare") {
        "bare" => fresh,
        "sf" | "sf-comma" if !ctx.profile.sf_keys => {
            return Err(na("the profile takes keys as bare strings, not Structured Field Strings"));
        }
        "sf" => format!("\"{fresh}\""),
        "sf-comma" => format!("\"a,{fresh}\""),
        "max-length" => {
            let n = ctx.vector.params.get("length").and_then(Value::as_u64).unwrap_or(128) as usize;
            let mut k = fresh;
            while k.len() < n {
                k.push('x');
            }
            k.truncate(n);
            k
        }
        other => return Err(na(format!("unknown form {other}"))),
    };
    let first = ctx.first(&req, &key).await?;
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the same key again")
}

async fn key_rejected(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let fresh = ctx.key();
    let before = ctx.count().await?;
    let answer = match ctx.vector.param_str("value").unwrap_or_default() {
        "repeated" => {
            let second = format!("{fresh}-2");
            let extra: [(&str, &[u8]); 1] = [("Idempotency-Key", second.as_bytes())];
            ctx.send_with(&req, Some(fresh.as_bytes()), &extra).await?
        }
        value => {
            let raw: Vec<u8> = match value {
                "empty" => Vec::new(),
                "too-long" => {
                    let n = ctx.vector.params.get("length").and_then(Value::as_u64).unwrap_or(129) as usize;
                    let mut k = fresh.clone().into_bytes();
                    k.resize(n, b'x');
                    k
                }
                "non-ascii" => format!("{fresh}-caf\u{e9}").into_bytes().into_iter().collect(),
                "latin1" => {
                    let mut k = fresh.clone().into_bytes();
                    k.push(0xe9);
                    k
                }
                "control" => format!("{fresh}\tx").into_bytes(),
                "bare-comma" => format!("{fresh},x").into_bytes(),
                "space" => format!("{fresh} x").into_bytes(),
                "sf-unterminated" => format!("\"{fresh}").into_bytes(),
                other => return Err(na(format!("unknown value {other}"))),
            };
            ctx.send_with(&req, Some(&raw), &[]).await?
        }
    };
    ctx.expect_problem(&answer, 400, "idempotency-key-invalid")?;
    if let (Some(before), Some(after)) = (before, ctx.count().await?)
        && after != before
    {
        return Err(fail(format!("the refused request ran anyway: the counter went {before} -> {after}")));
    }
    Ok(())
}

async fn key_forms_equal(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.sf_keys {
        return Err(na("the profile takes keys as bare strings only"));
    }
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &format!("\"{key}\"")).await?;
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the bare form of the same key")
}

async fn missing_key(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.key_required {
        return Err(na("the profile runs requests without a key unprotected"));
    }
    let req = ctx.primary()?;
    let a = ctx.send(&req, None).await?;
    ctx.expect_problem(&a, 400, "idempotency-key-missing")
}

async fn header_case(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let key = ctx.key();
    let names: Vec<String> = ctx
        .vector
        .params
        .get("names")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect())
        .unwrap_or_else(|| vec!["Idempotency-Key".into(), "IDEMPOTENCY-KEY".into()]);
    let mut answers = Vec::new();
    for name in &names {
        let mut log = std::mem::take(&mut ctx.log);
        let got = ctx.target.send_with_header_name(&req, name, &key, &mut log).await;
        ctx.log = log;
        match got.map_err(fail)? {
            Some(a) => answers.push(a),
            None => return Err(na("only http:// targets: the name's case is sent over a plain connection")),
        }
    }
    let first = &answers[0];
    if !first.is_success() {
        return Err(fail(format!("the first request answered {}", first.summary())));
    }
    for (name, a) in names.iter().zip(&answers).skip(1) {
        ctx.expect_replay(first, a, &format!("the key sent as {name:?}"))?;
    }
    Ok(())
}

async fn scope_principal(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    if !ctx.target.has_token(1) {
        return Err(na("needs a second principal: give --token twice"));
    }
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let other = ctx.send(&req.clone().with_token(1), Some(&key)).await?;
    if !other.is_success() {
        return Err(fail(format!("another principal's first use of the key answered {}", other.summary())));
    }
    if ctx.looks_replayed(&first, &other) {
        return Err(fail(format!(
            "another principal's request with the key got the first principal's response: {}",
            other.summary()
        )));
    }
    Ok(())
}

async fn scope_endpoint(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let Some(second) = ctx.profile.secondary.clone() else {
        return Err(na("needs a second endpoint: give --route twice"));
    };
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let other = ctx.send(&second, Some(&key)).await?;
    let reused = other.status == ctx.profile.mismatch_status
        && (!ctx.profile.problem_types || other.problem_type().as_deref() == Some("idempotency-key-reused"));
    if reused {
        return Err(fail(format!(
            "the key on another endpoint was taken for the first endpoint's record: {}",
            other.summary()
        )));
    }
    if ctx.looks_replayed(&first, &other) {
        return Err(fail(format!("the other endpoint replayed the first endpoint's response: {}", other.summary())));
    }
    Ok(())
}

/// The primary request varied as the vector says: another body, query or content type.
/// Extra request headers: (name, value).
type Headers = Vec<(&'static str, &'static [u8])>;

fn varied(ctx: &Ctx<'_>, req: &Req) -> Step<(Req, Headers)> {
    match ctx.vector.param_str("vary").unwrap_or("body") {
        "body" => Ok((req.variant(), vec![])),
        "query" if !ctx.profile.full_fingerprint => Err(na("the profile does not fingerprint the query string")),
        "query" => {
            let sep = if req.path.contains('?') { '&' } else { '?' };
            Ok((Req { path: format!("{}{sep}idemcheck=1", req.path), ..req.clone() }, vec![]))
        }
        "content_type" if !ctx.profile.full_fingerprint => Err(na("the profile does not fingerprint the content type")),
        "content_type" => Ok((req.clone(), vec![("content-type", b"text/plain".as_slice())])),
        other => Err(na(format!("unknown vary {other}"))),
    }
}

async fn mismatch(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let (other, extra) = varied(ctx, &req)?;
    let key = ctx.key();
    ctx.first(&req, &key).await?;
    let a = ctx.send_with(&other, Some(key.as_bytes()), &extra).await?;
    ctx.expect_problem(&a, ctx.profile.mismatch_status, "idempotency-key-reused")
}

async fn mismatch_not_poisoning(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let a = ctx.send(&req.variant(), Some(&key)).await?;
    ctx.expect_problem(&a, ctx.profile.mismatch_status, "idempotency-key-reused")?;
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the original request after a mismatch")
}

async fn replay_bytes(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let again = ctx.send(&req, Some(&key)).await?;
    if again.status != first.status {
        return Err(fail(format!("status {} replayed as {}", first.status, again.status)));
    }
    if again.body != first.body {
        return Err(fail(format!("the body differs: {} then {}", first.summary(), again.summary())));
    }
    for name in ["content-type", "location"] {
        if first.header(name) != again.header(name) {
            return Err(fail(format!("{name}: {:?} replayed as {:?}", first.header(name), again.header(name))));
        }
    }
    Ok(())
}

async fn replay_header(ctx: &mut Ctx<'_>) -> Step<()> {
    let Some((name, value)) = ctx.profile.replay_header else {
        return Err(na("the profile names no replay header"));
    };
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    if first.header(name).is_some_and(|v| v == value) {
        return Err(fail(format!("the first execution already says {name}: {value}")));
    }
    let again = ctx.send(&req, Some(&key)).await?;
    if again.header(name) != Some(value) {
        return Err(fail(format!("the replay says {name}: {:?}, not {value:?}", again.header(name))));
    }
    Ok(())
}

async fn replay_after_delete(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.delete_location {
        return Err(na("the profile names no way to delete what the route created"));
    }
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let Some(location) = first.header("location").map(str::to_owned) else {
        return Err(fail("the created resource has no Location to delete"));
    };
    let delete = Req { method: "DELETE".into(), path: location.clone(), body: None, token: req.token };
    let deleted = ctx.send(&delete, Some(&ctx.key())).await?;
    if !deleted.is_success() {
        return Err(fail(format!("DELETE {location} answered {}", deleted.summary())));
    }
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the key after its resource was deleted")
}

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

async fn concurrent(ctx: &mut Ctx<'_>) -> Step<()> {
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
async fn overlap(ctx: &mut Ctx<'_>, extra: &[(&str, &[u8])]) -> Step<(Answer, Answer)> {
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

async fn in_flight(ctx: &mut Ctx<'_>) -> Step<()> {
    let (_, dup) = overlap(ctx, &[]).await?;
    ctx.expect_problem(&dup, 409, "request-in-progress")?;
    match dup.header("retry-after") {
        Some(v) if v.trim().parse::<u64>().is_ok() || httpdate::parse_http_date(v).is_ok() => Ok(()),
        other => Err(fail(format!("the 409 has no valid Retry-After ({other:?})"))),
    }
}

async fn prefer_wait(ctx: &mut Ctx<'_>) -> Step<()> {
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

fn expires_at(a: &Answer) -> Step<SystemTime> {
    let Some(v) = a.header("idempotency-key-expires") else {
        return Err(fail(format!("no Idempotency-Key-Expires on {}", a.summary())));
    };
    // An IMF-fixdate is exactly 29 characters and ends in GMT.
    if v.len() != 29 || !v.ends_with(" GMT") {
        return Err(fail(format!("Idempotency-Key-Expires {v:?} is not an IMF-fixdate")));
    }
    let at = httpdate::parse_http_date(v).map_err(|_| fail(format!("Idempotency-Key-Expires {v:?} is not a date")))?;
    if at <= SystemTime::now() {
        return Err(fail(format!("Idempotency-Key-Expires {v:?} is in the past")));
    }
    Ok(at)
}

async fn expiry(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.expires_header {
        return Err(na("the profile does not promise Idempotency-Key-Expires"));
    }
    let req = ctx.primary()?;
    match ctx.vector.param_str("on").unwrap_or("first") {
        "in_flight" => {
            let (_, dup) = overlap(ctx, &[]).await?;
            if dup.status != 409 {
                return Err(fail(format!("the duplicate in flight got {}", dup.summary())));
            }
            expires_at(&dup).map(drop)
        }
        on => {
            let key = ctx.key();
            let first = ctx.first(&req, &key).await?;
            let stored = expires_at(&first)?;
            let again = match on {
                "first" => return Ok(()),
                "replay" => ctx.send(&req, Some(&key)).await?,
                "mismatch" => ctx.send(&req.variant(), Some(&key)).await?,
                other => return Err(na(format!("unknown on {other}"))),
            };
            if expires_at(&again)? != stored {
                return Err(fail("the record's expiry changed between the first answer and this one"));
            }
            Ok(())
        }
    }
}

async fn stored_status(ctx: &mut Ctx<'_>) -> Step<()> {
    let Some(req) = ctx.profile.stored_error.clone() else {
        return Err(na("the profile names no request answered with a stored 4xx"));
    };
    let key = ctx.key();
    let first = ctx.send(&req, Some(&key)).await?;
    if !(400..500).contains(&first.status) {
        return Err(fail(format!("{} answered {}, not 4xx", req.describe(), first.summary())));
    }
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, &format!("a {} answer is a decision", first.status))
}

async fn not_stored(ctx: &mut Ctx<'_>) -> Step<()> {
    match ctx.vector.param_str("which").unwrap_or("server_error") {
        "unauthorized" => {
            let req = ctx.primary()?;
            let key = ctx.key();
            // No token of ours: only a wrong one (token slot usize::MAX is never filled).
            let extra = vec![
                ("Idempotency-Key".to_owned(), key.clone().into_bytes()),
                ("authorization".to_owned(), b"Bearer idemcheck-not-a-token".to_vec()),
            ];
            let mut log = std::mem::take(&mut ctx.log);
            let got = ctx.target.send_raw_headers(&req, &req.path, usize::MAX, &extra, &mut log).await;
            ctx.log = log;
            let refused = got.map_err(fail)?;
            if refused.status != 401 && refused.status != 403 {
                return Err(na(format!("the target does not refuse a bad token (answered {})", refused.status)));
            }
            let again = ctx.send(&req, Some(&key)).await?;
            if !again.is_success() {
                return Err(fail(format!(
                    "after a {} the same key with a good token answered {}: the refusal was stored",
                    refused.status,
                    again.summary()
                )));
            }
            Ok(())
        }
        _ => {
            let Some(req) = ctx.profile.server_error.clone() else {
                return Err(na("the profile names no request answered with a 5xx"));
            };
            let Some((name, value)) = ctx.profile.replay_header else {
                return Err(na("without a replay header a replayed 5xx cannot be told from a new one"));
            };
            let key = ctx.key();
            let first = ctx.send(&req, Some(&key)).await?;
            if first.status < 500 {
                return Err(fail(format!("{} answered {}, not 5xx", req.describe(), first.summary())));
            }
            let again = ctx.send(&req, Some(&key)).await?;
            if again.header(name) == Some(value) {
                return Err(fail(format!("the {} was stored and replayed", first.status)));
            }
            if again.status == 409 {
                return Err(fail(format!("the retry after a {} got {}", first.status, again.summary())));
            }
            Ok(())
        }
    }
}

async fn get_ignores_key(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let get = Req { method: "GET".into(), path: req.path.clone(), body: None, token: req.token };
    let a = ctx.send_with(&get, Some(b""), &[]).await?;
    if a.status == 400 {
        return Err(fail(format!("a GET with an empty key was refused: {}", a.summary())));
    }
    let key = ctx.key();
    ctx.send(&get, Some(&key)).await?;
    let again = ctx.send(&get, Some(&key)).await?;
    if let Some((name, value)) = ctx.profile.replay_header
        && again.header(name) == Some(value)
    {
        return Err(fail("a GET was replayed"));
    }
    Ok(())
}

async fn long_running(ctx: &mut Ctx<'_>) -> Step<()> {
    let Some(req) = ctx.profile.long_running.clone() else {
        return Err(na("the profile names no long-running operation"));
    };
    let key = ctx.key();
    let first = ctx.send(&req, Some(&key)).await?;
    if first.status != 202 {
        return Err(fail(format!("{} answered {}, not 202", req.describe(), first.summary())));
    }
    let Some(location) = first.header("location").map(str::to_owned) else {
        return Err(fail("the 202 has no Location to follow"));
    };
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "a retry while the operation runs")?;
    if again.header("location") != Some(location.as_str()) {
        return Err(fail("the retry points at another operation"));
    }
    let follow = Req { method: "GET".into(), path: location.clone(), body: None, token: req.token };
    let op = ctx.send(&follow, None).await?;
    if op.status != 200 {
        return Err(fail(format!("GET {location} answered {}", op.summary())));
    }
    Ok(())
}

/// `Repeatability-Request-ID` and `Repeatability-First-Sent` for `key`, first sent `ago` back.
fn repeatable(key: &str, ago: Duration) -> [(&'static str, Vec<u8>); 2] {
    let sent = httpdate::fmt_http_date(SystemTime::now() - ago);
    [("repeatability-request-id", key.as_bytes().to_vec()), ("repeatability-first-sent", sent.into_bytes())]
}

fn repeatability_result(a: &Answer) -> Option<String> {
    a.header("repeatability-result").map(|v| v.trim().to_ascii_lowercase())
}

/// OASIS Repeatable Requests as SPEC 1.3 maps them: the same record as `Idempotency-Key`
/// (`case`: `same_record`), `412` past the retention with nothing run (`expired`), and two
/// different keys refused (`two_keys`).
async fn repeatability(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.repeatability {
        return Err(na("the profile does not promise Repeatability-Request-ID"));
    }
    let req = ctx.primary()?;
    let key = ctx.key();
    let now = repeatable(&key, Duration::ZERO);
    let now: Vec<(&str, &[u8])> = now.iter().map(|(n, v)| (*n, v.as_slice())).collect();
    match ctx.vector.param_str("case").unwrap_or("same_record") {
        "same_record" => {
            let first = ctx.send_with(&req, None, &now).await?;
            if !first.is_success() {
                return Err(fail(format!("a new Repeatability-Request-ID answered {}, not 2xx", first.summary())));
            }
            if repeatability_result(&first).as_deref() != Some("accepted") {
                return Err(fail(format!(
                    "the first answer says Repeatability-Result {:?}",
                    repeatability_result(&first)
                )));
            }
            let again = ctx.send_with(&req, None, &now).await?;
            ctx.expect_replay(&first, &again, "the retry with the same Repeatability-Request-ID")?;
            if repeatability_result(&again).as_deref() != Some("accepted") {
                return Err(fail(format!("the replay says Repeatability-Result {:?}", repeatability_result(&again))));
            }
            let header = ctx.send(&req, Some(&key)).await?;
            ctx.expect_replay(&first, &header, "the same key sent as Idempotency-Key")
        }
        "expired" => {
            let old = repeatable(&key, Duration::from_secs(400 * 86_400));
            let old: Vec<(&str, &[u8])> = old.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            let refused = ctx.send_with(&req, None, &old).await?;
            if refused.status != 412 {
                return Err(fail(format!("first sent 400 days ago: {}, not 412", refused.summary())));
            }
            if repeatability_result(&refused).as_deref() != Some("rejected") {
                return Err(fail(format!("the 412 says Repeatability-Result {:?}", repeatability_result(&refused))));
            }
            // Nothing was kept: sent again now, the request runs as a new one.
            let fresh = ctx.send_with(&req, None, &now).await?;
            if !fresh.is_success() {
                return Err(fail(format!("after the 412 the same id sent now answered {}", fresh.summary())));
            }
            if ctx.profile.replay_header.is_some_and(|(n, v)| fresh.header(n) == Some(v)) {
                return Err(fail("after the 412 the same id sent now was a replay: the refusal kept a record"));
            }
            Ok(())
        }
        "two_keys" => {
            let other = ctx.key();
            let two = ctx.send_with(&req, Some(other.as_bytes()), &now).await?;
            if two.status != 400 {
                return Err(fail(format!("two different keys (two headers) answered {}, not 400", two.summary())));
            }
            Ok(())
        }
        other => Err(na(format!("unknown case {other}"))),
    }
}

/// A key in a JSON body field (AIP-155 `request_id`): the same record as `Idempotency-Key`
/// (`case`: `same_record`), and a body key different from the header's refused (`two_keys`).
async fn body_key(ctx: &mut Ctx<'_>) -> Step<()> {
    let Some(field) = ctx.profile.body_key_field else {
        return Err(na("the profile does not promise a key in the body"));
    };
    let mut req = ctx.primary()?;
    let key = ctx.key();
    match req.body.as_mut() {
        Some(Value::Object(map)) => {
            map.insert(field.to_owned(), Value::String(key.clone()));
        }
        _ => return Err(na("the route's body is not a JSON object")),
    }
    match ctx.vector.param_str("case").unwrap_or("same_record") {
        "same_record" => {
            let first = ctx.send(&req, None).await?;
            if !first.is_success() {
                return Err(fail(format!("a new {field} in the body answered {}, not 2xx", first.summary())));
            }
            let again = ctx.send(&req, None).await?;
            ctx.expect_replay(&first, &again, &format!("the retry with the same {field}"))?;
            let header = ctx.send(&req, Some(&key)).await?;
            ctx.expect_replay(&first, &header, "the same key sent as Idempotency-Key too")
        }
        "two_keys" => {
            let other = ctx.key();
            let two = ctx.send(&req, Some(&other)).await?;
            if two.status != 400 {
                return Err(fail(format!("a header key and another {field} answered {}, not 400", two.summary())));
            }
            Ok(())
        }
        other => Err(na(format!("unknown case {other}"))),
    }
}
