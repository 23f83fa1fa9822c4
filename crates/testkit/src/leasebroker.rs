//! Starting `leasebroker serve` and `leasebroker hypervisor-sim` on a port of their own.

use std::path::Path;

use crate::process::{Launch, Proc};
use crate::tokens;

/// The pool [`serve`] gives a server unless the test sets `--pool-nodes`.
pub const POOL_NODES: &str = "16";

impl Launch {
    /// `leasebroker serve --listen 127.0.0.1:0 --database DB` with the kit's three tokens
    /// ([`tokens::serve_flags`]), then `extra`; nothing else.
    pub fn serve(db: &str, extra: &[&str]) -> Self {
        let tokens = tokens::serve_flags();
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--database", db];
        args.extend(tokens.iter().map(String::as_str));
        args.extend_from_slice(extra);
        Self::new(&args)
    }

    /// `leasebroker hypervisor-sim --listen 127.0.0.1:0`, then `extra`.
    pub fn sim(extra: &[&str]) -> Self {
        Self::new(&[&["hypervisor-sim", "--listen", "127.0.0.1:0"], extra].concat())
    }
}

/// Starts `leasebroker ARGS` and waits for its "listening on http://ADDR" line.
pub fn start(args: &[&str]) -> Proc {
    Launch::new(args).start()
}

/// Starts `leasebroker serve` on the database `db` with the kit's tokens, a pool of
/// [`POOL_NODES`] nodes unless `extra` sets `--pool-nodes`, and `extra`.
pub fn serve(db: &str, extra: &[&str]) -> Proc {
    serve_with_env(db, extra, &[])
}

/// [`serve`] with `env` set (`RUST_LOG` among it, to read what it logs).
pub fn serve_with_env(db: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let launch = Launch::serve(db, &with_pool_nodes(POOL_NODES, extra));
    env.iter().fold(launch, |l, (k, v)| l.env(k, v)).start()
}

/// Starts the standalone hypervisor simulator with `extra`.
pub fn sim(extra: &[&str]) -> Proc {
    Launch::sim(extra).start()
}

/// `extra`, after `--pool-nodes NODES` unless it sets `--pool-nodes` itself (the flag may be
/// given once).
pub fn with_pool_nodes<'a>(nodes: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let pool: &[&str] = if extra.contains(&"--pool-nodes") { &[] } else { &["--pool-nodes", nodes] };
    [pool, extra].concat()
}

/// `sqlite://DIR/lb.db`: a database file of the test's own in the temporary directory `dir`.
pub fn sqlite_url(dir: impl AsRef<Path>) -> String {
    format!("sqlite://{}", dir.as_ref().join("lb.db").display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pool_is_added_only_when_the_test_sets_none() {
        assert_eq!(with_pool_nodes("8", &["--rate-limit", "0"]), ["--pool-nodes", "8", "--rate-limit", "0"]);
        assert_eq!(with_pool_nodes("8", &["--pool-nodes", "1"]), ["--pool-nodes", "1"]);
    }
}
