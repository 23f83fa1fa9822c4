//! Issue 30: traces over OTLP, received by a real OTLP receiver: a stand-in collector in the test
//! for each protocol (an HTTP server taking `POST /v1/traces` and decoding the protobuf body with
//! opentelemetry-proto, as a collector's OTLP/HTTP receiver does; and opentelemetry-proto's
//! generated gRPC `TraceService` served by tonic). Also (docs/protocol.md#operating-it, export off the request path): a
//! collector that is down (a closed port) or hung (a listener that accepts, reads, and never
//! answers) changes no answer, responses come back while an export hangs, and the log says that
//! exports fail once within the minute.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use reqwest::StatusCode;

use crate::support::{Launch, Logged, TOKEN, create, send, worker_body};

type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// The stand-in collector: its base URL and what it received.
async fn collector() -> (String, Received) {
    async fn traces(State(got): State<Received>, body: Bytes) -> ([(&'static str, &'static str); 1], Vec<u8>) {
        let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
        got.lock().expect("received").push(request);
        ([("content-type", "application/x-protobuf")], ExportTraceServiceResponse::default().encode_to_vec())
    }
    let got: Received = Arc::default();
    let app = axum::Router::new().route("/v1/traces", post(traces)).with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got)
}

/// The stand-in OTLP/gRPC collector (the generated `TraceService` server, on tonic): its URL
/// and what it received.
async fn grpc_collector() -> (String, Received) {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};

    struct Collector(Received);

    #[tonic::async_trait]
    impl TraceService for Collector {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            self.0.lock().expect("received").push(request.into_inner());
            Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
        }
    }

    let got: Received = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let service = TraceServiceServer::new(Collector(got.clone()));
    tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
    (url, got)
}

fn serve_traced(db: &str, otlp: &str, protocol: &str) -> Logged {
    Launch::serve(db, &["--pool-nodes", "64", "--otlp-endpoint", otlp, "--otlp-protocol", protocol])
        // tower_http's request lines (debug) are log lines inside a request.
        .env("RUST_LOG", "info,tower_http=debug")
        .env("OTEL_BSP_SCHEDULE_DELAY", "200")
        .start()
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        AnyValue::IntValue(i) => Some(i.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Every span received so far, with its resource's service name.
fn spans(got: &Received) -> Vec<(Option<String>, Span)> {
    let mut all = vec![];
    for request in got.lock().expect("received").iter() {
        for rs in &request.resource_spans {
            let service = rs.resource.as_ref().and_then(|r| text(&r.attributes, "service.name"));
            for ss in &rs.scope_spans {
                all.extend(ss.spans.iter().map(|s| (service.clone(), s.clone())));
            }
        }
    }
    all
}

#[tokio::test]
async fn over_http_a_request_is_one_trace_with_its_outcome_store_and_hypervisor_spans_and_a_hashed_key() {
    let (otlp, got) = collector().await;
    one_trace_per_request(&otlp, "http/protobuf", got).await;
}

#[tokio::test]
async fn over_grpc_a_request_is_one_trace_with_its_outcome_store_and_hypervisor_spans_and_a_hashed_key() {
    let (otlp, got) = grpc_collector().await;
    one_trace_per_request(&otlp, "grpc", got).await;
}

async fn one_trace_per_request(otlp: &str, protocol: &str, got: Received) {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_traced(&crate::support::sqlite_url(&dir), otlp, protocol);
    let key = "trace-me-7c3f5d1e-91a4";
    assert_eq!(create(&lb.url, TOKEN, key, &worker_body()).await.status, StatusCode::CREATED);

    let deadline = Instant::now() + Duration::from_secs(60);
    let (root, all) = loop {
        let all = spans(&got);
        let root = all.iter().find(|(_, s)| text(&s.attributes, "http.route").as_deref() == Some("/v1/workers"));
        if let Some((_, root)) = root {
            let root = root.clone();
            // The children end before their parent, so they were queued first.
            break (root, all);
        }
        assert!(Instant::now() < deadline, "no request span arrived within a minute: {all:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(all.iter().all(|(service, _)| service.as_deref() == Some("leasebroker")));
    assert_eq!(text(&root.attributes, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(text(&root.attributes, "http.response.status_code").as_deref(), Some("201"));
    assert_eq!(text(&root.attributes, "idempotency.outcome").as_deref(), Some("executed"));
    let hash = text(&root.attributes, "idempotency.key_hash").expect("the key's hash");
    assert_eq!(hash, leasebroker::telemetry::key_hash(key.as_bytes()));
    let raw = format!("{:?}", got.lock().expect("received"));
    assert!(!raw.contains(key), "the key itself is never exported");

    let children: Vec<&Span> =
        all.iter().map(|(_, s)| s).filter(|s| s.trace_id == root.trace_id && s.span_id != root.span_id).collect();
    let names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"claim") && names.contains(&"complete"), "store spans: {names:?}");
    assert!(names.iter().any(|n| n.starts_with("POST hypervisor")), "hypervisor spans: {names:?}");
    assert!(children.iter().all(|s| s.parent_span_id == root.span_id), "children of the request span");

    // The log lines of the request carry its trace id.
    let trace_id = hex::encode(&root.trace_id);
    let log = lb.log();
    assert!(log.lines().any(|l| l.contains(&format!("trace_id={trace_id}"))), "no log line with {trace_id}:\n{log}");
}

#[tokio::test]
async fn with_the_collector_down_every_request_is_answered_and_the_log_says_so_once() {
    // A port nothing listens on.
    let otlp = testkit::closed_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_traced(&crate::support::sqlite_url(&dir), &otlp, "http/protobuf");
    for i in 0..20 {
        let r = create(&lb.url, TOKEN, &format!("down-{i}"), &worker_body()).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = lb.log();
        let lines = log.lines().filter(|l| l.contains("trace exports fail")).count();
        if lines >= 1 {
            // Several batches failed by now (20 requests, a 200 ms schedule); one line.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let log = lb.log();
            assert_eq!(log.lines().filter(|l| l.contains("trace exports fail")).count(), 1, "{log}");
            break;
        }
        assert!(Instant::now() < deadline, "the log never said that exports fail:\n{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 20..25 {
        assert_eq!(create(&lb.url, TOKEN, &format!("down-{i}"), &worker_body()).await.status, StatusCode::CREATED);
    }
}

/// What a hung collector saw: connections accepted, and exports the exporter gave up on (over
/// HTTP/1 it closes the connection; over HTTP/2 it resets the stream, or closes the connection).
#[derive(Default)]
struct Hung {
    accepted: std::sync::atomic::AtomicUsize,
    abandoned: std::sync::atomic::AtomicUsize,
}

/// The HTTP/2 client preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Counts the RST_STREAM frames (type 3) among the complete HTTP/2 frames in `buf` after the
/// preface, consuming them.
fn h2_resets(buf: &mut Vec<u8>) -> usize {
    let mut resets = 0;
    loop {
        if buf.len() < 9 {
            return resets;
        }
        let len = (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
        if buf.len() < 9 + len {
            return resets;
        }
        resets += usize::from(buf[3] == 3);
        buf.drain(..9 + len);
    }
}

/// A collector that is up but hung: it accepts connections, reads what is sent, and never
/// answers. Returns its URL and what it saw.
async fn hung_collector() -> (String, Arc<Hung>) {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = Arc::new(Hung::default());
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            count.accepted.fetch_add(1, Ordering::SeqCst);
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut pending: Vec<u8> = Vec::new();
                let mut h2 = None;
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    pending.extend_from_slice(&buf[..n]);
                    if h2.is_none() && pending.len() >= H2_PREFACE.len() {
                        h2 = Some(pending.starts_with(H2_PREFACE));
                        if h2 == Some(true) {
                            pending.drain(..H2_PREFACE.len());
                        }
                    }
                    match h2 {
                        Some(true) => {
                            count.abandoned.fetch_add(h2_resets(&mut pending), Ordering::SeqCst);
                        }
                        Some(false) => pending.clear(),
                        None => {}
                    }
                }
                count.abandoned.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (url, seen)
}

#[tokio::test]
async fn over_http_with_the_collector_hung_every_request_is_answered_while_exports_wait_and_the_log_says_so_once() {
    with_the_collector_hung("http/protobuf").await;
}

#[tokio::test]
async fn over_grpc_with_the_collector_hung_every_request_is_answered_while_exports_wait_and_the_log_says_so_once() {
    with_the_collector_hung("grpc").await;
}

/// docs/protocol.md#operating-it: export is off the request path. With a collector that takes the connection and never
/// answers, requests are answered while an export is stuck on it (the collector holds an open,
/// unanswered connection all along), and when exports time out the log says so once.
async fn with_the_collector_hung(protocol: &str) {
    use std::sync::atomic::Ordering;
    let (otlp, seen) = hung_collector().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_traced(&crate::support::sqlite_url(&dir), &otlp, protocol);
    assert_eq!(create(&lb.url, TOKEN, "hung-0", &worker_body()).await.status, StatusCode::CREATED);
    // The first export reaches the collector and hangs there.
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.accepted.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no export reached the collector");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // While it hangs, requests are answered as usual: creates and their replays. Were the export
    // on the request path, no response would come back before an export was given up.
    let mut answered_while_hung = 0;
    for i in 1..=20 {
        let key = format!("hung-{i}");
        assert_eq!(create(&lb.url, TOKEN, &key, &worker_body()).await.status, StatusCode::CREATED, "{key}");
        let replay = create(&lb.url, TOKEN, &key, &worker_body()).await;
        assert!(replay.status == StatusCode::CREATED && replay.replayed(), "{key}");
        answered_while_hung += usize::from(seen.abandoned.load(Ordering::SeqCst) == 0);
    }
    assert!(answered_while_hung > 0, "every response waited for an export to be given up");
    // The stuck export times out (10 s) and the log says so; the exports after it time out as
    // well, and the log says nothing more within the minute.
    lb.wait_for_line(&["trace exports fail"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.abandoned.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < deadline,
            "no second export was given up: accepted {}, abandoned {}",
            seen.accepted.load(Ordering::SeqCst),
            seen.abandoned.load(Ordering::SeqCst)
        );
        // Reads make spans too: exports keep coming.
        let listed = send(reqwest::Method::GET, &format!("{}/v1/workers", lb.url), TOKEN, None, None).await;
        assert_eq!(listed.status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = lb.log();
    assert_eq!(log.lines().filter(|l| l.contains("trace exports fail")).count(), 1, "{log}");
}
