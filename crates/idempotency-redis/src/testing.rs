//! Real Redis servers for tests (feature `testing`): one `redis-server` on a free port, or a
//! Cluster of three primaries joined with `redis-cli --cluster create`, each in a temporary
//! directory and killed when dropped. The binaries come from the machine (`redis-server` and
//! `redis-cli` on the `PATH`); [`have_redis_binaries`] says whether they run.
//!
//! ```no_run
//! let cluster = idempotency_redis::testing::Cluster::start();
//! println!("records go to {}", cluster.url()); // redis+cluster://127.0.0.1:P1,...
//! ```

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// True when `redis-server` and `redis-cli` run.
pub fn have_redis_binaries() -> bool {
    ["redis-server", "redis-cli"].iter().all(|b| {
        Command::new(b).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

/// A port that is free now, whose cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a port");
        let port = l.local_addr().expect("local addr").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// One `redis-server` process, killed when dropped.
#[derive(Debug)]
pub struct Node {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    child: std::sync::Mutex<Option<Child>>,
}

impl Node {
    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL) and waits for it; a second call does nothing.
    pub fn kill(&self) {
        let child = self.child.lock().map(|mut c| c.take()).unwrap_or_default();
        if let Some(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether it was not killed.
    pub fn is_alive(&self) -> bool {
        self.child.lock().is_ok_and(|c| c.is_some())
    }

    /// A new blocking connection to it.
    ///
    /// # Panics
    /// When it does not accept one.
    pub fn connection(&self) -> ::redis::Connection {
        ::redis::Client::open(self.url()).expect("url").get_connection().expect("connect to the node")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `redis-server` on a free port in `dir` with `extra` arguments and waits until it
/// answers.
///
/// # Panics
/// When no server starts after five tries.
pub fn start_server(dir: &Path, extra: &[&str]) -> Node {
    for _ in 0..5 {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--dir", &dir.display().to_string()])
            .args(["--logfile", &dir.join(format!("redis-{port}.log")).display().to_string()])
            .args(extra.iter().map(|a| a.replace("{port}", &port.to_string())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let node = Node { port, child: std::sync::Mutex::new(Some(child)) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let exited =
                node.child.lock().is_ok_and(|mut c| c.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_)))));
            if exited {
                break; // the port was taken meanwhile: try another
            }
            let ok = ::redis::Client::open(node.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| ::redis::cmd("PING").query::<String>(&mut c));
            if ok.is_ok() {
                return node;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        node.kill();
    }
    panic!("redis-server did not start in {}", dir.display());
}

/// Three primaries on free ports in a temp dir, joined into a cluster; killed and removed
/// when dropped (nodes first, then the dir).
#[derive(Debug)]
pub struct Cluster {
    /// The three primaries.
    pub nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts three primaries and joins them into a cluster (`--cluster-require-full-coverage
    /// no`: the primaries that are up keep serving their slots while one is down); returns once
    /// every node reports `cluster_state:ok`.
    ///
    /// # Panics
    /// When a server does not start or the cluster does not form.
    pub fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let nodes: Vec<Node> = (0..3)
            .map(|_| {
                start_server(
                    dir.path(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &dir.path().join("nodes-{port}.conf").display().to_string(),
                        // Keep serving the slots that are up when a primary is down.
                        "--cluster-require-full-coverage",
                        "no",
                    ],
                )
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create.args(["--cluster-replicas", "0", "--cluster-yes"]).output().expect("run redis-cli");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = Cluster { nodes, _dir: dir };
        cluster.wait_until_ok();
        cluster
    }

    fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = self.nodes.iter().all(|n| {
                let info: String = ::redis::cmd("CLUSTER").arg("INFO").query(&mut n.connection()).unwrap_or_default();
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not reach cluster_state:ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The port of the primary that owns `key`'s slot.
    ///
    /// # Panics
    /// When no node answers or the slot is not served.
    pub fn owner_of(&self, key: &str) -> u16 {
        let mut con = self.nodes.iter().find(|n| n.is_alive()).expect("a live node").connection();
        let slot: i64 = ::redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut con).expect("keyslot");
        let slots: Vec<Vec<::redis::Value>> =
            ::redis::cmd("CLUSTER").arg("SLOTS").query(&mut con).expect("cluster slots");
        for range in slots {
            let int = |v: &::redis::Value| match v {
                ::redis::Value::Int(i) => *i,
                other => panic!("unexpected CLUSTER SLOTS item {other:?}"),
            };
            let (lo, hi) = (int(&range[0]), int(&range[1]));
            if (lo..=hi).contains(&slot) {
                let ::redis::Value::Array(primary) = &range[2] else { panic!("unexpected CLUSTER SLOTS entry") };
                return u16::try_from(int(&primary[1])).expect("port");
            }
        }
        panic!("slot {slot} is not served")
    }
}

/// One call of one of the store's scripts, exactly as the store sends it
/// ([`RedisStore::claim_call`](crate::RedisStore::claim_call),
/// [`RedisStore::complete_call`](crate::RedisStore::complete_call)): for running the store's
/// own scripts outside it, as the benchmark's floor does with `redis-benchmark`.
#[derive(Debug, Clone)]
pub struct ScriptCall {
    /// The script's Lua source, for `SCRIPT LOAD`.
    pub source: &'static str,
    /// The script's SHA1 digest (hex), which `EVALSHA` names.
    pub sha1: String,
    /// The record's key (`KEYS[1]`).
    pub key: String,
    /// The script's arguments (`ARGV`).
    pub args: Vec<Vec<u8>>,
}

impl ScriptCall {
    pub(crate) fn new(lua: &crate::scripts::Lua, key: String, args: &[&[u8]]) -> Self {
        Self {
            source: lua.code,
            sha1: lua.script.get_hash().to_owned(),
            key,
            args: args.iter().map(|a| a.to_vec()).collect(),
        }
    }

    /// The call as `EVALSHA` arguments: `EVALSHA <sha1> 1 <key> <args>...`.
    pub fn evalsha(&self) -> Vec<Vec<u8>> {
        let head = [b"EVALSHA".to_vec(), self.sha1.clone().into_bytes(), b"1".to_vec(), self.key.clone().into_bytes()];
        head.into_iter().chain(self.args.iter().cloned()).collect()
    }
}
