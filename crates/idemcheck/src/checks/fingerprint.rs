//! The fingerprint: the same key with another request (body, query, content type) is refused,
//! and the refusal leaves the record as it was.

use crate::profile::Req;

use super::{Ctx, Step, na};

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

pub(super) async fn mismatch(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let (other, extra) = varied(ctx, &req)?;
    let key = ctx.key();
    ctx.first(&req, &key).await?;
    let a = ctx.send_with(&other, Some(key.as_bytes()), &extra).await?;
    ctx.expect_problem(&a, ctx.profile.mismatch_status, "idempotency-key-reused")
}

pub(super) async fn mismatch_not_poisoning(ctx: &mut Ctx<'_>) -> Step<()> {
    let req = ctx.primary()?;
    let key = ctx.key();
    let first = ctx.first(&req, &key).await?;
    let a = ctx.send(&req.variant(), Some(&key)).await?;
    ctx.expect_problem(&a, ctx.profile.mismatch_status, "idempotency-key-reused")?;
    let again = ctx.send(&req, Some(&key)).await?;
    ctx.expect_replay(&first, &again, "the original request after a mismatch")
}
