//! A scripted HTTP server: answers each request with the next scripted reply (the last one
//! repeats) and records what every request carried.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

/// One scripted answer.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    delay: Duration,
}

impl Reply {
    pub(crate) fn json(status: u16, body: impl Into<String>) -> Self {
        Reply {
            status,
            headers: vec![("content-type", "application/json".into())],
            body: body.into(),
            delay: Duration::ZERO,
        }
    }

    /// An RFC 9457 problem with the given short name.
    pub(crate) fn problem(status: u16, name: &str) -> Self {
        let body = serde_json::json!({
            "type": format!("https://leasebroker.test/problems/{name}"),
            "title": name,
            "status": status,
            "detail": format!("scripted {name}"),
        });
        Reply {
            status,
            headers: vec![("content-type", "application/problem+json".into())],
            body: body.to_string(),
            delay: Duration::ZERO,
        }
    }

    pub(crate) fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// Waits this long before answering (to make the client's attempt time out).
    pub(crate) fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// What one request carried.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub method: Method,
    pub path_and_query: String,
    pub key: Option<String>,
    pub authorization: Option<String>,
    pub content_type: Option<String>,
    pub body: Bytes,
}

#[derive(Debug)]
struct State {
    script: VecDeque<Reply>,
    last: Reply,
    seen: Vec<Seen>,
}

/// The running server; it stops when the test's runtime ends.
#[derive(Debug, Clone)]
pub(crate) struct Scripted {
    pub url: String,
    state: Arc<Mutex<State>>,
}

impl Scripted {
    pub(crate) async fn start(replies: impl IntoIterator<Item = Reply>) -> Self {
        let mut script: VecDeque<Reply> = replies.into_iter().collect();
        let last = script.back().cloned().expect("a script needs at least one reply");
        if script.len() == 1 {
            script.clear();
        }
        let state = Arc::new(Mutex::new(State { script, last, seen: Vec::new() }));
        let handler_state = state.clone();
        let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let state = handler_state.clone();
            async move { answer(state, method, uri, headers, body).await }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        Scripted { url, state }
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.state.lock().expect("lock").seen.clone()
    }

    pub(crate) fn keys(&self) -> Vec<Option<String>> {
        self.seen().into_iter().map(|s| s.key).collect()
    }

    pub(crate) fn count(&self) -> usize {
        self.state.lock().expect("lock").seen.len()
    }
}

async fn answer(state: Arc<Mutex<State>>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let reply = {
        let mut state = state.lock().expect("lock");
        state.seen.push(Seen {
            method,
            path_and_query: uri.path_and_query().map(|p| p.to_string()).unwrap_or_default(),
            key: text("idempotency-key"),
            authorization: text("authorization"),
            content_type: text("content-type"),
            body,
        });
        let last = state.last.clone();
        state.script.pop_front().unwrap_or(last)
    };
    tokio::time::sleep(reply.delay).await;
    let mut response = (StatusCode::from_u16(reply.status).expect("status"), reply.body).into_response();
    for (name, value) in reply.headers {
        response.headers_mut().insert(name, value.parse().expect("header value"));
    }
    response
}

/// A port with nothing listening on it.
pub(crate) fn closed_port_url() -> String {
    testkit::closed_url()
}
