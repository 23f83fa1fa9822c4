//! The tenants and the operator every test server knows: the servers the kit starts take
//! `--token ALICE=alice --token BOB=bob --admin-token ADMIN` ([`serve_flags`]).

/// Tenant alice's bearer token.
pub const ALICE: &str = "tok-alice-5a8d1c7e90b3";
/// Tenant bob's bearer token.
pub const BOB: &str = "tok-bob-3e7f0a9c2d64b1";
/// The operator's token (`--admin-token`: the `/admin` routes).
pub const ADMIN: &str = "tok-admin-8c1b4d7e2f9a";

/// The principal [`ALICE`] stands for.
pub const ALICE_PRINCIPAL: &str = "alice";
/// The principal [`BOB`] stands for.
pub const BOB_PRINCIPAL: &str = "bob";

/// All three, in the order idemcheck's `--token` takes them: two tenants, then the operator.
pub const ALL: [&str; 3] = [ALICE, BOB, ADMIN];

/// The flags that give a `leasebroker serve` the three tokens.
pub fn serve_flags() -> Vec<String> {
    let token = |token: &str, principal: &str| ["--token".to_owned(), format!("{token}={principal}")];
    let mut flags = Vec::with_capacity(6);
    flags.extend(token(ALICE, ALICE_PRINCIPAL));
    flags.extend(token(BOB, BOB_PRINCIPAL));
    flags.extend(["--admin-token".to_owned(), ADMIN.to_owned()]);
    flags
}
