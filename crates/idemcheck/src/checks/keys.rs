//! The key header itself: the keys taken and the keys refused (refused before anything runs),
//! its two forms naming one key, a request without one, and the header name's case.

use serde_json::Value;

use super::{Ctx, Step, fail, na};

pub(super) async fn key_accepted(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn key_rejected(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn key_forms_equal(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.sf_keys {
        return Err(na("the profile takes keys as bare strings only"));
    }
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &format!("\"{key}\"")).await?;
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the bare form of the same key")
}

pub(super) async fn missing_key(ctx: &mut Ctx<'_>) -> Step<()> {
    if !ctx.profile.key_required {
        return Err(na("the profile runs requests without a key unprotected"));
    }
    let req = ctx.primary()?;
    let a = ctx.send(&req, None).await?;
    ctx.expect_problem(&a, 400, "idempotency-key-missing")
}

pub(super) async fn header_case(ctx: &mut Ctx<'_>) -> Step<()> {
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
