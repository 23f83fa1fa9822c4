//! `Idempotency-Key-Expires`: an IMF-fixdate in the future, the same on every answer of one record.

use std::time::SystemTime;

use crate::client::Answer;

use super::concurrency::overlap;
use super::{Ctx, Step, fail, na};

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

pub(super) async fn expiry(ctx: &mut Ctx<'_>) -> Step<()> {
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
