//! The console's pages, written with `format!` and one rule: every value that comes from the
//! database, the store, a tenant or the request (keys, labels, principals, images, messages) goes
//! through [`E`], which escapes it for HTML text and quoted attribute values. Only the chart's
//! SVG, which [`super::chart`] builds and escapes itself, and the literals here go in as they are.

use std::fmt::{self, Display, Write as _};

use idempotency::{Record, RecordPage, RecordState};
use leasebroker_api::text::needs_escape;

use crate::activity::Action;
use crate::api::Fleet;
use crate::audit::AuditEntry;
use crate::domain::{LiveOperation, WorkerRow};

/// The stylesheet, served by the binary at `/console/console.css`.
pub(super) const CSS: &str = include_str!("console.css");

/// Text escaped for HTML content and double- or single-quoted attribute values; control
/// characters and bidirectional overrides are written as visible `\uXXXX`, as `lbctl` prints
/// them ([`leasebroker_api::text`]), so a label cannot reorder or hide what the page shows.
pub(super) struct E<'a>(pub(super) &'a str);

impl Display for E<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(i) = rest.find(|c: char| matches!(c, '&' | '<' | '>' | '"' | '\'') || needs_escape(c)) {
            f.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().unwrap_or_default();
            match c {
                '&' => f.write_str("&amp;")?,
                '<' => f.write_str("&lt;")?,
                '>' => f.write_str("&gt;")?,
                '"' => f.write_str("&quot;")?,
                '\'' => f.write_str("&#39;")?,
                _ => write!(f, "\\u{:04x}", u32::from(c))?,
            }
            rest = &rest[i + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// What the overview shows; a section whose source failed shows why instead.
pub(super) struct Overview {
    /// Now, µs since the epoch (ages are counted from it).
    pub(super) now: i64,
    pub(super) fleet: Result<Fleet, String>,
    pub(super) workers: Result<Vec<WorkerRow>, String>,
    pub(super) operations: Result<Vec<LiveOperation>, String>,
    pub(super) in_flight: Result<Vec<Record>, String>,
    pub(super) failed: Result<Vec<Record>, String>,
    pub(super) audit: Result<Vec<AuditEntry>, String>,
    pub(super) actions: Vec<Action>,
    /// The chart, an SVG document escaped by its builder.
    pub(super) chart: String,
    /// The record just forgotten, for the notice.
    pub(super) forgotten: Option<String>,
}

/// The records page's filters, as typed.
pub(super) struct Filters {
    pub(super) state: String,
    pub(super) principal: String,
    pub(super) older_than: String,
    /// The page size asked for, if any (kept across pages).
    pub(super) limit: Option<u32>,
}

/// `micros` µs, for people: `42 s`, `5 min 3 s`, `2 h 10 min`, `3 d 4 h`.
pub(super) fn duration(micros: i64) -> String {
    let s = micros.max(0) / 1_000_000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        _ => format!("{} d {} h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// A worker's labels (a JSON object of strings) as `key=value, key=value`; as stored otherwise.
fn labels(json: &str) -> String {
    match serde_json::from_str::<std::collections::BTreeMap<String, String>>(json) {
        Ok(map) => map.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", "),
        Err(_) => json.to_owned(),
    }
}

/// µs since the epoch as RFC 3339, to the second.
fn time(micros: i64) -> String {
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

/// The page around `body`; with a session (its CSRF token), the navigation and *Sign out*.
fn layout(title: &str, csrf: Option<&str>, body: &str) -> String {
    let mut h = String::with_capacity(body.len() + 2048);
    let _ = write!(
        h,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>{} · leasebroker console</title><link rel="stylesheet" href="/console/console.css"></head><body><header><span class="brand">leasebroker console</span>"#,
        E(title)
    );
    if let Some(csrf) = csrf {
        let _ = write!(
            h,
            r#"<nav><a href="/console">Overview</a><a href="/console/records">Records</a><a href="/metrics">Metrics</a></nav><form class="logout" method="post" action="/console/logout"><input type="hidden" name="csrf" value="{}"><button type="submit">Sign out</button></form>"#,
            E(csrf)
        );
    }
    let _ = write!(h, "</header><main>{body}</main></body></html>");
    h
}

/// The login form, with `error` above it.
pub(super) fn login(error: Option<&str>, admin_configured: bool) -> String {
    let mut b = String::from(r#"<section class="login"><h1>Sign in</h1>"#);
    if let Some(error) = error {
        let _ = write!(b, r#"<p class="error" role="alert">{}</p>"#, E(error));
    }
    if !admin_configured {
        b.push_str(r#"<p class="error">This service runs without --admin-token: the console is closed.</p>"#);
    }
    b.push_str(
        r#"<form method="post" action="/console/login"><label for="token">Admin token</label><input id="token" type="password" name="token" autocomplete="current-password" required autofocus><button type="submit">Sign in</button></form><p class="hint">The token given to <code>leasebroker serve --admin-token</code>. Tenants' tokens are refused.</p></section>"#,
    );
    layout("Sign in", None, &b)
}

/// A page with one message (a refusal, an error) and a way back.
pub(super) fn message(title: &str, text: &str, csrf: Option<&str>) -> String {
    let body = format!(
        r#"<h1>{}</h1><p class="error" role="alert">{}</p><p><a href="/console">Back to the overview</a></p>"#,
        E(title),
        E(text)
    );
    layout(title, csrf, &body)
}

fn unavailable(b: &mut String, why: &str) {
    let _ = write!(b, r#"<p class="error">Unavailable: {}</p>"#, E(why));
}

fn none_if_empty(b: &mut String, empty: bool, text: &str) {
    if empty {
        let _ = write!(b, r#"<p class="empty">{text}</p>"#);
    }
}

fn record_rows(b: &mut String, records: &[Record], now: i64, csrf: &str) {
    b.push_str(
        r#"<table class="records"><thead><tr><th>Record</th><th>Principal</th><th>Endpoint</th><th>Key</th><th>State</th><th>Status</th><th>Attempt age</th><th>Created</th><th></th></tr></thead><tbody>"#,
    );
    for r in records {
        let id = r.record_id.to_hex();
        let state = r.state.as_str();
        let status = r.response.as_ref().map(|resp| resp.status.to_string()).unwrap_or_default();
        let _ = write!(
            b,
            r#"<tr data-record="{id}"><td class="mono">{id}</td><td>{}</td><td>{}</td><td class="mono">{}</td><td><span class="state {state}">{state}</span></td><td>{status}</td><td>{}</td><td>{}</td><td>"#,
            E(r.scope.principal.as_str()),
            E(r.scope.endpoint.as_str()),
            E(r.scope.key.as_str()),
            duration(now - r.started_at.timestamp_micros()),
            time(r.created_at.timestamp_micros()),
        );
        // A record in flight is never forgotten: no button (the server refuses it anyway).
        if r.state != RecordState::InFlight {
            let _ = write!(
                b,
                r#"<form class="inline" method="post" action="/console/records/{id}/forget"><input type="hidden" name="csrf" value="{}"><button type="submit" title="Forget this record: the key's next request runs as a new operation">Forget</button></form>"#,
                E(csrf)
            );
        }
        b.push_str("</td></tr>");
    }
    b.push_str("</tbody></table>");
    none_if_empty(b, records.is_empty(), "None.");
}

fn fleet_table(b: &mut String, fleet: &Fleet) {
    let rows: [(&str, u64); 9] = [
        ("Nodes in the pool", fleet.nodes_total),
        ("Nodes allocated", fleet.nodes_allocated),
        ("Leases held", fleet.leases_active),
        ("Workers", fleet.workers_active),
        ("VMs running", fleet.vms_running),
        ("VM boots, ever", fleet.vm_boots_total),
        ("Reboots, ever", fleet.reboots_total),
        ("Firmware flashes, ever", fleet.firmware_flashes_total),
        ("Nodes bricked", fleet.nodes_bricked),
    ];
    b.push_str(r#"<dl class="fleet">"#);
    for (name, n) in rows {
        let _ = write!(b, "<div><dt>{name}</dt><dd>{n}</dd></div>");
    }
    b.push_str("</dl>");
}

/// The overview page.
pub(super) fn overview(o: &Overview, csrf: &str) -> String {
    let mut b = String::with_capacity(32 * 1024);
    if let Some(id) = &o.forgotten {
        let _ = write!(
            b,
            r#"<p class="notice" role="status">Record <span class="mono">{}</span> forgotten: its key's next request runs as a new operation.</p>"#,
            E(id)
        );
    }

    b.push_str(r#"<section id="fleet"><h2>Fleet</h2>"#);
    match &o.fleet {
        Ok(f) => fleet_table(&mut b, f),
        Err(e) => unavailable(&mut b, e),
    }
    b.push_str("</section>");

    let _ =
        write!(b, r#"<section id="outcomes"><h2>Request outcomes, per minute, last hour</h2>{}</section>"#, o.chart);

    live_operations(&mut b, o);

    b.push_str(r#"<section id="in-flight"><h2>Records in flight</h2>"#);
    match &o.in_flight {
        Ok(r) => record_rows(&mut b, r, o.now, csrf),
        Err(e) => unavailable(&mut b, e),
    }
    b.push_str(
        r#"<p><a href="/console/records?state=in_flight&amp;older_than=10m">Stuck for 10 minutes or more</a></p></section>"#,
    );

    b.push_str(r#"<section id="failed"><h2>Records failed</h2>"#);
    match &o.failed {
        Ok(r) => record_rows(&mut b, r, o.now, csrf),
        Err(e) => unavailable(&mut b, e),
    }
    b.push_str("</section>");

    latest_workers(&mut b, o);
    reaper_actions(&mut b, o);
    forgotten_records(&mut b, o);
    layout("Overview", Some(csrf), &b)
}

/// The live operations: creates not finished, deletes and reboots until the reaper sees them end.
fn live_operations(b: &mut String, o: &Overview) {
    b.push_str(
        r#"<section id="operations"><h2>Live operations</h2><p class="hint">Creates not finished yet, and deletes and reboots until the reaper sees them finish; the oldest attempt first.</p>"#,
    );
    match &o.operations {
        Err(e) => unavailable(b, e),
        Ok(ops) => {
            b.push_str(
                r#"<table><thead><tr><th>Kind</th><th>Principal</th><th>Endpoint</th><th>Key</th><th>Attempt age</th><th>Reaper</th></tr></thead><tbody>"#,
            );
            for op in ops {
                let _ = write!(
                    b,
                    r#"<tr><td>{}</td><td>{}</td><td>{}</td><td class="mono">{}</td><td>{}</td><td>{}</td></tr>"#,
                    E(&op.kind),
                    E(&op.principal),
                    E(&op.endpoint),
                    E(&op.idem_key),
                    duration(o.now - op.last_attempt_at),
                    if op.rolling_back == 1 { "rolling back" } else { "" }
                );
            }
            b.push_str("</tbody></table>");
            none_if_empty(b, ops.is_empty(), "None.");
        }
    }
    b.push_str("</section>");
}

/// The latest workers.
fn latest_workers(b: &mut String, o: &Overview) {
    b.push_str(r#"<section id="workers"><h2>Latest workers</h2>"#);
    match &o.workers {
        Err(e) => unavailable(b, e),
        Ok(ws) => {
            b.push_str(
                r#"<table><thead><tr><th>Worker</th><th>Principal</th><th>Image</th><th>CPU</th><th>Memory (GB)</th><th>Labels</th><th>Node</th><th>VM</th><th>State</th><th>Age</th></tr></thead><tbody>"#,
            );
            for w in ws {
                let _ = write!(
                    b,
                    r#"<tr data-worker="{}"><td class="mono">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class="mono">{}</td><td>{}</td><td class="mono">{}</td><td>{}</td><td>{}</td></tr>"#,
                    E(w.worker_id.as_str()),
                    E(w.worker_id.as_str()),
                    E(w.principal.as_str()),
                    E(&w.image),
                    w.cpu,
                    w.memory_gb,
                    E(&labels(&w.labels)),
                    E(w.node_id.as_str()),
                    E(&w.vm_id),
                    E(&w.state),
                    duration(o.now - w.created_at)
                );
            }
            b.push_str("</tbody></table>");
            none_if_empty(b, ws.is_empty(), "None.");
        }
    }
    b.push_str("</section>");
}

/// What this process's reaper and inventory sweep did, newest first.
fn reaper_actions(b: &mut String, o: &Overview) {
    let _ = write!(
        b,
        r#"<section id="actions"><h2>What the reaper and the inventory sweep did</h2><p class="hint">This process's latest actions, newest first (kept in memory: at most {}).</p><table><thead><tr><th>When</th><th>What</th><th>On</th></tr></thead><tbody>"#,
        crate::activity::CAPACITY
    );
    for a in &o.actions {
        let _ = write!(
            b,
            r#"<tr><td>{} ({} ago)</td><td>{}</td><td class="mono">{}</td></tr>"#,
            time(a.at),
            duration(o.now - a.at),
            a.kind.as_str(),
            E(&a.detail)
        );
    }
    b.push_str("</tbody></table>");
    none_if_empty(b, o.actions.is_empty(), "Nothing yet.");
    b.push_str("</section>");
}

/// The records operators forgot (the audit).
fn forgotten_records(b: &mut String, o: &Overview) {
    b.push_str(r#"<section id="audit"><h2>Records operators forgot</h2>"#);
    match &o.audit {
        Err(e) => unavailable(b, e),
        Ok(entries) => {
            b.push_str(
                r#"<table><thead><tr><th>When</th><th>Who</th><th>Record</th><th>Principal</th><th>Endpoint</th><th>Key</th><th>State</th></tr></thead><tbody>"#,
            );
            for a in entries {
                let _ = write!(
                    b,
                    r#"<tr><td>{}</td><td>{}</td><td class="mono">{}</td><td>{}</td><td>{}</td><td class="mono">{}</td><td>{}</td></tr>"#,
                    time(a.at),
                    E(&a.actor),
                    E(&a.record_id),
                    E(&a.principal),
                    E(&a.endpoint),
                    E(&a.key),
                    E(&a.state)
                );
            }
            b.push_str("</tbody></table>");
            none_if_empty(b, entries.is_empty(), "None.");
        }
    }
    b.push_str("</section>");
}

/// The records page: the filter form and one page of records.
pub(super) fn records(f: &Filters, listed: Result<RecordPage, String>, now: i64, csrf: &str) -> String {
    let mut b = String::from(
        r#"<h1>Idempotency records</h1><form class="filters" method="get" action="/console/records"><label>State <select name="state">"#,
    );
    for s in std::iter::once("").chain(leasebroker_api::RecordState::KNOWN.iter().copied()) {
        let selected = if f.state == s { " selected" } else { "" };
        let _ = write!(b, r#"<option value="{s}"{selected}>{}</option>"#, if s.is_empty() { "any" } else { s });
    }
    let _ = write!(
        b,
        r#"</select></label><label>Principal <input type="text" name="principal" value="{}"></label><label>Older than <input type="text" name="older_than" placeholder="10m" value="{}"></label><button type="submit">List</button></form>"#,
        E(&f.principal),
        E(&f.older_than)
    );
    match listed {
        Err(e) => unavailable(&mut b, &e),
        Ok(page) => {
            record_rows(&mut b, &page.records, now, csrf);
            if let Some(cursor) = &page.next_cursor {
                let _ = write!(
                    b,
                    r#"<form method="get" action="/console/records"><input type="hidden" name="state" value="{}"><input type="hidden" name="principal" value="{}"><input type="hidden" name="older_than" value="{}">{}<input type="hidden" name="cursor" value="{}"><button type="submit">Next page</button></form>"#,
                    E(&f.state),
                    E(&f.principal),
                    E(&f.older_than),
                    f.limit.map(|n| format!(r#"<input type="hidden" name="limit" value="{n}">"#)).unwrap_or_default(),
                    E(cursor)
                );
            }
        }
    }
    layout("Records", Some(csrf), &b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(duration(42_000_000), "42 s");
        assert_eq!(duration(303_000_000), "5 min 3 s");
        assert_eq!(duration(7_800_000_000), "2 h 10 min");
        assert_eq!(duration(3 * 86_400_000_000 + 4 * 3_600_000_000), "3 d 4 h");
        assert_eq!(duration(-5), "0 s");
    }

    #[test]
    fn escaping_covers_text_and_both_quotes() {
        assert_eq!(
            E(r#"<a href="x" title='y'>&amp;</a>"#).to_string(),
            "&lt;a href=&quot;x&quot; title=&#39;y&#39;&gt;&amp;amp;&lt;/a&gt;"
        );
        assert_eq!(E("plain ünïcode").to_string(), "plain ünïcode");
        assert_eq!(E("\u{202e}gpj.exe <b>\u{1b}[1m").to_string(), "\\u202egpj.exe &lt;b&gt;\\u001b[1m");
    }

    #[test]
    fn labels_read_as_pairs() {
        assert_eq!(labels(r#"{"team":"ml","batch":"n-1"}"#), "batch=n-1, team=ml");
        assert_eq!(labels("not json"), "not json");
    }

    #[test]
    fn the_login_page_and_messages_escape_what_they_show() {
        let html = login(Some("<script>alert(1)</script>"), true);
        assert!(!html.contains("<script>"), "{html}");
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        let html = message("<b>", "\"><script>", Some("\"><x"));
        assert!(!html.contains("<script>") && !html.contains("<b>") && !html.contains("\"><x"), "{html}");
    }
}
