//! Issue 45 item 13, the API's edges on the real binary: what the HTTP layer refuses (too many
//! or too large headers, a path whose percent-escape is not UTF-8) is an RFC 9457 problem like
//! every other error, a valid token on the other kind of route is told so, and a cursor the
//! workers listing never gave out is refused rather than read as an empty last page.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{ADMIN, OTHER, Reply, TOKEN, create, http, send, serve, sqlite_url, worker_body};

async fn reply(r: reqwest::Response) -> Reply {
    Reply { status: r.status(), headers: r.headers().clone(), body: r.bytes().await.expect("body").to_vec() }
}

/// A problem+json answer with `status` and a `type` ending in `/name`.
fn assert_problem(r: &Reply, status: StatusCode, name: &str, what: &str) {
    let text = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, status, "{what}: {text}");
    let ct = r.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default();
    assert_eq!(ct, "application/problem+json", "{what}: {text}");
    let body = r.json();
    for field in ["type", "title", "detail"] {
        assert!(body[field].is_string(), "{what}: no {field} in {text}");
    }
    assert_eq!(body["status"], status.as_u16(), "{what}: {text}");
    assert_eq!(r.problem_type(), name, "{what}: {text}");
}

#[tokio::test]
async fn what_the_http_layer_refuses_is_a_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let url = format!("{}/v1/workers", lb.url);

    // More header fields than the server takes (100).
    let mut many = http().get(&url).bearer_auth(TOKEN);
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "x");
    }
    let r = reply(many.send().await.expect("send")).await;
    assert_problem(&r, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "headers-too-large", "150 header fields");

    // More header bytes than the server takes (64 KiB).
    let big = http().get(&url).bearer_auth(TOKEN).header("x-filler", "x".repeat(100 * 1024));
    let r = reply(big.send().await.expect("send")).await;
    assert_problem(&r, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "headers-too-large", "a 100 KiB header");

    // Under both limits: served as usual.
    let mut fine = http().get(&url).bearer_auth(TOKEN);
    for i in 0..90 {
        fine = fine.header(format!("x-filler-{i}"), "x".repeat(500));
    }
    assert_eq!(fine.send().await.expect("send").status(), StatusCode::OK, "90 fields, 45 KiB");

    // A percent-escape that does not decode to UTF-8, in a path parameter.
    for path in ["/v1/workers/%ff", "/v1/workers/%C0%AF/reboot"] {
        let method = if path.ends_with("reboot") { Method::POST } else { Method::GET };
        let r = send(method, &format!("{}{path}", lb.url), TOKEN, Some("bad-escape-1"), None).await;
        assert_problem(&r, StatusCode::BAD_REQUEST, "invalid-path", path);
    }
}

/// What cannot be changed: a request line hyper cannot parse is answered by hyper itself, before
/// any of the service's code runs, with a bare `400` and the connection closed (documented in
/// docs/security.md#limits).
#[tokio::test]
async fn a_request_line_hyper_cannot_parse_gets_its_bare_400() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let addr = lb.url.trim_start_matches("http://").to_owned();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    sock.write_all(b"GET /v1/workers HTTP/1.1 trailing\r\nHost: x\r\n\r\n").await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), sock.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{answer}");
}

#[tokio::test]
async fn a_valid_token_on_the_other_kind_of_route_is_told_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();

    // The admin token on a tenant route, and a tenant's on an admin route: 401 as before
    // (docs/protocol.md#leasebroker-api, #operating-it), but the detail says the token is valid, only not here.
    let admin_on_v1 = send(Method::GET, &format!("{base}/v1/workers"), ADMIN, None, None).await;
    assert_problem(&admin_on_v1, StatusCode::UNAUTHORIZED, "unauthorized", "the admin token on /v1");
    let detail = admin_on_v1.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("admin token") && detail.contains("/v1"), "{detail}");

    for token in [TOKEN, OTHER] {
        let tenant_on_admin = send(Method::GET, &format!("{base}/admin/v1/fleet"), token, None, None).await;
        assert_problem(&tenant_on_admin, StatusCode::UNAUTHORIZED, "unauthorized", "a tenant token on /admin");
        let detail = tenant_on_admin.json()["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.contains("tenant's token") && detail.contains("/admin"), "{detail}");
    }

    // An unknown token is still only that.
    let unknown = send(Method::GET, &format!("{base}/v1/workers"), "tok-nobody-0000000000", None, None).await;
    assert_problem(&unknown, StatusCode::UNAUTHORIZED, "unauthorized", "an unknown token");
    let detail = unknown.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(!detail.contains("admin") && !detail.contains("tenant"), "{detail}");
    assert!(unknown.headers.get("www-authenticate").is_some());
}

#[tokio::test]
async fn a_cursor_the_workers_listing_never_gave_out_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    for key in ["cursor-1", "cursor-2"] {
        assert_eq!(create(base, TOKEN, key, &worker_body()).await.status, StatusCode::CREATED);
    }
    let first = send(Method::GET, &format!("{base}/v1/workers?limit=1"), TOKEN, None, None).await.json();
    let cursor = first["next_cursor"].as_str().expect("a next page").to_owned();
    let second = send(Method::GET, &format!("{base}/v1/workers?limit=1&cursor={cursor}"), TOKEN, None, None).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.json()["workers"].as_array().map(Vec::len), Some(1), "the cursor it gave out pages on");

    for junk in ["zzz", "not-a-cursor", "wkr-", "wkr-xyz", "%FF"] {
        let r = send(Method::GET, &format!("{base}/v1/workers?cursor={junk}"), TOKEN, None, None).await;
        assert_problem(&r, StatusCode::BAD_REQUEST, "invalid-query", junk);
    }
}
