//! Operations through the SDK in process: protected (one key, retried), naive (a fresh key per
//! attempt) and abandoning (one attempt, then walk away).

use std::collections::BTreeMap;
use std::time::Duration;

use leasebroker_client::retry::{Retrier, RetryPolicy};
use leasebroker_client::{CreateWorker, Error, OpKey};
use rand::Rng;
use reqwest::RequestBuilder;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use tokio::time::Instant;

use super::*;

impl Workload {
    /// A client that walks away: one attempt (protected or naive alike: a key used once), cut
    /// short at a random point, and no retry whatever happened. A success or a clean refusal
    /// that arrives in time counts as such.
    pub(super) async fn abandoning(&self, op: &Op) -> Outcome {
        let body = Self::body(op);
        let key = OpKey::new_v4();
        let hang_up = Duration::from_millis(rand::rng().random_range(ABANDON_WINDOW_MS));
        let once = Retrier::new(self.policy.with_max_attempts(1).with_attempt_timeout(hang_up));
        add(&self.counters.attempts, 1);
        match once.send(Some(&key), || self.request(op, &body, self.pick())).await {
            Ok(response) => {
                self.acknowledged(op, key.as_str());
                decode(op, &response.body)
            }
            Err(e @ Error::Refused { .. }) => classify(&e),
            Err(_) => Outcome::Abandoned,
        }
    }

    /// A replica picked at random (the index of its proxy).
    pub(super) fn pick(&self) -> usize {
        rand::rng().random_range(0..self.config.endpoints.len())
    }

    /// A retrier with `policy` whose attempts are counted and noted in `log`.
    pub(super) fn traced(&self, policy: RetryPolicy, log: &OpLog) -> Retrier {
        let (counters, timeline, log) = (self.counters.clone(), self.timeline.clone(), log.clone());
        Retrier::new(policy).on_attempt(move |attempt| {
            add(&counters.attempts, 1);
            log.ended(attempt, &timeline);
        })
    }

    /// One attempt's request to `replica`, noted in `log`.
    pub(super) fn noted_request(&self, op: &Op, body: &[u8], log: &OpLog) -> RequestBuilder {
        let replica = self.pick();
        log.sending(replica, &self.timeline);
        self.request(op, body, replica)
    }

    /// One attempt's request to `replica`.
    pub(super) fn request(&self, op: &Op, body: &[u8], replica: usize) -> RequestBuilder {
        let base = &self.config.endpoints[replica];
        let (request, principal) = match op {
            Op::Create { principal, .. } => (
                self.http
                    .post(format!("{base}/v1/workers"))
                    .header(CONTENT_TYPE, "application/json")
                    .body(body.to_vec()),
                *principal,
            ),
            Op::Reboot { principal, id } => (self.http.post(format!("{base}/v1/workers/{id}/reboot")), *principal),
            Op::Delete { principal, id } => (self.http.delete(format!("{base}/v1/workers/{id}")), *principal),
            Op::Flash { node, .. } => {
                let request = self
                    .http
                    .post(format!("{base}/admin/v1/nodes/{node}/firmware"))
                    .header(CONTENT_TYPE, "application/json")
                    .body(body.to_vec());
                return request.bearer_auth(crate::cluster::ADMIN_TOKEN).header(ACCEPT, "application/json");
            }
        };
        request.bearer_auth(&self.config.principals[principal].token).header(ACCEPT, "application/json")
    }

    pub(super) async fn via_sdk(&self, op: &Op, log: &mut OpLog) -> Outcome {
        let body = Self::body(op);
        let result = match self.config.kind {
            ClientKind::Protected => {
                // One key for the logical operation, made before the first attempt.
                let key = OpKey::new_v4();
                log.key = Some(key.to_string());
                let retrier = self.traced(self.policy, log);
                retrier.send(Some(&key), || self.noted_request(op, &body, log)).await.map(|r| (r, key))
            }
            ClientKind::Naive => self.naive_send(op, &body, log).await,
        };
        match result {
            Ok((response, key)) => {
                self.acknowledged(op, key.as_str());
                if response.replayed {
                    add(&self.counters.replayed, 1);
                }
                decode(op, &response.body)
            }
            Err(e) => classify(&e),
        }
    }

    /// The antipattern: the same backoff, but a new key on every attempt. Returns the answer and
    /// the key of the attempt that got it.
    pub(super) async fn naive_send(
        &self,
        op: &Op,
        body: &[u8],
        log: &OpLog,
    ) -> Result<(leasebroker_client::retry::HttpResponse, OpKey), Error> {
        let start = Instant::now();
        let mut cap = self.policy.min_delay;
        let single = self.traced(self.policy.with_max_attempts(1), log);
        loop {
            let key = OpKey::new_v4();
            match single.send(Some(&key), || self.noted_request(op, body, log)).await {
                Err(Error::GaveUp { last, attempts, .. }) => {
                    let jitter = Duration::from_millis(rand::rng().random_range(0..=cap.as_millis() as u64));
                    let wait = last.retry_after().map_or(jitter, |asked| asked.max(jitter));
                    if start.elapsed() + wait >= self.policy.max_elapsed {
                        return Err(Error::GaveUp { attempts, elapsed: start.elapsed(), last });
                    }
                    tokio::time::sleep(wait).await;
                    cap = (cap * 2).min(self.policy.max_delay);
                }
                other => return other.map(|response| (response, key)),
            }
        }
    }

    pub(super) fn create_body(index: u64) -> CreateWorker {
        let mut request = CreateWorker::new("worker-base:2025.11", 2, 4);
        request.labels = Some(BTreeMap::from([(OP_LABEL.to_owned(), index.to_string())]));
        request
    }

    pub(super) fn body(op: &Op) -> Vec<u8> {
        match op {
            Op::Create { index, .. } => serde_json::to_vec(&Self::create_body(*index)).unwrap_or_default(),
            Op::Flash { version, .. } => {
                // Forced: the harness flashes nodes whether a worker holds them or not, so that
                // flashes meet running ones (the 409 node-in-use guard is not what it tests).
                serde_json::to_vec(&serde_json::json!({ "version": version, "force": true })).unwrap_or_default()
            }
            _ => Vec::new(),
        }
    }
}

pub(super) fn decode(op: &Op, body: &[u8]) -> Outcome {
    let bad = |e: serde_json::Error| Outcome::Failed(format!("unexpected success body: {e}"));
    match op {
        Op::Create { .. } => serde_json::from_slice(body).map_or_else(bad, Outcome::Created),
        Op::Reboot { .. } => serde_json::from_slice(body).map_or_else(bad, Outcome::Rebooted),
        Op::Delete { .. } => Outcome::Deleted,
        Op::Flash { .. } => serde_json::from_slice(body).map_or_else(bad, Outcome::Flashed),
    }
}

pub(super) fn classify(err: &Error) -> Outcome {
    match err {
        Error::Refused { .. } => Outcome::Refused(err.to_string()),
        _ => Outcome::Failed(err.to_string()),
    }
}
