//! The other key sources of docs/protocol.md#records: `Repeatability-Request-ID` and a key in a JSON body field.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::client::Answer;
use crate::profile::{Req, Switches};

use super::{Ctx, Step, fail, na};

/// `n/a` when `a`, the answer to a request keyed only by `source`, says the target did not read
/// a key there: it refused the request as one without a key (`400`, `idempotency-key-missing`
/// where the profile has problem types). The feature is off on this target, not broken.
fn unread(ctx: &Ctx<'_>, a: &Answer, source: &str, switch: &str) -> Step<()> {
    let keyless = a.status == 400 && (!ctx.profile.problem_types || a.problem_type().as_deref() == Some(KEY_MISSING));
    if keyless {
        let problem = a.problem_type().map(|t| format!(" {t}")).unwrap_or_default();
        return Err(na(format!(
            "the target does not read a key from {source}: a request keyed only by it answered {}{problem}, \
             as one without a key{}",
            a.status,
            Switches::say(switch)
        )));
    }
    Ok(())
}

/// The problem name of a request refused for want of a key (docs/protocol.md#errors).
const KEY_MISSING: &str = "idempotency-key-missing";

/// Sends `req` keyed by `Repeatability-Request-ID` alone (a new id, sent now), and says `n/a`
/// when the target does not read it.
async fn probe_repeatability(ctx: &mut Ctx<'_>, req: &Req) -> Step<()> {
    let key = ctx.key();
    let headers = repeatable(&key, Duration::ZERO);
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_slice())).collect();
    let a = ctx.send_with(req, None, &headers).await?;
    unread(ctx, &a, "Repeatability-Request-ID", ctx.profile.switches.repeatability)
}

/// `Repeatability-Request-ID` and `Repeatability-First-Sent` for `key`, first sent `ago` back.
fn repeatable(key: &str, ago: Duration) -> [(&'static str, Vec<u8>); 2] {
    let sent = httpdate::fmt_http_date(SystemTime::now() - ago);
    [("repeatability-request-id", key.as_bytes().to_vec()), ("repeatability-first-sent", sent.into_bytes())]
}

fn repeatability_result(a: &Answer) -> Option<String> {
    a.header("repeatability-result").map(|v| v.trim().to_ascii_lowercase())
}

/// OASIS Repeatable Requests as docs/protocol.md#records maps them: the same record as `Idempotency-Key`
/// (`case`: `same_record`), `412` past the retention with nothing run (`expired`), and two
/// different keys refused (`two_keys`).
pub(super) async fn repeatability(ctx: &mut Ctx<'_>) -> Step<()> {
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
            unread(ctx, &first, "Repeatability-Request-ID", ctx.profile.switches.repeatability)?;
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
            unread(ctx, &refused, "Repeatability-Request-ID", ctx.profile.switches.repeatability)?;
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
            probe_repeatability(ctx, &req).await?;
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
pub(super) async fn body_key(ctx: &mut Ctx<'_>) -> Step<()> {
    let Some(field) = ctx.profile.body_key_field else {
        return Err(na("the profile does not promise a key in the body"));
    };
    let mut req = ctx.primary()?;
    let key = ctx.key();
    if !set_body_key(&mut req, field, &key) {
        return Err(na("the route's body is not a JSON object"));
    }
    match ctx.vector.param_str("case").unwrap_or("same_record") {
        "same_record" => {
            let first = ctx.send(&req, None).await?;
            unread(ctx, &first, &format!("the body field {field}"), ctx.profile.switches.body_key)?;
            if !first.is_success() {
                return Err(fail(format!("a new {field} in the body answered {}, not 2xx", first.summary())));
            }
            let again = ctx.send(&req, None).await?;
            ctx.expect_replay(&first, &again, &format!("the retry with the same {field}"))?;
            let header = ctx.send(&req, Some(&key)).await?;
            ctx.expect_replay(&first, &header, "the same key sent as Idempotency-Key too")
        }
        "two_keys" => {
            let probe = ctx.send(&req, None).await?;
            unread(ctx, &probe, &format!("the body field {field}"), ctx.profile.switches.body_key)?;
            // The body's key is used now: the refusal below must come from the two keys alone.
            set_body_key(&mut req, field, &ctx.key());
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

/// Puts `key` in `req`'s JSON body as `field`; false when the body is not an object.
fn set_body_key(req: &mut Req, field: &str, key: &str) -> bool {
    match req.body.as_mut() {
        Some(Value::Object(map)) => {
            map.insert(field.to_owned(), Value::String(key.to_owned()));
            true
        }
        _ => false,
    }
}
