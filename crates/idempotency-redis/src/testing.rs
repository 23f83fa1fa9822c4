//! Real Redis servers for tests (feature `testing`): one `redis-server` on a free port, or a
//! Cluster of three primaries joined with `redis-cli --cluster create` (optionally with
//! replicas, and a failover as an operator would do it: [`Cluster::fail_over`]), each in a
//! temporary directory and killed when dropped. The binaries come from the machine (`redis-server` and
//! `redis-cli` on the `PATH`); [`have_redis_binaries`] says whether they run.
//!
//! ```no_run
//! let cluster = idempotency_redis::testing::Cluster::start();
//! println!("records go to {}", cluster.url()); // redis+cluster://127.0.0.1:P1,...
//! ```

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

/// True when `redis-server` and `redis-cli` run.
pub fn have_redis_binaries() -> bool {
    ["redis-server", "redis-cli"].iter().all(|b| {
        Command::new(b).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

/// The primary's port in an `INFO replication` text of a replica; `None` for a primary.
fn primary_of(info: &str) -> Option<u16> {
    if !info.contains("role:slave") {
        return None;
    }
    info.lines().find_map(|l| l.trim().strip_prefix("master_port:")).and_then(|p| p.trim().parse().ok())
}

/// A port that is free now, whose cluster bus port (+10000) is free too, both outside the
/// kernel's ephemeral range (see [`idempotency::conformance::free_ports`]).
fn free_port() -> u16 {
    idempotency::conformance::free_port_with(10_000)
}

/// One `redis-server` process, killed when dropped. It can be killed and restarted on the same
/// port with the same arguments, and paused (`SIGSTOP`) and resumed.
#[derive(Debug)]
pub struct Node {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    child: std::sync::Mutex<Option<Child>>,
    args: Vec<String>,
    /// While it is killed, its ports (client and cluster bus) are held here, so that no other
    /// test's listener takes them before it restarts.
    held: std::sync::Mutex<Vec<idempotency::conformance::HeldPort>>,
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
            let held = [self.port, self.port + 10_000].into_iter().filter_map(idempotency::conformance::HeldPort::hold);
            *self.held.lock().unwrap_or_else(|e| e.into_inner()) = held.collect();
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

    /// Starts it again after [`Node::kill`], on the same port with the same arguments (a
    /// cluster node keeps its node id from its cluster config file), and waits until it answers.
    ///
    /// # Panics
    /// When it is alive, or does not answer within 10 s.
    pub fn restart(&self) {
        assert!(!self.is_alive(), "restart of a node that runs");
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clear();
        let child = spawn(&self.args);
        *self.child.lock().expect("node lock") = Some(child);
        assert!(self.wait_until_answering(), "redis-server did not restart on port {}", self.port);
    }

    /// Pauses the process (`SIGSTOP`): it keeps its connections but answers nothing, as a
    /// hung or partitioned node would.
    ///
    /// # Panics
    /// When the signal cannot be sent.
    pub fn pause(&self) {
        assert!(self.signal(Signal::STOP), "SIGSTOP to redis-server on port {} failed", self.port);
    }

    /// Resumes it after [`Node::pause`] (`SIGCONT`); nothing when it does not run.
    pub fn resume(&self) {
        self.signal(Signal::CONT);
    }

    /// Sends `which` to the node's process; true when sent (or when there is no process).
    fn signal(&self, which: Signal) -> bool {
        let pid = self.child.lock().ok().and_then(|c| c.as_ref().map(Child::id));
        pid.is_none_or(|pid| {
            i32::try_from(pid).ok().and_then(Pid::from_raw).is_some_and(|pid| kill_process(pid, which).is_ok())
        })
    }

    /// On a replica: stops applying its primary's stream, and so acknowledging writes, for
    /// `span` (`CLIENT PAUSE <ms> WRITE`), while it answers every command that does not write at
    /// once: a replica that lags, where [`Node::pause`] is one that answers nothing.
    /// [`Node::unpause_writes`] ends it early.
    ///
    /// # Panics
    /// When the node refuses it.
    pub fn pause_writes(&self, span: Duration) {
        let ms = u64::try_from(span.as_millis()).unwrap_or(u64::MAX);
        ::redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("WRITE").exec(&mut self.connection()).expect("client pause");
    }

    /// Ends [`Node::pause_writes`].
    ///
    /// # Panics
    /// When the node refuses it.
    pub fn unpause_writes(&self) {
        ::redis::cmd("CLIENT").arg("UNPAUSE").exec(&mut self.connection()).expect("client unpause");
    }

    /// `INFO replication` of the node, or an empty string when it does not answer.
    pub fn replication_info(&self) -> String {
        let con =
            ::redis::Client::open(self.url()).and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)));
        con.and_then(|mut c| ::redis::cmd("INFO").arg("replication").query::<String>(&mut c)).unwrap_or_default()
    }

    fn wait_until_answering(&self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let exited =
                self.child.lock().is_ok_and(|mut c| c.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_)))));
            if exited {
                return false;
            }
            let ok = ::redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut c| ::redis::cmd("PING").query::<String>(&mut c));
            if ok.is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

fn spawn(args: &[String]) -> Child {
    Command::new("redis-server")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server")
}

/// Starts `redis-server` on a free port in `dir` with `extra` arguments (`{port}` in them is
/// replaced by the port) and waits until it answers.
///
/// # Panics
/// When no server starts after five tries.
pub fn start_server(dir: &Path, extra: &[&str]) -> Node {
    for _ in 0..5 {
        let port = free_port();
        let mut args: Vec<String> =
            ["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                .iter()
                .map(|a| a.to_string())
                .collect();
        args.extend(["--daemonize".into(), "no".into(), "--dir".into(), dir.display().to_string()]);
        args.extend(["--logfile".into(), dir.join(format!("redis-{port}.log")).display().to_string()]);
        args.extend(extra.iter().map(|a| a.replace("{port}", &port.to_string())));
        let child = spawn(&args);
        let node = Node { port, child: std::sync::Mutex::new(Some(child)), args, held: Default::default() };
        if node.wait_until_answering() {
            return node;
        }
        node.kill(); // the port was taken meanwhile: try another
    }
    panic!("redis-server did not start in {}", dir.display());
}

/// Three primaries on free ports in a temp dir, joined into a cluster, each with as many
/// replicas as asked for; killed and removed when dropped (nodes first, then the dir).
#[derive(Debug)]
pub struct Cluster {
    /// The three primaries (after [`Cluster::fail_over`], the promoted replica takes its
    /// primary's place here).
    pub nodes: Vec<Node>,
    /// The replicas, in the order of their primaries in `nodes` (`replicas[i]` replicates
    /// `nodes[i]` when there is one replica each).
    pub replicas: Vec<Node>,
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
        Self::start_with_replicas(0)
    }

    /// [`Cluster::start`] with `replicas` replicas per primary (`redis-cli --cluster create
    /// --cluster-replicas N`); with replicas, `cluster-node-timeout` is 2 s rather than 15 s,
    /// so a killed primary is noticed within seconds. Returns once every node reports
    /// `cluster_state:ok` and every replica's link to its primary is up.
    ///
    /// # Panics
    /// When a server does not start or the cluster does not form.
    pub fn start_with_replicas(replicas: usize) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("nodes-{port}.conf").display().to_string();
        let mut extra = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &config,
            // Keep serving the slots that are up when a primary is down.
            "--cluster-require-full-coverage",
            "no",
        ];
        if replicas > 0 {
            extra.extend(["--cluster-node-timeout", "2000"]);
        }
        let all: Vec<Node> = (0..3 * (1 + replicas)).map(|_| start_server(dir.path(), &extra)).collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &all {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut cluster = Cluster { nodes: all, replicas: vec![], _dir: dir };
        cluster.wait_until_ok();
        cluster.sort_roles();
        cluster
    }

    /// Splits the nodes into primaries and replicas by their role, each replica after the
    /// primary it follows.
    fn sort_roles(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let roles: Vec<Option<u16>> = self.nodes.iter().map(|n| primary_of(&n.replication_info())).collect();
            let linked = self
                .nodes
                .iter()
                .zip(&roles)
                .all(|(n, r)| r.is_none() || n.replication_info().contains("master_link_status:up"));
            if linked {
                let mut replicas = vec![];
                for (node, of) in std::mem::take(&mut self.nodes).into_iter().zip(roles) {
                    match of {
                        None => self.nodes.push(node),
                        Some(port) => replicas.push((node, port)),
                    }
                }
                replicas.sort_by_key(|(_, of)| self.nodes.iter().position(|p| p.port == *of));
                self.replicas = replicas.into_iter().map(|(n, _)| n).collect();
                return;
            }
            assert!(Instant::now() < deadline, "the replicas did not link to their primaries");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_until_ok(&self) {
        let total = self.nodes.len() + self.replicas.len();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = self.nodes.iter().chain(&self.replicas).filter(|n| n.is_alive()).all(|n| {
                let info: String = ::redis::cmd("CLUSTER").arg("INFO").query(&mut n.connection()).unwrap_or_default();
                info.contains("cluster_state:ok") && info.contains(&format!("cluster_known_nodes:{total}"))
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not reach cluster_state:ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What an operator does when primary `i` dies: kills it (SIGKILL, if it still runs),
    /// promotes its replica (`CLUSTER FAILOVER TAKEOVER`, unless the cluster has promoted it
    /// already), waits until the cluster serves the slots again, restarts the killed node (it
    /// rejoins as a replica of the promoted one and copies its data) and waits until it is
    /// linked. The promoted replica then takes `nodes[i]`, the restarted node `replicas[i]`.
    ///
    /// # Panics
    /// Without a replica for `i`, or when the cluster does not recover within 30 s.
    pub fn fail_over(&mut self, i: usize) {
        assert!(i < self.replicas.len(), "primary {i} has no replica to fail over to");
        self.nodes[i].kill();
        self.replicas[i].resume();
        self.promote_replica(i);
        std::mem::swap(&mut self.nodes[i], &mut self.replicas[i]);
        self.wait_until_ok();
        self.replicas[i].restart();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.replicas[i].replication_info().contains("master_link_status:up") {
            assert!(Instant::now() < deadline, "the restarted node did not become a replica");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_until_ok();
    }

    fn promote_replica(&self, i: usize) {
        let replica = &self.replicas[i];
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if replica.replication_info().contains("role:master") {
                return;
            }
            // The cluster may be promoting it already; TAKEOVER needs no vote from the others.
            let _: Result<String, _> =
                ::redis::cmd("CLUSTER").arg("FAILOVER").arg("TAKEOVER").query(&mut replica.connection());
            assert!(Instant::now() < deadline, "the replica of primary {i} was not promoted");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Puts a [`CutProxy`] in front of primary `i`: the node announces the proxy's port to the
    /// cluster (`cluster-announce-port`; its bus port stays its own), so a client that learns the
    /// topology from the cluster reaches it through the proxy, and [`Cluster::owner_of`] names
    /// the proxy's port for its slots. Returns once every node's `CLUSTER SLOTS` says so.
    ///
    /// # Panics
    /// When the node refuses the setting, or the cluster does not learn it within 30 s.
    pub fn proxy_primary(&self, i: usize) -> CutProxy {
        let node = &self.nodes[i];
        let proxy = CutProxy::start(node.port);
        let mut con = node.connection();
        for (name, port) in [("cluster-announce-bus-port", node.port + 10_000), ("cluster-announce-port", proxy.port)] {
            ::redis::cmd("CONFIG").arg("SET").arg(name).arg(port).exec(&mut con).expect("config set");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let announced = format!("{}", proxy.port);
        while !self.nodes.iter().chain(&self.replicas).filter(|n| n.is_alive()).all(|n| {
            let slots: ::redis::Value =
                ::redis::cmd("CLUSTER").arg("SLOTS").query(&mut n.connection()).unwrap_or(::redis::Value::Nil);
            format!("{slots:?}").contains(&format!("int({announced})"))
        }) {
            assert!(Instant::now() < deadline, "the cluster did not learn the proxy's port for primary {i}");
            std::thread::sleep(Duration::from_millis(50));
        }
        proxy
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3` (the primaries).
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

/// Where [`CutProxy`] cuts the next connection that sends a script (`EVALSHA` or `EVAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Passes the server's next reply on, then closes the connection: the client has the
    /// script's answer, and whatever it sends after it goes over a new connection.
    AfterScriptReply,
    /// Closes the connection instead of passing the server's next reply on: the script ran, and
    /// its answer is lost.
    InsteadOfScriptReply,
}

/// A TCP proxy on loopback in front of one Redis node: it passes everything through, and once
/// armed ([`CutProxy::arm`]) cuts the next connection that sends a script, right after or
/// instead of the server's reply ([`Cut`]). For the faults between a transition's script and
/// the `WAIT` after it. Stops accepting when dropped.
#[derive(Debug)]
pub struct CutProxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    armed: Arc<Mutex<Option<Cut>>>,
    cuts: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl CutProxy {
    /// Listens on a free port and forwards each connection to `127.0.0.1:upstream`.
    ///
    /// # Panics
    /// When it cannot listen.
    pub fn start(upstream: u16) -> CutProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let proxy = CutProxy { port, armed: Arc::default(), cuts: Arc::default(), stop: Arc::default() };
        let (armed, cuts, stop) = (proxy.armed.clone(), proxy.cuts.clone(), proxy.stop.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let (Ok(client), Ok(server)) = (client, TcpStream::connect(("127.0.0.1", upstream))) else { continue };
                let (armed, cuts) = (armed.clone(), cuts.clone());
                std::thread::spawn(move || relay(client, server, &armed, &cuts));
            }
        });
        proxy
    }

    /// Cuts the next connection that sends a script, as `cut` says; once.
    pub fn arm(&self, cut: Cut) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(cut);
    }

    /// How many connections it has cut.
    pub fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::Relaxed)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Relays one connection both ways until either side closes it, cutting it as `armed` says.
fn relay(client: TcpStream, server: TcpStream, armed: &Mutex<Option<Cut>>, cuts: &AtomicU64) {
    let script_sent = Arc::new(AtomicBool::new(false));
    let (Ok(mut from_client), Ok(mut to_server)) = (client.try_clone(), server.try_clone()) else { return };
    let sent = script_sent.clone();
    let upstream = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from_client.read(&mut buf) {
            let chunk = &buf[..n];
            let names = [&b"\r\nEVALSHA\r\n"[..], &b"\r\nEVAL\r\n"[..]];
            if names.iter().any(|name| chunk.windows(name.len()).any(|w| w == *name)) {
                // Before it reaches the server, so its reply finds the mark.
                sent.store(true, Ordering::SeqCst);
            }
            if to_server.write_all(chunk).is_err() {
                break;
            }
        }
        let _ = to_server.shutdown(Shutdown::Both);
        let _ = from_client.shutdown(Shutdown::Both);
    });
    let (mut from_server, mut to_client) = (server, client);
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n @ 1..) = from_server.read(&mut buf) {
        let cut = if script_sent.swap(false, Ordering::SeqCst) {
            armed.lock().unwrap_or_else(|e| e.into_inner()).take()
        } else {
            None
        };
        if cut == Some(Cut::InsteadOfScriptReply) || to_client.write_all(&buf[..n]).is_err() {
            cuts.fetch_add(u64::from(cut.is_some()), Ordering::Relaxed);
            break;
        }
        if cut == Some(Cut::AfterScriptReply) {
            cuts.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    let _ = to_client.shutdown(Shutdown::Both);
    let _ = from_server.shutdown(Shutdown::Both);
    let _ = upstream.join();
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
