//! Every vector passes against the real leasebroker binary (SQLite, the in-process simulator).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::kit;

const TOKENS: [&str; 3] = ["tok-alice-idemcheck-0001", "tok-bob-idemcheck-00002", "tok-admin-idemcheck-0003"];

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The leasebroker binary the workspace build put beside idemcheck's.
fn leasebroker_bin() -> Option<std::path::PathBuf> {
    let bin = std::path::Path::new(kit::BIN).with_file_name("leasebroker");
    bin.exists().then_some(bin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_vector_passes_against_leasebroker() {
    let Some(bin) = leasebroker_bin() else {
        eprintln!("SKIPPED: no leasebroker binary beside idemcheck; build the workspace (cargo build --workspace)");
        assert!(std::env::var("CI").is_err(), "CI=true: the leasebroker binary must be built");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}", dir.path().join("lb.db").display());
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--database", &db, "--pool-nodes", "256", "--rate-limit", "0"])
        // A create takes a while, so duplicates arrive while it runs (in flight, Prefer: wait).
        .args(["--sim-latency-ms", "300"])
        // The profile's 5xx: a create of an image the hypervisor does not have.
        .args(["--sim-missing-image", "idemcheck-missing:1"])
        // The other key sources the profile promises.
        .args(["--key-sources", "repeatability,request-id"])
        .args(["--token", &format!("{}=alice", TOKENS[0]), "--token", &format!("{}=bob", TOKENS[1])])
        .args(["--admin-token", TOKENS[2]])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start leasebroker");
    let stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = line.find("listening on http://") {
                let _ = tx.send(line[i + "listening on ".len()..].trim().to_owned());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("leasebroker did not report its address");

    let run = kit::run(&url, "leasebroker", &TOKENS).await;
    println!("{}", run.stdout);
    assert!(run.failed().is_empty(), "failed: {:?}\n{}", run.failed(), run.stdout);
    let na: Vec<_> = run.results().into_iter().filter(|(_, r)| r != "pass").collect();
    assert!(na.is_empty(), "not passed: {na:?}");
    assert_eq!(run.results().len(), kit::vector_ids().len());
    assert_eq!(run.code, Some(0));
    assert_eq!(run.report["profile"], "leasebroker");
    drop(server);
}
