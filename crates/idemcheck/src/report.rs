//! The report of a run: markdown or JSON, by the file's extension.

use std::path::Path;

use serde::Serialize;

use crate::checks::Verdict;
use crate::client::Exchange;

#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) target: String,
    pub(crate) profile: String,
    pub(crate) date: String,
    pub(crate) passed: usize,
    pub(crate) failed: usize,
    pub(crate) not_applicable: usize,
    pub(crate) vectors: Vec<Outcome>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Outcome {
    pub(crate) id: String,
    pub(crate) rule: String,
    pub(crate) source: String,
    /// `pass`, `fail` or `n/a`.
    pub(crate) result: &'static str,
    /// Why it failed, or why it does not apply.
    pub(crate) reason: Option<String>,
    /// A failure's requests and responses (the last ten).
    pub(crate) exchanges: Vec<Exchange>,
}

impl Outcome {
    pub(crate) fn new(v: &crate::vectors::Vector, verdict: Verdict, log: Vec<Exchange>) -> Self {
        let (result, reason) = match verdict {
            Verdict::Pass => ("pass", None),
            Verdict::Fail(r) => ("fail", Some(r)),
            Verdict::NotApplicable(r) => ("n/a", Some(r)),
        };
        let exchanges = if result == "fail" {
            let skip = log.len().saturating_sub(10);
            log.into_iter().skip(skip).collect()
        } else {
            Vec::new()
        };
        Self { id: v.id.clone(), rule: v.rule.clone(), source: v.source.clone(), result, reason, exchanges }
    }

    /// The line a run prints.
    pub(crate) fn line(&self) -> String {
        let tag = match self.result {
            "pass" => "PASS",
            "fail" => "FAIL",
            _ => "N/A ",
        };
        match &self.reason {
            Some(r) => format!("{tag} {:<34} {r}", self.id),
            None => format!("{tag} {:<34} {}", self.id, self.rule),
        }
    }
}

impl Report {
    pub(crate) fn summary(&self) -> String {
        format!("{} passed, {} failed, {} n/a", self.passed, self.failed, self.not_applicable)
    }

    pub(crate) fn write(&self, path: &Path) -> Result<(), String> {
        let text = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::to_string_pretty(self).map_err(|e| e.to_string())?,
            Some("md") => self.markdown(),
            _ => return Err(format!("--report {}: name a .md or .json file", path.display())),
        };
        std::fs::write(path, text).map_err(|e| format!("--report {}: {e}", path.display()))
    }

    fn markdown(&self) -> String {
        let mut md = String::new();
        md.push_str("# idemcheck report\n\n");
        md.push_str(&format!(
            "- Target: `{}`\n- Profile: `{}`\n- Date: {}\n- Result: {}\n\n",
            self.target,
            self.profile,
            self.date,
            self.summary()
        ));
        md.push_str("| Vector | Result | Rule | Source | Reason |\n|---|---|---|---|---|\n");
        for o in &self.vectors {
            md.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                o.id,
                o.result,
                cell(&o.rule),
                cell(&o.source),
                cell(o.reason.as_deref().unwrap_or(""))
            ));
        }
        let failures: Vec<&Outcome> = self.vectors.iter().filter(|o| o.result == "fail").collect();
        if !failures.is_empty() {
            md.push_str("\n## Failures\n");
        }
        for o in failures {
            md.push_str(&format!("\n### `{}`\n\n{}\n\n", o.id, o.reason.as_deref().unwrap_or("")));
            for x in &o.exchanges {
                md.push_str("```http\n");
                md.push_str(&format!("{}\n", x.request));
                for (n, v) in &x.request_headers {
                    md.push_str(&format!("{n}: {v}\n"));
                }
                if !x.request_body.is_empty() {
                    md.push_str(&format!("\n{}\n", x.request_body));
                }
                md.push_str(&format!("\n-> {}\n", x.status));
                for (n, v) in &x.headers {
                    md.push_str(&format!("{n}: {v}\n"));
                }
                if !x.body.is_empty() {
                    md.push_str(&format!("\n{}\n", x.body));
                }
                md.push_str("```\n");
            }
        }
        md
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}
