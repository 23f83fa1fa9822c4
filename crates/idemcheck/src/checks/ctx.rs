//! What a check runs with (the target, the profile, the vector, the exchanges so far) and the
//! steps checks share: a fresh key, a send, the first answer, a replay or a problem expected, the
//! execution counter.

use serde_json::Value;

use crate::client::{Answer, Exchange, Target};
use crate::profile::{Profile, Req};
use crate::vectors::Vector;

use super::{Step, fail, na};

pub(crate) struct Ctx<'a> {
    pub(crate) target: &'a Target,
    pub(crate) profile: &'a Profile,
    pub(crate) vector: &'a Vector,
    pub(crate) log: Vec<Exchange>,
}

impl Ctx<'_> {
    /// A key no earlier run used.
    pub(super) fn key(&self) -> String {
        let id: String = self.vector.id.chars().take(40).collect();
        format!("idemcheck-{id}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
    }

    pub(super) fn primary(&self) -> Step<Req> {
        self.profile.primary.clone().ok_or_else(|| na("no route to test: give --route 'POST /path' --body JSON"))
    }

    pub(super) async fn send(&mut self, req: &Req, key: Option<&str>) -> Step<Answer> {
        self.send_with(req, key.map(str::as_bytes), &[]).await
    }

    pub(super) async fn send_with(&mut self, req: &Req, key: Option<&[u8]>, extra: &[(&str, &[u8])]) -> Step<Answer> {
        if !self.target.has_token(req.token) {
            return Err(na(format!("needs a token number {} (--token, repeated)", req.token + 1)));
        }
        let mut log = std::mem::take(&mut self.log);
        let r = self.target.send(req, key, extra, &mut log).await;
        self.log = log;
        r.map_err(fail)
    }

    /// The route's first answer must be a success for the check to mean anything.
    pub(super) async fn first(&mut self, req: &Req, key: &str) -> Step<Answer> {
        let a = self.send(req, Some(key)).await?;
        if !a.is_success() {
            return Err(fail(format!("{} with a new key answered {}, not 2xx", req.describe(), a.summary())));
        }
        Ok(a)
    }

    /// Whether `again` is a replay of `first`: the profile's replay header when it has one,
    /// else the same status and body.
    pub(super) fn is_replay(&self, first: &Answer, again: &Answer) -> bool {
        let same = first.status == again.status && first.body == again.body;
        match self.profile.replay_header {
            Some((name, value)) => same && again.header(name) == Some(value),
            None => same,
        }
    }

    /// Whether `again` looks like `first` answered again: the profile's replay header, or the
    /// same status and body even without it (the route's answers differ between executions:
    /// each carries what it created). For the checks where a replay is the failure, so that a
    /// target that replays without the header is not taken for one that ran the request.
    pub(super) fn looks_replayed(&self, first: &Answer, again: &Answer) -> bool {
        let marked = self.profile.replay_header.is_some_and(|(name, value)| again.header(name) == Some(value));
        marked || (first.status == again.status && first.body == again.body)
    }

    pub(super) fn expect_replay(&self, first: &Answer, again: &Answer, what: &str) -> Step<()> {
        if self.is_replay(first, again) {
            return Ok(());
        }
        let header = match self.profile.replay_header {
            Some((n, v)) => format!(" with {n}: {v}"),
            None => String::new(),
        };
        Err(fail(format!("{what}: expected a replay of {}{header}, got {}", first.summary(), again.summary())))
    }

    pub(super) fn expect_problem(&self, a: &Answer, status: u16, name: &str) -> Step<()> {
        if a.status != status {
            return Err(fail(format!("expected {status} ({name}), got {}", a.summary())));
        }
        if self.profile.problem_types && a.problem_type().as_deref() != Some(name) {
            return Err(fail(format!("expected a problem of type .../{name}, got {}", a.summary())));
        }
        Ok(())
    }

    pub(super) async fn count(&mut self) -> Step<Option<i64>> {
        let Some(counter) = self.profile.counter.clone() else { return Ok(None) };
        let mut total = 0i64;
        let mut path = counter.path.clone();
        for _ in 0..10_000 {
            let mut log = std::mem::take(&mut self.log);
            let got = self.target.get(&path, &mut log).await;
            self.log = log;
            let a = got.map_err(fail)?;
            if a.status != 200 {
                return Err(fail(format!("the counter {} answered {}", counter.describe, a.summary())));
            }
            let v = a.json();
            match v.pointer(&counter.pointer) {
                Some(Value::Array(items)) => total += items.len() as i64,
                Some(Value::Number(n)) => total += n.as_i64().unwrap_or_default(),
                _ => return Err(fail(format!("the counter has no {} in {}", counter.pointer, a.summary()))),
            }
            let next = counter
                .next
                .as_ref()
                .and_then(|(ptr, param)| v.pointer(ptr).and_then(Value::as_str).map(|c| (param.clone(), c.to_owned())));
            match next {
                Some((param, cursor)) => {
                    let sep = if counter.path.contains('?') { '&' } else { '?' };
                    path = format!("{}{sep}{param}={cursor}", counter.path);
                }
                None => return Ok(Some(total)),
            }
        }
        Err(fail("the counter's pages never ended"))
    }
}
