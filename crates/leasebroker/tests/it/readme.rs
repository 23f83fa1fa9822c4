//! Issue 45: the README's worked session is pasted as printed into a shell against the real
//! binary, started with the README's own `serve` flags, and does what the README says: one
//! worker created (and replayed), rebooted once, deleted, and the fleet at the end as shown.

use std::path::Path;
use std::process::Command;

use crate::support::Launch;

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of `## title` up to the next `## `.
fn section<'a>(text: &'a str, title: &str) -> &'a str {
    let start = text.find(&format!("\n## {title}\n")).unwrap_or_else(|| panic!("no section {title:?}"));
    let rest = &text[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 4);
    &rest[..end]
}

/// The fenced blocks of `lang` in `text`, each as its lines.
fn blocks<'a>(text: &'a str, lang: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut current, line.trim_end()) {
            (None, l) if l == format!("```{lang}") => current = Some(Vec::new()),
            (Some(_), "```") => out.extend(current.take()),
            (Some(block), l) => block.push(l),
            (None, _) => {}
        }
    }
    out
}

/// The commands of a console block: each `$ ` line with its `\` continuations. Output lines
/// are left out.
fn commands(block: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = block.iter();
    while let Some(line) = lines.next() {
        let Some(cmd) = line.strip_prefix("$ ") else { continue };
        let mut cmd = cmd.to_owned();
        while cmd.ends_with('\\') {
            cmd.push('\n');
            cmd.push_str(lines.next().expect("a continuation line"));
        }
        out.push(cmd);
    }
    out
}

#[tokio::test]
async fn the_worked_session_runs_as_pasted() {
    let text = readme();
    let session = section(&text, "A worked session");
    // The README's `serve` flags, on a free port and a temporary database.
    let start = blocks(session, "sh").into_iter().flatten().find(|l| l.contains(" serve ")).expect("a serve line");
    let flags: Vec<&str> = start.split(" serve ").nth(1).expect("flags").split_whitespace().collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}", dir.path().join("lb.db").display());
    let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--database", &db];
    args.extend(flags);
    let lb = Launch::new(&args).start();
    let addr = lb.url.trim_start_matches("http://");

    let script: Vec<String> = blocks(session, "console").iter().flat_map(|b| commands(b)).collect();
    assert!(script.len() >= 8, "{script:?}");
    let script = script.join("\n").replace("localhost:8080", addr);
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(dir.path())
        .output()
        .expect("run bash");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the session failed ({}):\n{stdout}\n{stderr}\n---\n{script}", out.status);
    assert!(!stdout.contains(" 404 "), "a command met a 404:\n{stdout}");

    // The fleet the session ends with, as the README prints it.
    let shown = session.lines().rev().find(|l| l.starts_with("{\"nodes_total\"")).expect("the fleet's line");
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).expect("output");
    let (shown, last): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(shown).expect("README JSON"), serde_json::from_str(last).expect("fleet JSON"));
    assert_eq!(last, shown, "the fleet after the session:\n{stdout}");
    assert_eq!(last["reboots_total"], 1, "the reboot happened once");
}
