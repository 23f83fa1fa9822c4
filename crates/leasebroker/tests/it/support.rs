//! What the black-box tests share, from the workspace's test kit (`testkit`): starting the real
//! binary (and the standalone simulator), sending requests, and reading ground truth (the fleet,
//! the simulator's stats). The names are the ones the tests have always used.

pub(crate) use testkit::api::{
    Reply, assert_one_worker_node_and_lease, create, create_until_done, fleet, http, send, set_faults, sim_stats,
    worker_body,
};
pub(crate) use testkit::leasebroker::serve_with_env;
pub(crate) use testkit::tokens::{ADMIN, ALICE as TOKEN, BOB as OTHER};
pub(crate) use testkit::{Launch, Proc, serve, sim, sqlite_url, start};

/// The binary under test: `$LEASEBROKER_BIN` (another build, for example the one before a fix),
/// else the one this test build made. `Command::new(BIN)` runs it.
pub(crate) const BIN: testkit::Binary = testkit::LEASEBROKER;

/// A running server, for tests that read what it logged.
pub(crate) type Logged = Proc;

/// [`BIN`]'s path.
pub(crate) fn bin() -> String {
    BIN.path().display().to_string()
}
