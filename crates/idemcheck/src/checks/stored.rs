//! What is stored: a 4xx is a decision and is replayed, a 5xx and a refused token are not, a GET
//! ignores the key, and a retry of a long-running operation attaches to it.

use crate::profile::{Req, Switches};

use super::{Ctx, Step, fail, na};

pub(super) async fn stored_status(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn not_stored(ctx: &mut Ctx<'_>) -> Step<()> {
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
            if first.is_success() {
                return Err(na(format!(
                    "{} answered {}, not a 5xx: this target has no failure to show here{}",
                    req.describe(),
                    first.status,
                    Switches::say(ctx.profile.switches.server_error)
                )));
            }
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

pub(super) async fn get_ignores_key(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn long_running(ctx: &mut Ctx<'_>) -> Step<()> {
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
