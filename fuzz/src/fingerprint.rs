//! The request fingerprint, raw and canonical-JSON.

use arbitrary::Arbitrary;
use idempotency::{Fingerprint, FingerprintMode, Fingerprinter, RequestParts};

/// A JSON document without floats (`1` vs `1.0` are meant to differ, and floats have their own
/// equality troubles), generated structurally so that two spellings of one value can be made.
#[derive(Debug, Clone, Arbitrary)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object; duplicate names are dropped (the first one is kept) before use.
    Object(Vec<(String, Json)>),
}

/// Deeper documents are cut: serde_json refuses nesting past 128, and then the fingerprinter
/// (rightly) falls back to the raw bytes.
const MAX_DEPTH: usize = 24;

impl Json {
    fn value(&self, depth: usize) -> serde_json::Value {
        use serde_json::Value;
        if depth > MAX_DEPTH {
            return Value::Null;
        }
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(i) => Value::from(*i),
            Json::Str(s) => Value::String(s.clone()),
            Json::Array(items) => Value::Array(items.iter().map(|j| j.value(depth + 1)).collect()),
            Json::Object(fields) => {
                let mut map = serde_json::Map::new();
                for (k, v) in fields {
                    if !map.contains_key(k) {
                        map.insert(k.clone(), v.value(depth + 1));
                    }
                }
                Value::Object(map)
            }
        }
    }

    /// The document as JSON text, members in reverse order when `reverse`, with whitespace
    /// between every token when `spaced`.
    fn render(&self, depth: usize, reverse: bool, spaced: bool, out: &mut String) {
        let ws = if spaced { " \n\t" } else { "" };
        if depth > MAX_DEPTH {
            out.push_str("null");
            return;
        }
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => out.push_str(&i.to_string()),
            Json::Str(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(ws);
                        out.push(',');
                    }
                    out.push_str(ws);
                    item.render(depth + 1, reverse, spaced, out);
                }
                out.push_str(ws);
                out.push(']');
            }
            Json::Object(fields) => {
                let mut seen = std::collections::HashSet::new();
                let mut members: Vec<&(String, Json)> = fields.iter().filter(|(k, _)| seen.insert(k)).collect();
                if reverse {
                    members.reverse();
                }
                out.push('{');
                for (i, (k, v)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(ws);
                    out.push_str(&serde_json::to_string(k).unwrap_or_default());
                    out.push_str(ws);
                    out.push(':');
                    out.push_str(ws);
                    v.render(depth + 1, reverse, spaced, out);
                }
                out.push_str(ws);
                out.push('}');
            }
        }
    }

    fn text(&self, reverse: bool, spaced: bool) -> String {
        let mut out = String::new();
        self.render(0, reverse, spaced, &mut out);
        out
    }
}

/// One fuzz input: the request line and headers that enter the fingerprint, raw bytes for a
/// body, and two JSON documents.
#[derive(Debug, Arbitrary)]
pub struct Input {
    method: String,
    path: String,
    query: String,
    content_type: Vec<u8>,
    body: Vec<u8>,
    a: Json,
    b: Json,
}

fn fp(mode: FingerprintMode, input: &Input, body: &[u8]) -> Fingerprint {
    let parts = RequestParts {
        method: &input.method,
        path: &input.path,
        query: &input.query,
        content_type: &input.content_type,
        body,
    };
    Fingerprinter::new(mode).max_body(usize::MAX).fingerprint(&parts).expect("no body limit")
}

/// Never panics on any bytes, in either mode; the same JSON value spelled with other member
/// order and whitespace hashes equal in canonical mode and differently in raw mode; and two
/// different values never hash equal.
pub fn check(input: &Input) {
    for mode in [FingerprintMode::Raw, FingerprintMode::CanonicalJson] {
        let f = fp(mode, input, &input.body);
        assert!(f.as_str().starts_with("sha256:") && f.as_str().len() == 71, "{f:?}");
        assert_eq!(f, fp(mode, input, &input.body), "deterministic");
    }

    let canonical = FingerprintMode::CanonicalJson;
    let a_compact = input.a.text(false, false);
    let a_other = input.a.text(true, true);
    assert_eq!(
        fp(canonical, input, a_compact.as_bytes()),
        fp(canonical, input, a_other.as_bytes()),
        "one value, two spellings:\n{a_compact}\n{a_other}"
    );
    if a_compact != a_other {
        assert_ne!(
            fp(FingerprintMode::Raw, input, a_compact.as_bytes()),
            fp(FingerprintMode::Raw, input, a_other.as_bytes())
        );
    }

    let b_other = input.b.text(true, true);
    let same_value = input.a.value(0) == input.b.value(0);
    let same_fp = fp(canonical, input, a_compact.as_bytes()) == fp(canonical, input, b_other.as_bytes());
    assert_eq!(
        same_value, same_fp,
        "values equal = {same_value}, fingerprints equal = {same_fp}:\n{a_compact}\n{b_other}"
    );
}
