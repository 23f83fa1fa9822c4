//! The other key sources of SPEC 1.3: `Repeatability-Request-ID` and a key in a JSON body field.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::client::Answer;

use super::{Ctx, Step, fail, na};

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
pub(super) async fn body_key(ctx: &mut Ctx<'_>) -> Step<()> {
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
