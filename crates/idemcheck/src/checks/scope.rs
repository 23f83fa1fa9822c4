//! A key's scope: the same key from another principal or on another endpoint is another record.

use super::{Ctx, Step, fail, na};

pub(super) async fn scope_principal(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn scope_endpoint(ctx: &mut Ctx<'_>) -> Step<()> {
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
