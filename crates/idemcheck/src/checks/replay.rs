//! The replay: the same bytes, marked by the profile's replay header, and still the same after
//! the resource was deleted.

use crate::profile::Req;

use super::{Ctx, Step, fail, na};

pub(super) async fn replay_bytes(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn replay_header(ctx: &mut Ctx<'_>) -> Step<()> {
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

pub(super) async fn replay_after_delete(ctx: &mut Ctx<'_>) -> Step<()> {
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
