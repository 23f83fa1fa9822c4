//! Sending requests and keeping what was sent and answered, for the report.

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::profile::Req;

/// A request and its response, as the report shows them (the bearer token left out).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Exchange {
    pub(crate) request: String,
    pub(crate) request_headers: Vec<(String, String)>,
    pub(crate) request_body: String,
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

/// A response read whole.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// The first value of header `name` (any case).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The last segment of a problem's `type`, if the body is a problem.
    pub(crate) fn problem_type(&self) -> Option<String> {
        let t = self.json().get("type")?.as_str()?.to_owned();
        Some(t.rsplit('/').next().unwrap_or_default().to_owned())
    }

    pub(crate) fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub(crate) fn summary(&self) -> String {
        let body = String::from_utf8_lossy(&self.body);
        let body: String = body.chars().take(160).collect();
        format!("{} {}", self.status, body)
    }
}

/// The target and its tokens.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) url: String,
    pub(crate) tokens: Vec<String>,
    http: reqwest::Client,
}

/// Extra header lines of one request: (name, value bytes).
pub(crate) type Extra = Vec<(String, Vec<u8>)>;

impl Target {
    pub(crate) fn new(url: &str, tokens: Vec<String>) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        Ok(Self { url: url.trim_end_matches('/').to_owned(), tokens, http })
    }

    pub(crate) fn has_token(&self, i: usize) -> bool {
        self.tokens.len() > i || (i == 0 && self.tokens.is_empty())
    }

    /// Sends `req` with `key` (the header's raw value; `None`: no header) and `extra` headers.
    pub(crate) async fn send(
        &self,
        req: &Req,
        key: Option<&[u8]>,
        extra: &[(&str, &[u8])],
        log: &mut Vec<Exchange>,
    ) -> Result<Answer, String> {
        let mut extra: Extra = extra.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())).collect();
        if let Some(k) = key {
            extra.insert(0, ("Idempotency-Key".into(), k.to_vec()));
        }
        self.send_raw_headers(req, &req.path, req.token, &extra, log).await
    }

    /// Sends `req` to `path` as `token` with exactly the headers `extra` (and the token and
    /// content type).
    pub(crate) async fn send_raw_headers(
        &self,
        req: &Req,
        path: &str,
        token: usize,
        extra: &[(String, Vec<u8>)],
        log: &mut Vec<Exchange>,
    ) -> Result<Answer, String> {
        let method = reqwest::Method::from_bytes(req.method.as_bytes()).map_err(|e| e.to_string())?;
        let url = format!("{}{}", self.url, path);
        let mut headers = HeaderMap::new();
        for (name, value) in extra {
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|e| e.to_string())?;
            let value = HeaderValue::from_bytes(value).map_err(|e| e.to_string())?;
            headers.append(name, value);
        }
        let body = req.body.as_ref().map(|b| serde_json::to_vec(b).unwrap_or_default());
        if body.is_some() && !headers.contains_key("content-type") {
            headers.insert("content-type", HeaderValue::from_static("application/json"));
        }
        let mut builder = self.http.request(method, &url).headers(headers.clone());
        if let Some(token) = self.tokens.get(token) {
            builder = builder.bearer_auth(token);
        }
        if let Some(b) = &body {
            builder = builder.body(b.clone());
        }
        let resp = builder.send().await.map_err(|e| format!("{} {url}: {e}", req.method))?;
        let status = resp.status().as_u16();
        let answer_headers: Vec<(String, String)> = resp
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        let bytes = resp.bytes().await.map_err(|e| format!("{} {url}: reading the body: {e}", req.method))?.to_vec();
        let answer = Answer { status, headers: answer_headers, body: bytes };
        log.push(Exchange {
            request: format!("{} {url}", req.method),
            request_headers: headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect(),
            request_body: body.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default(),
            status,
            headers: answer.headers.clone(),
            body: truncate(&String::from_utf8_lossy(&answer.body), 2000),
        });
        Ok(answer)
    }

    /// A GET with the first token.
    pub(crate) async fn get(&self, path: &str, log: &mut Vec<Exchange>) -> Result<Answer, String> {
        let req = Req::new("GET", path, None);
        self.send_raw_headers(&req, path, 0, &[], log).await
    }

    /// Sends `req` over a plain TCP connection with the key header's name spelled exactly as
    /// `name` (HTTP clients normalize names; this does not). Only for `http://` targets.
    pub(crate) async fn send_with_header_name(
        &self,
        req: &Req,
        name: &str,
        key: &str,
        log: &mut Vec<Exchange>,
    ) -> Result<Option<Answer>, String> {
        let Some(rest) = self.url.strip_prefix("http://") else { return Ok(None) };
        let (authority, base_path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let body = req.body.as_ref().map(|b| serde_json::to_vec(b).unwrap_or_default()).unwrap_or_default();
        let mut head = format!(
            "{} {base_path}{} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n{name}: {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
            req.method,
            req.path,
            body.len()
        );
        if let Some(token) = self.tokens.get(req.token) {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str("\r\n");
        let io = async {
            let mut stream = tokio::net::TcpStream::connect(authority).await?;
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(&body).await?;
            let mut raw = Vec::new();
            stream.read_to_end(&mut raw).await?;
            Ok::<_, std::io::Error>(raw)
        };
        let raw = tokio::time::timeout(Duration::from_secs(60), io)
            .await
            .map_err(|_| format!("{} {}: no answer in 60 s", req.method, req.path))?
            .map_err(|e| format!("{} {}: {e}", req.method, req.path))?;
        let answer = parse_http1(&raw).ok_or_else(|| "an unreadable HTTP/1.1 answer".to_owned())?;
        log.push(Exchange {
            request: format!("{} {}{} (raw, header name {name:?})", req.method, self.url, req.path),
            request_headers: vec![(name.to_owned(), key.to_owned())],
            request_body: String::from_utf8_lossy(&body).into_owned(),
            status: answer.status,
            headers: answer.headers.clone(),
            body: truncate(&String::from_utf8_lossy(&answer.body), 2000),
        });
        Ok(Some(answer))
    }
}

/// An HTTP/1.1 response read to the end of the connection (`Content-Length` or chunked).
fn parse_http1(raw: &[u8]) -> Option<Answer> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked")) {
        body = dechunk(&body)?;
    }
    Some(Answer { status, headers, body })
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &s[..end], s.len())
}
