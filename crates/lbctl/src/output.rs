//! How lbctl prints an answer: `-o table|json|yaml` and `--quiet`.
//!
//! JSON is the server's body exactly as received (what scripts and the existing tests read when
//! stdout is piped); a table is for people (the default on a terminal); YAML is the same document
//! as the JSON. `--quiet` prints only ids, one a line: the worker, record or operation ids of a
//! page, or the one id of a single object. Every string in a table or YAML passes through
//! [`crate::one_line`] first, so server text cannot carry control or bidi-override characters
//! to the terminal.

use std::io::IsTerminal;

use serde_json::Value;

/// `-o`: the output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Columns for people.
    Table,
    /// The server's JSON, unchanged.
    Json,
    /// The same document as YAML.
    Yaml,
}

impl OutputFormat {
    /// `explicit`, else a table when stdout is a terminal and JSON when it is piped.
    pub fn resolve(explicit: Option<OutputFormat>, stdout_is_terminal: bool) -> OutputFormat {
        explicit.unwrap_or(if stdout_is_terminal { OutputFormat::Table } else { OutputFormat::Json })
    }

    /// [`OutputFormat::resolve`] for this process's stdout.
    pub fn for_stdout(explicit: Option<OutputFormat>) -> OutputFormat {
        Self::resolve(explicit, std::io::stdout().is_terminal())
    }
}

/// The columns shown for the items of a page, by the page's list member.
const COLUMNS: [(&str, &[&str]); 2] = [
    ("workers", &["id", "state", "image", "cpu", "memory_gb", "node_id", "labels", "created_at"]),
    ("records", &["id", "state", "principal", "endpoint", "key", "response_status", "started_at", "expires_at"]),
];

/// The list members whose items have ids (`--quiet` prints them).
const LISTS: [&str; 3] = ["workers", "records", "operations"];

/// `body` as the chosen format, or only its ids with `quiet`; `None` when the body is not JSON
/// (printed as it is then).
pub(crate) fn render(body: &[u8], format: OutputFormat, quiet: bool) -> Option<Vec<u8>> {
    if body.is_empty() || (format == OutputFormat::Json && !quiet) {
        return None;
    }
    let value: Value = serde_json::from_slice(body).ok()?;
    let text = if quiet {
        ids(&value).join("\n")
    } else {
        let clean = sanitize(value);
        match format {
            OutputFormat::Table => table(&clean),
            OutputFormat::Yaml => yaml_serde::to_string(&clean).ok()?.trim_end().to_owned(),
            OutputFormat::Json => return None,
        }
    };
    Some(text.into_bytes())
}

/// The ids in a page, or the id of one object.
fn ids(value: &Value) -> Vec<String> {
    let id = |v: &Value| v.get("id").and_then(Value::as_str).map(crate::one_line);
    for list in LISTS {
        if let Some(items) = value.get(list).and_then(Value::as_array) {
            return items.iter().filter_map(id).collect();
        }
    }
    id(value).into_iter().collect()
}

/// Every string run through [`crate::one_line`].
fn sanitize(value: Value) -> Value {
    match value {
        Value::String(s) => Value::String(crate::one_line(&s)),
        Value::Array(items) => Value::Array(items.into_iter().map(sanitize).collect()),
        Value::Object(members) => {
            Value::Object(members.into_iter().map(|(k, v)| (crate::one_line(&k), sanitize(v))).collect())
        }
        other => other,
    }
}

/// A cell: strings as they are, null empty, a map as `k=v,k=v`, anything else as JSON.
fn cell(value: Option<&Value>) -> String {
    match value {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(m)) => m.iter().map(|(k, v)| format!("{k}={}", cell(Some(v)))).collect::<Vec<_>>().join(","),
        Some(other) => other.to_string(),
    }
}

/// A page as rows under a header (then its next cursor), or one object as FIELD VALUE rows.
fn table(value: &Value) -> String {
    for (list, columns) in COLUMNS {
        if let Some(items) = value.get(list).and_then(Value::as_array) {
            let mut rows = vec![columns.iter().map(|c| c.to_uppercase()).collect::<Vec<_>>()];
            rows.extend(items.iter().map(|item| columns.iter().map(|c| cell(item.get(*c))).collect()));
            let mut out = aligned(&rows);
            if let Some(cursor) = value.get("next_cursor").and_then(Value::as_str) {
                out.push_str(&format!("\nnext cursor: {cursor}"));
            }
            return out;
        }
    }
    match value.as_object() {
        Some(members) => {
            let mut rows = vec![vec!["FIELD".to_owned(), "VALUE".to_owned()]];
            rows.extend(members.iter().map(|(k, v)| vec![k.clone(), cell(Some(v))]));
            aligned(&rows)
        }
        None => cell(Some(value)),
    }
}

/// Rows with every column padded to its widest cell, two spaces apart.
fn aligned(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|row| {
            let cells: Vec<String> =
                row.iter().enumerate().map(|(i, c)| format!("{c:<width$}", width = widths[i])).collect();
            cells.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn text(body: &Value, format: OutputFormat, quiet: bool) -> Option<String> {
        render(&serde_json::to_vec(body).unwrap(), format, quiet).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_terminal_gets_a_table_and_a_pipe_json_unless_told() {
        assert_eq!(OutputFormat::resolve(None, true), OutputFormat::Table);
        assert_eq!(OutputFormat::resolve(None, false), OutputFormat::Json);
        assert_eq!(OutputFormat::resolve(Some(OutputFormat::Yaml), true), OutputFormat::Yaml);
        assert_eq!(OutputFormat::resolve(Some(OutputFormat::Table), false), OutputFormat::Table);
    }

    #[test]
    fn json_is_the_body_unchanged() {
        assert_eq!(render(br#"{"id":"wkr-1"}"#, OutputFormat::Json, false), None);
        assert_eq!(render(b"not json", OutputFormat::Table, false), None);
    }

    #[test]
    fn pages_become_aligned_columns_and_quiet_prints_ids() {
        let page = json!({"workers": [
            {"id": "wkr-1", "state": "running", "image": "base", "cpu": 2, "memory_gb": 4, "node_id": "node-0001",
             "labels": {"team": "ml"}, "created_at": "2026-12-02T00:00:00Z"},
            {"id": "wkr-22", "state": "booting", "image": "base:2", "cpu": 16, "memory_gb": 64, "node_id": "node-0002",
             "labels": {}, "created_at": "2026-12-02T00:00:01Z"}],
            "next_cursor": "wkr-22"});
        let table = text(&page, OutputFormat::Table, false).unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "ID      STATE    IMAGE   CPU  MEMORY_GB  NODE_ID    LABELS   CREATED_AT");
        assert_eq!(lines[1], "wkr-1   running  base    2    4          node-0001  team=ml  2026-12-02T00:00:00Z");
        assert_eq!(lines[3], "next cursor: wkr-22");
        assert_eq!(text(&page, OutputFormat::Table, true).unwrap(), "wkr-1\nwkr-22");
        let records =
            json!({"records": [{"id": "ab12", "state": "in_flight", "response_status": null}], "next_cursor": null});
        assert_eq!(text(&records, OutputFormat::Json, true).unwrap(), "ab12");
        assert!(text(&records, OutputFormat::Table, false).unwrap().starts_with("ID    STATE      PRINCIPAL"));
    }

    #[test]
    fn one_object_is_field_value_rows_and_yaml_is_the_same_document() {
        let op = json!({"id": "op-1", "state": "running", "error": null});
        assert_eq!(text(&op, OutputFormat::Table, false).unwrap(), "FIELD  VALUE\nerror\nid     op-1\nstate  running");
        assert_eq!(text(&op, OutputFormat::Json, true).unwrap(), "op-1");
        let yaml = text(&op, OutputFormat::Yaml, false).unwrap();
        assert_eq!(yaml_serde::from_str::<Value>(&yaml).unwrap(), op);
    }

    #[test]
    fn server_text_loses_control_and_bidi_characters() {
        let hostile = json!({"id": "wkr-1\u{1b}[2J", "image": "a\u{202e}b\nc"});
        let table = text(&hostile, OutputFormat::Table, false).unwrap();
        assert!(!table.contains('\u{1b}') && !table.contains('\u{202e}'), "{table:?}");
        let yaml = text(&hostile, OutputFormat::Yaml, false).unwrap();
        assert!(!yaml.contains('\u{1b}') && !yaml.contains('\u{202e}'), "{yaml:?}");
        assert_eq!(text(&hostile, OutputFormat::Json, true).unwrap(), "wkr-1[2J");
    }
}
