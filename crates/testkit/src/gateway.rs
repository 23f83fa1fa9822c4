//! Starting `idempotency-gateway` in front of an upstream, on ports of its own.

use crate::binaries::GATEWAY;
use crate::process::{Launch, Proc};

/// The admin token [`Launch::gateway`] gives every gateway.
pub const ADMIN_TOKEN: &str = "test-gateway-admin-token";

/// What a gateway prints before its `listening on` line: its admin listener's address.
const ADMIN_LINE: &str = "admin on http://";

impl Launch {
    /// `idempotency-gateway --upstream UPSTREAM --record-store STORE` on `127.0.0.1:0` for both
    /// listeners, with the kit's [`ADMIN_TOKEN`], then `extra`.
    pub fn gateway(upstream: &str, store: &str, extra: &[&str]) -> Self {
        let mut args = vec![
            "--upstream",
            upstream,
            "--record-store",
            store,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--admin-token",
            ADMIN_TOKEN,
        ];
        args.extend_from_slice(extra);
        Self::of(GATEWAY, &args)
    }
}

/// Starts a gateway ([`Launch::gateway`]) and waits for its address ([`Proc::url`]);
/// [`admin_url`] gives its admin listener's.
pub fn start(upstream: &str, store: &str, extra: &[&str]) -> Proc {
    Launch::gateway(upstream, store, extra).start()
}

/// The admin listener's address, `http://HOST:PORT`, of a gateway the kit started.
pub fn admin_url(gateway: &Proc) -> String {
    let printed = gateway.stdout();
    let line = printed.lines().find_map(|l| l.find(ADMIN_LINE).map(|i| &l[i + "admin on ".len()..]));
    line.unwrap_or_else(|| panic!("the gateway printed no admin address: {printed}")).trim().to_owned()
}
