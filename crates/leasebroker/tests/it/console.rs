//! Issue 30: the operator console (`/console`) on the real binary. Black-box with reqwest: a
//! login is required, the session cookie is HttpOnly and SameSite=Strict and is not the token,
//! forms without the session's CSRF token (or from another origin) are refused and change nothing,
//! what tenants send is shown escaped, and a record in flight is never forgotten. Then a real
//! browser (Debian's chromium through chromedriver, driven by fantoccini) signs in through the
//! form, sees the fleet and a worker it created, forgets a record through the form and takes a
//! screenshot (saved where `CONSOLE_SCREENSHOT` says, for the README).

use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{ADMIN, Launch, Logged, Reply, TOKEN, create, send, sqlite_url, worker_body};

fn serve_logged(db: &str, extra: &[&str]) -> Logged {
    Launch::serve(db, &testkit::leasebroker::with_pool_nodes("16", extra)).env("RUST_LOG", "info").start()
}

/// A client that shows redirects instead of following them, and keeps no cookies.
fn browserless() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn get(base: &str, path: &str, cookie: Option<&str>) -> Reply {
    let mut req = browserless().get(format!("{base}{path}"));
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    let r = req.send().await.expect("request");
    Reply { status: r.status(), headers: r.headers().clone(), body: r.bytes().await.expect("body").to_vec() }
}

/// POSTs a form (`name=value` pairs, values url-safe) with `cookie` and extra `headers`.
async fn post_form(
    base: &str,
    path: &str,
    cookie: Option<&str>,
    form: &[(&str, &str)],
    headers: &[(&str, &str)],
) -> Reply {
    let body: Vec<String> = form.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut req = browserless()
        .post(format!("{base}{path}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body.join("&"));
    if let Some(c) = cookie {
        req = req.header("cookie", c);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.expect("request");
    Reply { status: r.status(), headers: r.headers().clone(), body: r.bytes().await.expect("body").to_vec() }
}

fn text(r: &Reply) -> String {
    String::from_utf8_lossy(&r.body).into_owned()
}

fn location(h: &HeaderMap) -> &str {
    h.get(LOCATION).and_then(|v| v.to_str().ok()).unwrap_or_default()
}

/// Signs in with the admin token; returns the `Cookie` header value and the raw `Set-Cookie`.
async fn sign_in(base: &str) -> (String, String) {
    let r = post_form(base, "/console/login", None, &[("token", ADMIN)], &[]).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", text(&r));
    assert_eq!(location(&r.headers), "/console");
    let set = r.headers.get(SET_COOKIE).expect("a session cookie").to_str().expect("ascii").to_owned();
    let pair = set.split(';').next().expect("name=value").trim().to_owned();
    (pair, set)
}

/// The CSRF token the page's forms carry.
fn csrf_of(page: &str) -> String {
    let re = regex::Regex::new(r#"name="csrf" value="([0-9a-f]{64})""#).expect("regex");
    re.captures(page).unwrap_or_else(|| panic!("no CSRF field in:\n{page}"))[1].to_owned()
}

async fn admin(base: &str, path: &str) -> Reply {
    send(Method::GET, &format!("{base}{path}"), ADMIN, None, None).await
}

/// The id of the only record of `principal` with `key`.
async fn record_id(base: &str, principal: &str, key: &str) -> String {
    let page = admin(base, &format!("/admin/v1/records?principal={principal}&limit=500")).await.json();
    let r = page["records"].as_array().expect("records").iter().find(|r| r["key"] == key).cloned();
    r.unwrap_or_else(|| panic!("no record for {key}: {page}"))["id"].as_str().expect("id").to_owned()
}

async fn audit_lines(lb: &Logged) -> usize {
    lb.log().lines().filter(|l| l.contains("an operator forgot")).count()
}

#[tokio::test]
async fn the_console_needs_the_admin_token_and_its_session_cookie_is_http_only_strict_and_not_the_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();

    for path in ["/console", "/console/records", "/console/records?state=in_flight"] {
        let r = get(base, path, None).await;
        assert_eq!(r.status, StatusCode::SEE_OTHER, "{path}");
        assert_eq!(location(&r.headers), "/console/login", "{path}");
    }
    let forged = get(base, "/console", Some(&format!("lb_console={}", "ab".repeat(32)))).await;
    assert_eq!(forged.status, StatusCode::SEE_OTHER, "a session id the server never gave out");

    let form = get(base, "/console/login", None).await;
    assert_eq!(form.status, StatusCode::OK);
    assert!(text(&form).contains(r#"name="token""#));

    // A tenant's token and a wrong one: the form again, 401, no cookie.
    for token in [TOKEN, "tok-admin-8c1b4d7e2f9", ""] {
        let r = post_form(base, "/console/login", None, &[("token", token)], &[]).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert!(r.headers.get(SET_COOKIE).is_none(), "{token:?}");
        assert!(text(&r).contains(r#"name="token""#), "the form again");
    }
    let garbage = post_form(base, "/console/login", None, &[("nonsense", "1")], &[]).await;
    assert_eq!(garbage.status, StatusCode::UNAUTHORIZED);

    let (cookie, set) = sign_in(base).await;
    let attrs: Vec<&str> = set.split(';').map(str::trim).collect();
    assert!(attrs.contains(&"HttpOnly"), "{set}");
    assert!(attrs.contains(&"SameSite=Strict"), "{set}");
    assert!(attrs.contains(&"Path=/console"), "{set}");
    assert!(!attrs.contains(&"Secure"), "plain HTTP: {set}");
    assert!(!set.contains(ADMIN), "the cookie is a session id, never the token: {set}");
    let behind_tls =
        post_form(base, "/console/login", None, &[("token", ADMIN)], &[("x-forwarded-proto", "https")]).await;
    let tls_cookie = behind_tls.headers.get(SET_COOKIE).expect("cookie").to_str().expect("ascii");
    assert!(tls_cookie.split(';').any(|a| a.trim() == "Secure"), "{tls_cookie}");

    let page = get(base, "/console", Some(&cookie)).await;
    assert_eq!(page.status, StatusCode::OK, "{}", text(&page));
    let html = text(&page);
    assert!(html.contains("Fleet") && html.contains("<svg"), "{html}");
    let csp = page.headers.get("content-security-policy").expect("a CSP").to_str().expect("ascii");
    assert!(csp.contains("default-src 'none'"), "{csp}");
    // No external asset: every src and href is a path on this server.
    let re = regex::Regex::new(r#"(?:src|href|action)="([^"]*)""#).expect("regex");
    for cap in re.captures_iter(&html) {
        assert!(cap[1].starts_with('/') || cap[1].starts_with('#'), "an external reference: {}", &cap[1]);
    }
    let css = get(base, "/console/console.css", None).await;
    assert_eq!(css.status, StatusCode::OK);
    assert!(css.headers["content-type"].to_str().expect("ascii").starts_with("text/css"));

    // Sign out: the session ends on the server, whatever the browser keeps.
    let csrf = csrf_of(&html);
    let out = post_form(base, "/console/logout", Some(&cookie), &[("csrf", &csrf)], &[]).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(out.headers[SET_COOKIE].to_str().expect("ascii").contains("Max-Age=0"));
    let after = get(base, "/console", Some(&cookie)).await;
    assert_eq!(after.status, StatusCode::SEE_OTHER, "the old cookie no longer opens the console");
}

#[tokio::test]
async fn console_forms_without_the_session_csrf_token_or_from_another_origin_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    assert_eq!(create(base, TOKEN, "csrf-victim-1", &worker_body()).await.status, StatusCode::CREATED);
    let id = record_id(base, "alice", "csrf-victim-1").await;
    let forget_path = format!("/console/records/{id}/forget");

    let (cookie, _) = sign_in(base).await;
    let csrf = csrf_of(&text(&get(base, "/console", Some(&cookie)).await));
    let (other_cookie, _) = sign_in(base).await;
    let other_csrf = csrf_of(&text(&get(base, "/console", Some(&other_cookie)).await));
    assert_ne!(csrf, other_csrf, "a token per session");

    let same_origin = [("origin", base)];
    let zeros = "0".repeat(64);
    // What is refused, the cookie, the form, the extra headers, and the answer.
    type Refusal<'a> = (&'a str, Option<&'a str>, Vec<(&'a str, &'a str)>, Vec<(&'a str, &'a str)>, StatusCode);
    let refusals: [Refusal<'_>; 6] = [
        ("no token", Some(&cookie), vec![], vec![], StatusCode::FORBIDDEN),
        ("a wrong token", Some(&cookie), vec![("csrf", &zeros)], vec![], StatusCode::FORBIDDEN),
        ("another session's token", Some(&cookie), vec![("csrf", &other_csrf)], vec![], StatusCode::FORBIDDEN),
        (
            "another origin",
            Some(&cookie),
            vec![("csrf", &csrf)],
            vec![("origin", "http://evil.example")],
            StatusCode::FORBIDDEN,
        ),
        (
            "another site",
            Some(&cookie),
            vec![("csrf", &csrf)],
            vec![("sec-fetch-site", "cross-site")],
            StatusCode::FORBIDDEN,
        ),
        ("no session", None, vec![("csrf", &csrf)], vec![], StatusCode::UNAUTHORIZED),
    ];
    for (what, cookie, form, headers, status) in refusals {
        let r = post_form(base, &forget_path, cookie, &form, &headers).await;
        assert_eq!(r.status, status, "{what}: {}", text(&r));
        assert_eq!(admin(base, &format!("/admin/v1/records/{id}")).await.status, StatusCode::OK, "{what}: kept");
    }
    assert_eq!(audit_lines(&lb).await, 0, "nothing audited:\n{}", lb.log());
    let refused_logout = post_form(base, "/console/logout", Some(&cookie), &[], &same_origin).await;
    assert_eq!(refused_logout.status, StatusCode::FORBIDDEN);
    assert_eq!(get(base, "/console", Some(&cookie)).await.status, StatusCode::OK, "still signed in");

    // With the token, from the console's own origin: forgotten, audited once, and shown.
    let r = post_form(base, &forget_path, Some(&cookie), &[("csrf", &csrf)], &same_origin).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", text(&r));
    assert_eq!(location(&r.headers), format!("/console?forgotten={id}"));
    assert_eq!(admin(base, &format!("/admin/v1/records/{id}")).await.status, StatusCode::NOT_FOUND);
    lb.wait_for_line(&["an operator forgot", &id, "csrf-victim-1"]);
    assert_eq!(audit_lines(&lb).await, 1);
    let shown = text(&get(base, &format!("/console?forgotten={id}"), Some(&cookie)).await);
    assert!(shown.contains("forgotten"), "{shown}");
    let audit = shown.split(r#"id="audit""#).nth(1).expect("the audit section");
    assert!(audit.contains(&id) && audit.contains("csrf-victim-1"), "{audit}");
    // The key runs afresh.
    assert_eq!(create(base, TOKEN, "csrf-victim-1", &worker_body()).await.status, StatusCode::CREATED);
}

#[tokio::test]
async fn the_console_shows_what_tenants_sent_escaped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    let key = "<script>alert('key')</script>";
    let body = json!({"image": "<img src=x onerror=alert(1)>", "cpu": 1, "memory_gb": 1,
                      "labels": {"team": "<script>alert('label')</script>"}});
    let created = create(base, TOKEN, key, &body).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let (cookie, _) = sign_in(base).await;

    let overview = text(&get(base, "/console", Some(&cookie)).await);
    let records = text(&get(base, "/console/records?state=completed&principal=alice", Some(&cookie)).await);
    for (page, html) in [("overview", &overview), ("records", &records)] {
        assert!(!html.contains("<script"), "{page}: a script tag got through:\n{html}");
        assert!(!html.contains("<img"), "{page}: an img tag got through:\n{html}");
    }
    assert!(overview.contains("&lt;img src=x onerror=alert(1)&gt;"), "the image, escaped:\n{overview}");
    assert!(
        overview.contains("team=&lt;script&gt;alert(&#39;label&#39;)&lt;/script&gt;"),
        "the label, escaped:\n{overview}"
    );
    assert!(records.contains("&lt;script&gt;alert(&#39;key&#39;)&lt;/script&gt;"), "the key, escaped:\n{records}");
}

/// Issue 45: a label's bidirectional override (U+202E) and control characters reach the page
/// as visible `\uXXXX` escapes, as `lbctl` prints them, never as characters that reorder or
/// hide the text around them.
#[tokio::test]
async fn the_console_escapes_bidirectional_overrides_and_control_characters() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    let body = json!({"image": "worker-base:2025.11", "cpu": 1, "memory_gb": 1,
                      "labels": {"owner": "\u{202e}gpj.exe", "note": "a\u{1b}[31mred\u{7}"}});
    let created = create(base, TOKEN, "bidi-label-1", &body).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", String::from_utf8_lossy(&created.body));
    let (cookie, _) = sign_in(base).await;
    let overview = text(&get(base, "/console", Some(&cookie)).await);
    for c in ['\u{202e}', '\u{1b}', '\u{7}'] {
        assert!(!overview.contains(c), "U+{:04X} reached the page unescaped", u32::from(c));
    }
    assert!(overview.contains("owner=\\u202egpj.exe"), "the override, escaped:\n{overview}");
    assert!(overview.contains("note=a\\u001b[31mred\\u0007"), "the controls, escaped:\n{overview}");
}

/// Issue 45: sign-ins are throttled per source address (every attempt counts, so a right token
/// guessed after the budget is spent is refused too), and a refused one is logged with its
/// source.
#[tokio::test]
async fn console_sign_ins_are_throttled_per_source_and_failures_logged_with_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    let mut statuses = Vec::new();
    for i in 0..12 {
        let r = post_form(base, "/console/login", None, &[("token", &format!("wrong-{i}"))], &[]).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            let wait = r.headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
            assert!(wait.is_some_and(|w| w >= 1), "a Retry-After in seconds: {:?}", r.headers);
            assert!(text(&r).contains(r#"name="token""#), "the form again, with why");
        }
        statuses.push(r.status.as_u16());
    }
    assert_eq!(&statuses[..10], &[401; 10], "{statuses:?}");
    assert_eq!(&statuses[10..], &[429; 2], "{statuses:?}");
    let right = post_form(base, "/console/login", None, &[("token", ADMIN)], &[]).await;
    assert_eq!(right.status, StatusCode::TOO_MANY_REQUESTS, "throttled before the token is looked at");
    assert!(right.headers.get(SET_COOKIE).is_none());

    let line = lb.wait_for_line(&["a login with a wrong token was refused", "source=127.0.0.1"]);
    assert!(!line.contains("wrong-0"), "the token tried is never logged: {line}");
    lb.wait_for_line(&["sign-ins throttled", "source=127.0.0.1"]);
    let refused = lb.log().lines().filter(|l| l.contains("a login with a wrong token was refused")).count();
    assert_eq!(refused, 10, "one line per refused token, none per throttled attempt");
}

#[tokio::test]
async fn the_records_page_takes_the_admin_listings_filters_and_pages_by_cursor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lb = serve_logged(&sqlite_url(&dir), &[]);
    let base = lb.url.as_str();
    for i in 0..5 {
        assert_eq!(create(base, TOKEN, &format!("page-{i}"), &worker_body()).await.status, StatusCode::CREATED);
    }
    let (cookie, _) = sign_in(base).await;
    for (query, detail) in [
        ("state=running", "state must be in_flight, failed, completed or uncertain"),
        ("older_than=soon", "older_than must be a duration"),
        ("limit=0", "limit must be 1 to"),
        ("limit=x", "limit must be a number"),
        ("cursor=not-ours", "cursor is not a cursor this service gave out"),
    ] {
        let r = get(base, &format!("/console/records?{query}"), Some(&cookie)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(text(&r).contains(detail), "{query}: {}", text(&r));
    }
    // Every record state is offered, `uncertain` too; no record is uncertain here.
    let unsure = text(&get(base, "/console/records?state=uncertain", Some(&cookie)).await);
    assert!(unsure.contains(r#"<option value="uncertain" selected>"#), "{unsure}");
    assert!(!unsure.contains("data-record="), "{unsure}");
    // Two at a time: the "Next page" form carries the cursor; every record once.
    let row = regex::Regex::new(r#"data-record="([0-9a-f]{32})""#).expect("regex");
    let cursor_field = regex::Regex::new(r#"name="cursor" value="([^"]+)""#).expect("regex");
    let form = regex::Regex::new(r#"<input type="hidden" name="([a-z_]+)" value="([^"]*)">"#).expect("regex");
    let mut seen = Vec::new();
    let mut query = "state=completed&principal=alice&older_than=&limit=2".to_owned();
    for _ in 0..10 {
        let page = text(&get(base, &format!("/console/records?{query}"), Some(&cookie)).await);
        let ids: Vec<String> = row.captures_iter(&page).map(|c| c[1].to_owned()).collect();
        assert!(ids.len() <= 2, "{page}");
        seen.extend(ids);
        match cursor_field.captures(&page) {
            // What the form sends: the filters, the page size and the cursor.
            Some(c) => {
                let fields: Vec<String> = form
                    .captures_iter(&page)
                    .filter(|f| &f[1] != "csrf")
                    .map(|f| format!("{}={}", &f[1], &f[2]))
                    .collect();
                assert!(
                    fields.contains(&"limit=2".to_owned()) && fields.contains(&format!("cursor={}", &c[1])),
                    "{fields:?}"
                );
                query = fields.join("&");
            }
            None => break,
        }
    }
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!((seen.len(), unique.len()), (5, 5), "{seen:?}");
    let none = text(&get(base, "/console/records?principal=bob", Some(&cookie)).await);
    assert!(!row.is_match(&none) && none.contains("None."), "{none}");
}

#[tokio::test]
async fn forgetting_through_the_console_refuses_a_record_in_flight() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Every hypervisor call takes 3 s: the create stays in flight that long.
    let lb = serve_logged(&sqlite_url(&dir), &["--sim-latency-ms", "3000"]);
    let base = lb.url.clone();
    let slow = tokio::spawn({
        let base = base.clone();
        async move { create(&base, TOKEN, "console-slow-1", &worker_body()).await }
    });
    let (cookie, _) = sign_in(&base).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let row_id = regex::Regex::new(r#"data-record="([0-9a-f]{32})""#).expect("regex");
    let (id, csrf) = loop {
        let page = get(&base, "/console", Some(&cookie)).await;
        let html = text(&page);
        let in_flight = html.split(r#"id="in-flight""#).nth(1).expect("the in-flight section");
        let in_flight = in_flight.split("</section>").next().unwrap_or_default();
        if in_flight.contains("console-slow-1") {
            let id = row_id.captures(in_flight).expect("a record row")[1].to_owned();
            assert!(!in_flight.contains("/forget"), "no forget button on a record in flight");
            break (id, csrf_of(&html));
        }
        assert!(Instant::now() < deadline, "the create never showed in flight:\n{html}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let r = post_form(&base, &format!("/console/records/{id}/forget"), Some(&cookie), &[("csrf", &csrf)], &[]).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", text(&r));
    assert!(text(&r).contains("in flight"));
    assert_eq!(admin(&base, &format!("/admin/v1/records/{id}")).await.json()["state"], "in_flight");

    let created = slow.await.expect("create task");
    assert_eq!(created.status, StatusCode::CREATED);
    let after: Value = admin(&base, &format!("/admin/v1/records/{id}")).await.json();
    assert_eq!((after["state"].as_str(), after["response_status"].as_i64()), (Some("completed"), Some(201)));
    assert_eq!(audit_lines(&lb).await, 0, "nothing was audited");
}

#[tokio::test]
async fn the_console_shows_what_the_reaper_rolled_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Every VM boots but its answer is lost: the create fails, and nobody retries it.
    let lb = serve_logged(
        &sqlite_url(&dir),
        &[
            "--sim-fail-after",
            "1",
            "--abandon-after",
            "1s",
            "--hypervisor-timeout",
            "900ms",
            "--hypervisor-settle",
            "1s",
            "--sweep-interval",
            "1s",
        ],
    );
    let base = lb.url.clone();
    let failed = create(&base, TOKEN, "abandoned-create-1", &worker_body()).await;
    assert!(failed.status.is_server_error(), "{}", String::from_utf8_lossy(&failed.body));
    let (cookie, _) = sign_in(&base).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let html = text(&get(&base, "/console", Some(&cookie)).await);
        let actions = html.split(r#"id="actions""#).nth(1).expect("the actions section");
        let actions = actions.split("</section>").next().unwrap_or_default();
        if actions.contains("rolled back an abandoned create") {
            assert!(actions.contains("abandoned-create-1") && actions.contains("alice"), "{actions}");
            break;
        }
        assert!(Instant::now() < deadline, "the rollback never showed:\n{html}\n{}", lb.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lb.wait_for_line(&["abandoned create rolled back", "abandoned-create-1"]);
}

mod browser {
    //! The console in a real browser: Debian's chromium, headless, driven through chromedriver.

    use super::*;
    use crate::webdriver::{ChromeDriver, Session};

    const CHROMIUM: &str = "/usr/bin/chromium";
    const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

    /// Whether chromium and chromedriver are installed; SKIPPED (a failure under CI=true) if not.
    fn browser_installed() -> bool {
        if std::path::Path::new(CHROMIUM).exists() && std::path::Path::new(CHROMEDRIVER).exists() {
            return true;
        }
        let message = "chromium or chromedriver is missing (Debian packages chromium and chromium-driver; \
                       scripts/install-test-tools browser installs them)";
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
        eprintln!("SKIPPED: the console's browser test: {message}");
        false
    }

    #[tokio::test]
    async fn in_a_real_browser_an_operator_signs_in_sees_the_fleet_and_a_worker_and_forgets_a_record() {
        if !browser_installed() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        // A hypervisor the test can make fail, and a reaper that rolls back within seconds.
        let sim = crate::support::sim(&[]);
        let lb = serve_logged(
            &sqlite_url(&dir),
            &[
                "--hypervisor-url",
                &sim.url,
                "--hypervisor-timeout",
                "900ms",
                "--hypervisor-settle",
                "1s",
                "--abandon-after",
                "1s",
                "--sweep-interval",
                "1s",
            ],
        );
        let base = lb.url.clone();
        // Some traffic for the page and its chart: creates, a replay, a key reused with another
        // body, and a create whose VM booted but whose answer was lost (the reaper rolls it back).
        let body = |i: usize| {
            let mut body = worker_body();
            body["labels"]["batch"] = json!(format!("nightly-{i}"));
            body
        };
        for i in 0..6 {
            assert_eq!(create(&base, TOKEN, &format!("eval-run-{i}"), &body(i)).await.status, StatusCode::CREATED);
        }
        let replayed = create(&base, TOKEN, "eval-run-0", &body(0)).await;
        assert!(replayed.replayed());
        let worker_id = replayed.json()["id"].as_str().expect("worker id").to_owned();
        let mismatch = create(&base, TOKEN, "eval-run-1", &json!({"image": "other", "cpu": 1, "memory_gb": 1})).await;
        assert!(mismatch.status.is_client_error());
        crate::support::set_faults(&sim.url, 0.0, 1.0, 0).await;
        assert!(create(&base, TOKEN, "eval-run-lost", &body(9)).await.status.is_server_error());
        crate::support::set_faults(&sim.url, 0.0, 0.0, 0).await;
        let forget_key = "eval-run-5";
        let id = record_id(&base, "alice", forget_key).await;

        let driver = ChromeDriver::start(CHROMEDRIVER).await;
        let profile = tempfile::tempdir().expect("profile dir");
        let browser = Session::new(
            &driver.url,
            json!({"browserName": "chrome", "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,2000", format!("--user-data-dir={}", profile.path().display())],
            }}),
        )
        .await;

        browser.goto(&format!("{base}/console")).await;
        assert!(browser.current_url().await.ends_with("/console/login"), "sent to the login form");
        browser.send_keys(&browser.wait_for("#token").await, ADMIN).await;
        browser.click(&browser.wait_for("section.login button[type=submit]").await).await;
        let fleet = browser.wait_for("#fleet dl.fleet").await;

        let cookie = browser.cookie("lb_console").await;
        assert_eq!(cookie["httpOnly"], true, "{cookie}");
        assert_eq!(cookie["sameSite"], "Strict", "{cookie}");
        assert_eq!(cookie["path"], "/console", "{cookie}");
        assert_ne!(cookie["value"], ADMIN, "{cookie}");
        assert_eq!(browser.execute("return document.cookie").await, "", "HttpOnly: no script reads it");

        let fleet = browser.text(&fleet).await;
        assert!(fleet.contains("Workers") && fleet.contains("VMs running"), "{fleet}");
        let worker = browser.wait_for(&format!("#workers tr[data-worker='{worker_id}']")).await;
        assert!(browser.text(&worker).await.contains("nightly-0"), "the worker's row shows its labels");
        let chart = browser.outer_html(&browser.wait_for("#outcomes svg").await).await;
        // The lost create ran its handler too: it counts as executed.
        assert!(
            chart.contains("executed (7)") && chart.contains("replayed (1)") && chart.contains("mismatch (1)"),
            "{chart}"
        );

        // Every resource the page loaded came from the service itself.
        let loaded = browser.execute("return performance.getEntriesByType('resource').map(e => e.name)").await;
        let loaded = loaded.as_array().expect("a list").clone();
        assert!(!loaded.is_empty(), "the stylesheet at least");
        for url in loaded {
            assert!(url.as_str().is_some_and(|u| u.starts_with(&base)), "an external asset: {url}");
        }

        // What the reaper did shows once it did it (the page is rendered afresh each time).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let actions = browser.text(&browser.wait_for("#actions").await).await;
            if actions.contains("rolled back an abandoned create") {
                assert!(actions.contains("eval-run-lost"), "{actions}");
                break;
            }
            assert!(Instant::now() < deadline, "no rollback shown: {actions}");
            tokio::time::sleep(Duration::from_millis(200)).await;
            browser.goto(&format!("{base}/console")).await;
        }

        // Forget a completed record with its button on the records page.
        browser.goto(&format!("{base}/console/records?state=completed&principal=alice")).await;
        browser.click(&browser.wait_for(&format!("tr[data-record='{id}'] form button")).await).await;
        let notice = browser.text(&browser.wait_for("p.notice").await).await;
        assert!(notice.contains(&id), "{notice}");
        let audit = browser.text(&browser.wait_for("#audit").await).await;
        assert!(audit.contains(forget_key), "{audit}");

        let png = browser.screenshot().await;
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
        if let Ok(path) = std::env::var("CONSOLE_SCREENSHOT") {
            std::fs::write(&path, &png).expect("write the screenshot");
            eprintln!("console screenshot written to {path}");
        }
        browser.quit().await;

        assert_eq!(admin(&base, &format!("/admin/v1/records/{id}")).await.status, StatusCode::NOT_FOUND);
        lb.wait_for_line(&["an operator forgot", &id, forget_key]);
    }
}
