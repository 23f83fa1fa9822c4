//! Starting upstreams and gateways, sending requests, reading the upstream's own counts.

use std::path::PathBuf;

use reqwest::{Client, Response, StatusCode};
use serde_json::Value;
use testkit::{Launch, Proc};

/// The admin token of every gateway the kit starts.
pub(crate) use testkit::gateway::ADMIN_TOKEN;

/// The bearer credentials the tests' clients send (their principal is its hash).
pub(crate) const TOKEN: &str = "Bearer client-a";

/// An upstream service in another language.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lang {
    Python,
    Node,
}

/// A running upstream: killed when dropped.
pub(crate) struct Upstream {
    pub(crate) proc: Proc,
}

impl Upstream {
    /// Starts the `lang` upstream with `extra` flags (`--dedupe`).
    pub(crate) fn start(lang: Lang, extra: &[&str]) -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/upstreams");
        let (program, script) = match lang {
            Lang::Python => ("python3", dir.join("upstream.py")),
            Lang::Node => ("node", dir.join("upstream.mjs")),
        };
        let script = script.to_str().expect("a UTF-8 path").to_owned();
        let args = [&[script.as_str(), "--listen", "127.0.0.1:0"][..], extra].concat();
        Self { proc: Launch::of(program, &args).start() }
    }

    pub(crate) fn url(&self) -> &str {
        &self.proc.url
    }

    /// The upstream's own count of the requests it executed.
    pub(crate) async fn executions(&self) -> u64 {
        self.counts().await["executions"].as_u64().expect("executions")
    }

    /// `{"executions", "by_key", "last"}` as the upstream keeps them.
    pub(crate) async fn counts(&self) -> Value {
        let res = client().get(format!("{}/__count", self.url())).send().await.expect("the upstream's count");
        res.json().await.expect("JSON")
    }
}

/// A gateway in front of `upstream` on `store`, with `extra` flags.
pub(crate) fn gateway(upstream: &str, store: &str, extra: &[&str]) -> Proc {
    testkit::gateway::start(upstream, store, extra)
}

pub(crate) fn client() -> Client {
    Client::builder().pool_max_idle_per_host(64).build().expect("client")
}

/// A keyed POST to `path` through the gateway at `url` with `TOKEN`, `body`, and `headers`.
pub(crate) async fn post(url: &str, path: &str, key: &str, body: &str, headers: &[(&str, &str)]) -> Response {
    let mut req = client()
        .post(format!("{url}{path}"))
        .header("authorization", TOKEN)
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.expect("the gateway answers")
}

/// Status, headers and body of a response.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: String,
}

impl Answer {
    pub(crate) async fn of(res: Response) -> Self {
        let status = res.status();
        let headers = res.headers().clone();
        let body = res.text().await.expect("the body");
        Self { status, headers, body }
    }

    /// The problem's `type` name (after `/problems/`), or "" for another body.
    pub(crate) fn problem(&self) -> String {
        let v: Value = serde_json::from_str(&self.body).unwrap_or(Value::Null);
        v["type"].as_str().unwrap_or("").rsplit('/').next().unwrap_or("").to_owned()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// `post`, read whole.
pub(crate) async fn send(url: &str, path: &str, key: &str, body: &str, headers: &[(&str, &str)]) -> Answer {
    Answer::of(post(url, path, key, body, headers).await).await
}

/// An admin request with the admin token (and, when mutating, an Idempotency-Key).
pub(crate) async fn admin(gateway: &Proc, method: reqwest::Method, path: &str, body: Option<Value>) -> Answer {
    let url = format!("{}{path}", testkit::gateway::admin_url(gateway));
    let mut req = client().request(method.clone(), url).header("authorization", format!("Bearer {ADMIN_TOKEN}"));
    if method != reqwest::Method::GET {
        req = req.header("idempotency-key", format!("\"admin-{}\"", uuid_like()));
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    Answer::of(req.send().await.expect("the admin listener answers")).await
}

/// A fresh key.
pub(crate) fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("time").as_nanos();
    format!("k{nanos:x}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Sends `post` again until its answer is no longer `409 request-in-progress` (the claim of a
/// killed gateway goes stale after the in-flight TTL); returns that answer.
pub(crate) async fn until_settled(url: &str, path: &str, key: &str, body: &str) -> Answer {
    loop {
        let answer = send(url, path, key, body, &[]).await;
        if answer.problem() != "request-in-progress" {
            return answer;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Waits until the upstream has executed `n` requests.
pub(crate) async fn until_executed(upstream: &Upstream, n: u64) {
    while upstream.executions().await < n {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
