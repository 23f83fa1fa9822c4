//! Issue 45, items 10 and 11: one tenant cannot stall everyone, and the record limit counts what a
//! tenant stores. Black-box tests of the real `leasebroker` binary:
//! - a principal's slow uploads and its `Prefer: wait` retries get `429` beyond
//!   `--max-concurrent-per-principal` (default 64), and another principal's request and
//!   `/healthz` are answered while they are all still held;
//! - one source's idle connections take at most `--max-connections-per-source` (default 256)
//!   of the slots, and another source is served;
//! - refusals that stored nothing (`503 capacity-exhausted`) do not count against
//!   `--max-records-per-principal`, and at the limit a tenant still deletes its own workers.
//!
//! The floods come from addresses of their own on loopback (127.0.1.x, 127.0.0.2: any 127/8
//! address is local on Linux), each under the per-source cap, so what each test shows is the
//! bound it is about. `LEASEBROKER_BIN` runs them against another build.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;

use crate::bounds::{Reply, http, send, serve};
use crate::support::{Proc, sqlite_url};
use testkit::tokens::{ADMIN, ALICE, BOB};

/// The default `--max-concurrent-per-principal`.
const PER_PRINCIPAL: usize = 64;
/// How many requests each flood sends: well past a principal's share, and past the 512
/// requests the process handles at once.
const FLOOD: usize = 600;

fn json(r: &Reply) -> Value {
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

fn addr_of(lb: &Proc) -> SocketAddr {
    lb.url.trim_start_matches("http://").parse().expect("the server's address")
}

/// The address the `i`th request of a flood comes from: three sources, so that none of them is
/// over the per-source cap.
fn flood_source(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 1, 1 + u8::try_from(i % 3).expect("small"))
}

/// A TCP connection to `addr` from `source`.
async fn connect_from(source: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(IpAddr::V4(source), 0)).expect("bind a loopback source");
    socket.connect(addr).await.expect("connect")
}

/// The status of the answer read from `read` (0 if the connection closed without one).
async fn status_of(mut read: impl tokio::io::AsyncRead + Unpin) -> u16 {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(2).any(|w| w == b"\r\n") {
        match read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// The answers of a flood as they arrive: how many were `429`, and every other status.
struct Answers {
    rx: mpsc::UnboundedReceiver<u16>,
    refused: usize,
    others: Vec<u16>,
}

impl Answers {
    fn new(rx: mpsc::UnboundedReceiver<u16>) -> Self {
        Self { rx, refused: 0, others: Vec::new() }
    }

    fn take(&mut self, status: u16) {
        if status == 429 { self.refused += 1 } else { self.others.push(status) }
    }

    /// Waits (up to `within`) until `n` requests of the flood were refused with `429`; fails as
    /// soon as one gets any other answer, since every admitted request is held until the end.
    async fn until_refused(&mut self, n: usize, within: Duration, what: &str) {
        let deadline = tokio::time::Instant::now() + within;
        while self.refused < n {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(status)) => self.take(status),
                Ok(None) => break,
                Err(_) => panic!("{what}: {} of {n} refused with 429 within {within:?}", self.refused),
            }
            assert!(self.others.is_empty(), "{what}: a held request was answered {:?}", self.others);
        }
    }

    /// Every answer that has arrived by now.
    fn drain(&mut self) {
        while let Ok(status) = self.rx.try_recv() {
            self.take(status);
        }
    }
}

/// Bob's listing, `/healthz`, `/readyz` and `/metrics` are answered, with 200.
async fn bob_and_healthz_are_answered(lb: &Proc) {
    let client = http();
    let list = send(&client, Method::GET, &format!("{}/v1/workers", lb.url), Some(BOB), None, None).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text());
    for route in ["/healthz", "/readyz", "/metrics"] {
        let answer = client.get(format!("{}{route}", lb.url)).send().await.expect(route);
        assert_eq!(answer.status(), StatusCode::OK, "{route}");
    }
}

// Item 10: a principal's share of the process.

/// Alice opens 600 uploads that send their headers and 8 bytes of body and then stall. Beyond
/// her 64 places they are refused at once (before their bodies are read); the 64 she holds stay
/// open, and meanwhile Bob's request and `/healthz` are answered. Before the fix the first 512
/// held every turn of the process and Bob waited for them to time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_stalled_uploads_get_429_beyond_its_share_and_never_hold_up_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The held uploads last until the body and idle timeouts, far beyond what the test needs.
    let lb = serve(&sqlite_url(&dir), &["--rate-limit", "0", "--body-timeout", "300s", "--idle-timeout", "300s"]);
    let addr = addr_of(&lb);
    let (tx, rx) = mpsc::unbounded_channel();
    let mut held = Vec::new();
    for i in 0..FLOOD {
        let (read, mut write) = connect_from(flood_source(i), addr).await.into_split();
        let head = format!(
            "POST /v1/workers HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ALICE}\r\nIdempotency-Key: up-{i}\r\n\
             Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"image\""
        );
        write.write_all(head.as_bytes()).await.expect("write the headers and 8 bytes");
        held.push(write);
        let tx = tx.clone();
        tokio::spawn(async move { tx.send(status_of(read).await) });
    }
    let mut answers = Answers::new(rx);
    answers.until_refused(FLOOD - PER_PRINCIPAL, Duration::from_secs(120), "alice's stalled uploads").await;
    bob_and_healthz_are_answered(&lb).await;
    answers.drain();
    assert_eq!(answers.refused, FLOOD - PER_PRINCIPAL, "exactly alice's share is admitted");
    assert!(answers.others.is_empty(), "alice's held uploads were answered before bob: {:?}", answers.others);
    drop(held);
}

/// Alice's create is slow (the hypervisor takes ten minutes), and she sends 600 retries of its key
/// with `Prefer: wait=120`. Beyond her share they are refused at once; the 63 that wait (her
/// create holds the 64th place) keep waiting while Bob's request and `/healthz` are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_waiting_retries_get_429_beyond_its_share_and_never_hold_up_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The hypervisor's call, and the connection it waits on, outlast the test.
    let slow = ["--sim-latency-ms", "600000", "--hypervisor-timeout", "899s", "--hypervisor-settle", "900s"];
    let slow = [&slow[..], &["--idle-timeout", "900s"]].concat();
    let lb = serve(&sqlite_url(&dir), &[&slow[..], &["--rate-limit", "0", "--max-wait", "300s"]].concat());
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    let create = {
        let (url, body) = (format!("{}/v1/workers", lb.url), body.clone());
        let client = reqwest::Client::builder().timeout(Duration::from_secs(900)).build().expect("client");
        tokio::spawn(async move { send(&client, Method::POST, &url, Some(ALICE), Some("slow"), Some(&body)).await })
    };
    // In flight once its node is allocated (before the hypervisor's call).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let fleet = send(&http(), Method::GET, &format!("{}/admin/v1/fleet", lb.url), Some(ADMIN), None, None).await;
        if json(&fleet)["nodes_allocated"] == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the create never allocated its node: {}", fleet.text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let clients: Vec<reqwest::Client> = (0..3)
        .map(|i| {
            let source = IpAddr::V4(flood_source(i));
            let builder = reqwest::Client::builder().local_address(source).timeout(Duration::from_secs(900));
            builder.build().expect("client")
        })
        .collect();
    for i in 0..FLOOD {
        let (client, url, body, tx) =
            (clients[i % 3].clone(), format!("{}/v1/workers", lb.url), body.clone(), tx.clone());
        tokio::spawn(async move {
            let r = client
                .post(url)
                .bearer_auth(ALICE)
                .header("Idempotency-Key", "slow")
                .header("Prefer", "wait=120")
                .json(&body)
                .send()
                .await;
            let _ = tx.send(r.map_or(0, |r| r.status().as_u16()));
        });
    }
    let mut answers = Answers::new(rx);
    // Her create holds one of her places; 63 retries wait in the others.
    let refused = FLOOD - (PER_PRINCIPAL - 1);
    answers.until_refused(refused, Duration::from_secs(100), "alice's waiting retries").await;
    bob_and_healthz_are_answered(&lb).await;
    answers.drain();
    assert_eq!(answers.refused, refused, "exactly alice's share is admitted");
    assert!(answers.others.is_empty(), "alice's waiting retries were answered before bob: {:?}", answers.others);
    assert!(!create.is_finished(), "the create is still running");
    create.abort();
}

/// 1,100 connections from one source that never send a request: the first 256 are held, the
/// rest closed at accept; a connection from another source is still served. Before the fix the
/// first 1,024 took every slot until the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_one_source_leave_room_for_another() {
    const IDLE: usize = 1100;
    const PER_SOURCE: usize = 256;
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--header-timeout", "300s"]);
    let addr = addr_of(&lb);
    let mut idle = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    // Connected after all of them, so accepted after all of them.
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut other = connect_from(Ipv4Addr::new(127, 0, 0, 2), addr).await;
    other.write_all(request.as_bytes()).await.expect("write");
    assert_eq!(status_of(&mut other).await, 200, "another source's connection was not served");
    // The first source kept exactly its cap: those connections answer, the others were closed.
    let mut answered = 0;
    for mut s in idle {
        // A closed connection may refuse the write or answer it with EOF.
        if s.write_all(request.as_bytes()).await.is_ok() && status_of(&mut s).await == 200 {
            answered += 1;
        }
    }
    assert_eq!(answered, PER_SOURCE, "connections of the first source served");
}

// Item 11: the record limit counts what a tenant stores.

async fn create(lb: &Proc, key: &str) -> Reply {
    let body = json!({"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4});
    send(&http(), Method::POST, &format!("{}/v1/workers", lb.url), Some(ALICE), Some(key), Some(&body)).await
}

async fn delete(lb: &Proc, id: &str, key: &str) -> Reply {
    send(&http(), Method::DELETE, &format!("{}/v1/workers/{id}", lb.url), Some(ALICE), Some(key), None).await
}

fn worker_id(r: &Reply) -> String {
    json(r)["id"].as_str().unwrap_or_else(|| panic!("a worker: {}", r.text())).to_owned()
}

/// One node and a limit of 4 records: a create takes the node, then six creates are refused
/// `503 capacity-exhausted`. Their failed records stay (an operator can list them) but stored
/// nothing and do not count: the delete and the next create still run. Before the fix the
/// fourth refusal already answered `429`.
#[tokio::test]
async fn refusals_that_stored_nothing_do_not_count_against_the_record_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--pool-nodes", "1", "--max-records-per-principal", "4", "--rate-limit", "0"]);
    let first = create(&lb, "first").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    for i in 0..6 {
        let r = create(&lb, &format!("refused-{i}")).await;
        assert_eq!(
            (r.status, r.problem_type().as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "capacity-exhausted"),
            "refusal {i}: {}",
            r.text()
        );
    }
    let failed = send(
        &http(),
        Method::GET,
        &format!("{}/admin/v1/records?state=failed&principal=alice", lb.url),
        Some(ADMIN),
        None,
        None,
    )
    .await;
    assert_eq!(json(&failed)["records"].as_array().map(Vec::len), Some(6), "{}", failed.text());
    let del = delete(&lb, &worker_id(&first), "delete-first").await;
    assert_eq!(del.status, StatusCode::NO_CONTENT, "{}", del.text());
    let again = create(&lb, "after").await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text());
}

/// A limit of 3 records, held by two creates and a stored `404`: a new key is refused `429`, but
/// a delete of a worker alice holds still runs (and frees its node). A delete of anything else
/// (a worker already deleted, one that does not exist) is limited as any request.
#[tokio::test]
async fn at_the_record_limit_a_tenant_still_deletes_its_own_workers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &["--max-records-per-principal", "3", "--rate-limit", "0"]);
    let workers: Vec<String> = {
        let mut ids = Vec::new();
        for key in ["w1", "w2"] {
            let r = create(&lb, key).await;
            assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
            ids.push(worker_id(&r));
        }
        ids
    };
    assert_eq!(delete(&lb, "wkr-none", "none-1").await.status, StatusCode::NOT_FOUND);
    let over = create(&lb, "w3").await;
    assert_eq!((over.status, over.problem_type().as_str()), (StatusCode::TOO_MANY_REQUESTS, "too-many-requests"));
    let del = delete(&lb, &workers[0], "del-w1").await;
    assert_eq!(del.status, StatusCode::NO_CONTENT, "{}", del.text());
    for (id, key) in [(workers[0].as_str(), "del-w1-again"), ("wkr-none", "none-2")] {
        let r = delete(&lb, id, key).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{id}: {}", r.text());
    }
    assert_eq!(delete(&lb, &workers[1], "del-w2").await.status, StatusCode::NO_CONTENT);
    let fleet = send(&http(), Method::GET, &format!("{}/admin/v1/fleet", lb.url), Some(ADMIN), None, None).await;
    assert_eq!(json(&fleet)["workers_active"], Value::from(0), "{}", fleet.text());
}
