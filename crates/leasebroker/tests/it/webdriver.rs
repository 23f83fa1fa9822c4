//! A small WebDriver client (W3C WebDriver: JSON over HTTP) for the console's browser test, on
//! reqwest: a session on chromedriver, and the dozen commands the test uses.
//!
//! Why not fantoccini or thirtyfour: fantoccini's `webdriver` dependency brings the ICU
//! segmenter and new features of the proc-macro `syn`, and thirtyfour turns on serde_json's
//! `preserve_order` for the whole workspace (the service's JSON would change); each rebuilds or
//! changes far more than this test needs.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// chromedriver on a free port, killed when dropped.
pub(crate) struct ChromeDriver {
    child: Child,
    pub(crate) url: String,
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ChromeDriver {
    /// Starts `chromedriver` and waits (up to a minute) until its `/status` says it is ready.
    pub(crate) async fn start(binary: &str) -> Self {
        let port = testkit::free_port();
        let child = Command::new(binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let driver = Self { child, url: format!("http://127.0.0.1:{port}") };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = reqwest::get(format!("{}/status", driver.url)).await
                && let Ok(status) = r.json::<Value>().await
                && status["value"]["ready"] == true
            {
                return driver;
            }
            assert!(Instant::now() < deadline, "chromedriver was not ready within a minute");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A browser session.
pub(crate) struct Session {
    http: reqwest::Client,
    base: String,
}

/// An element of the page.
#[derive(Debug, Clone)]
pub(crate) struct Element(String);

impl Session {
    /// Opens a browser session on the WebDriver server at `driver` with `capabilities`.
    pub(crate) async fn new(driver: &str, capabilities: Value) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client");
        let r: Value = http
            .post(format!("{driver}/session"))
            .json(&json!({"capabilities": {"alwaysMatch": capabilities}}))
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("json");
        let id = r["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {r}")).to_owned();
        Self { http, base: format!("{driver}/session/{id}") }
    }

    /// Sends a command; its `value`, or the WebDriver error's name and message.
    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value, String> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.map_err(|e| e.to_string())?;
        let ok = r.status().is_success();
        let v: Value = r.json().await.map_err(|e| e.to_string())?;
        if ok { Ok(v["value"].clone()) } else { Err(format!("{}: {}", v["value"]["error"], v["value"]["message"])) }
    }

    async fn must(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let what = format!("{method} {path}");
        self.command(method, path, body).await.unwrap_or_else(|e| panic!("{what}: {e}"))
    }

    /// Navigates to `url` and waits for the page to load.
    pub(crate) async fn goto(&self, url: &str) {
        self.must(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// The page's URL.
    pub(crate) async fn current_url(&self) -> String {
        self.must(reqwest::Method::GET, "/url", None).await.as_str().expect("a URL").to_owned()
    }

    /// The first element matching the CSS selector, if one is there now.
    pub(crate) async fn find(&self, css: &str) -> Option<Element> {
        let v = self
            .command(reqwest::Method::POST, "/element", Some(json!({"using": "css selector", "value": css})))
            .await
            .ok()?;
        Some(Element(v[ELEMENT].as_str()?.to_owned()))
    }

    /// Waits (up to a minute) for an element matching the CSS selector.
    pub(crate) async fn wait_for(&self, css: &str) -> Element {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(e) = self.find(css).await {
                return e;
            }
            assert!(Instant::now() < deadline, "no {css} within a minute on {}", self.current_url().await);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The element's rendered text.
    pub(crate) async fn text(&self, e: &Element) -> String {
        self.must(reqwest::Method::GET, &format!("/element/{}/text", e.0), None).await.as_str().unwrap_or("").to_owned()
    }

    /// The element's markup.
    pub(crate) async fn outer_html(&self, e: &Element) -> String {
        let path = format!("/element/{}/property/outerHTML", e.0);
        self.must(reqwest::Method::GET, &path, None).await.as_str().unwrap_or("").to_owned()
    }

    /// Clicks the element.
    pub(crate) async fn click(&self, e: &Element) {
        self.must(reqwest::Method::POST, &format!("/element/{}/click", e.0), Some(json!({}))).await;
    }

    /// Types `text` into the element.
    pub(crate) async fn send_keys(&self, e: &Element, text: &str) {
        self.must(reqwest::Method::POST, &format!("/element/{}/value", e.0), Some(json!({"text": text}))).await;
    }

    /// The cookie `name` as the browser holds it (`httpOnly`, `sameSite`, `value`, ...).
    pub(crate) async fn cookie(&self, name: &str) -> Value {
        self.must(reqwest::Method::GET, &format!("/cookie/{name}"), None).await
    }

    /// Runs `script` in the page; what it returns.
    pub(crate) async fn execute(&self, script: &str) -> Value {
        self.must(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": []}))).await
    }

    /// A PNG of the window.
    pub(crate) async fn screenshot(&self) -> Vec<u8> {
        let b64 = self.must(reqwest::Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD.decode(b64.as_str().expect("base64")).expect("a base64 PNG")
    }

    /// Ends the session (the browser quits).
    pub(crate) async fn quit(self) {
        let _ = self.http.delete(&self.base).send().await;
    }
}
