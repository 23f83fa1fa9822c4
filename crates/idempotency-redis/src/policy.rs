//! The eviction policy: read on every primary at connect, and again once a call lost its
//! connection or the cluster connection was replaced. The client then talks to its nodes over
//! new connections, maybe to a server restarted with another configuration or to a replica
//! promoted by a failover, so the policy is read again before the next transition is sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotency::StoreError;
use redis::{RedisError, Value};

use crate::conn::{Conn, info_text};
use crate::options::{ConnectError, UnverifiedPolicy};
use crate::reply::is_connection_error;

/// How long a primary may take to answer a check after a lost connection before it counts as
/// not answering (its own calls fail meanwhile; the others are not held up by it).
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a check that found an evicting primary, or one that did not answer, stands before
/// it is made again.
const RECHECK_AFTER: Duration = Duration::from_secs(1);

/// What one primary's `maxmemory-policy` is, as far as it could be read.
enum Verdict {
    Keeps,
    Evicts(String),
    /// `CONFIG GET` and `INFO` both refused (renamed, denied by an ACL), or without the field.
    Unread {
        config: String,
        info: String,
    },
    /// The node did not answer.
    Unanswered {
        config: String,
        info: String,
    },
}

fn of_policy(policy: String) -> Verdict {
    if policy == "noeviction" { Verdict::Keeps } else { Verdict::Evicts(policy) }
}

impl Conn {
    /// Each primary's `maxmemory-policy`: from `CONFIG GET`, and where that is refused from
    /// `INFO memory` (allowed more often: managed services that rename `CONFIG` keep `INFO`);
    /// each node asked within `each` when given. `Err` when no node answers at all.
    async fn eviction_verdicts(&self, each: Option<Duration>) -> Result<Vec<(String, Verdict)>, RedisError> {
        let config = self.on_every_primary(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"), each).await?;
        let mut verdicts = vec![];
        let mut unread = vec![];
        for (node, reply) in config {
            match reply.map(config_policy) {
                Ok(Some(policy)) => verdicts.push((node, of_policy(policy))),
                Ok(None) => unread.push((node, "no maxmemory-policy in the reply".to_owned())),
                Err(e) => unread.push((node, e.to_string())),
            }
        }
        if unread.is_empty() {
            return Ok(verdicts);
        }
        let mut info = self.on_every_primary(redis::cmd("INFO").arg("memory"), each).await?;
        for (node, config) in unread {
            let reply = info.iter().position(|(n, _)| *n == node).map(|i| info.swap_remove(i).1);
            let verdict = match reply {
                Some(Ok(v)) => match info_policy(v) {
                    Some(policy) => {
                        tracing::info!(node, config_error = %config, "CONFIG GET refused; read maxmemory-policy from INFO");
                        of_policy(policy)
                    }
                    None => Verdict::Unread { config, info: "no maxmemory_policy in the reply".to_owned() },
                },
                Some(Err(e)) if is_connection_error(&e) => Verdict::Unanswered { config, info: e.to_string() },
                Some(Err(e)) => Verdict::Unread { config, info: e.to_string() },
                None => Verdict::Unanswered { config, info: "the node did not answer".to_owned() },
            };
            verdicts.push((node, verdict));
        }
        Ok(verdicts)
    }

    /// At connect: reads every primary's `maxmemory-policy` and refuses any policy but
    /// `noeviction` ([`ConnectError::EvictingPolicy`]); where it cannot be read (refused, or the
    /// node does not answer), `unverified` decides.
    pub(crate) async fn check_eviction_policy(&self, unverified: UnverifiedPolicy) -> Result<(), ConnectError> {
        for (node, verdict) in self.eviction_verdicts(None).await.map_err(ConnectError::Unreachable)? {
            match verdict {
                Verdict::Keeps => {}
                Verdict::Evicts(policy) => return Err(ConnectError::EvictingPolicy { node, policy }),
                Verdict::Unread { config, .. } | Verdict::Unanswered { config, .. }
                    if unverified == UnverifiedPolicy::Warn =>
                {
                    tracing::warn!(
                        node,
                        config_error = %config,
                        "cannot read maxmemory-policy (CONFIG GET and INFO refused, or the node is unreachable): \
                         cannot verify that this Redis node never evicts idempotency records"
                    );
                }
                Verdict::Unread { config, info } | Verdict::Unanswered { config, info } => {
                    return Err(ConnectError::UnverifiedPolicy { node, config, info });
                }
            }
        }
        Ok(())
    }
}

/// The policy read again before a transition once a connection was lost (see the module docs).
pub(crate) struct Policy {
    unverified: UnverifiedPolicy,
    /// Set by the connections when a call loses its connection or the cluster connection is
    /// replaced; cleared by a check that every primary answered with `noeviction`.
    lost: Arc<AtomicBool>,
    last: tokio::sync::Mutex<Checked>,
    checking: AtomicBool,
}

struct Checked {
    at: Instant,
    outcome: Outcome,
}

#[derive(Clone)]
enum Outcome {
    /// Every primary answered, none evicts.
    Keeps,
    /// Some primary did not answer; none of those that did evicts.
    Unanswered,
    /// A primary evicts, or its policy cannot be read and the store was told to refuse then.
    Refused(Arc<ConnectError>),
}

impl Policy {
    /// After a connect whose check passed; `lost` is the flag the connections set.
    pub(crate) fn new(unverified: UnverifiedPolicy, lost: Arc<AtomicBool>) -> Self {
        lost.store(false, Ordering::Release);
        let last = Checked { at: Instant::now(), outcome: Outcome::Keeps };
        Self { unverified, lost, last: tokio::sync::Mutex::new(last), checking: AtomicBool::new(false) }
    }

    /// Before a transition: nothing, unless a connection was lost since the policy was last
    /// read; then it is read again on every primary (callers wait for one check), and an
    /// evicting primary fails the transition as unavailable, naming the node and its policy.
    /// While a primary does not answer, transitions go on (its own fail by themselves) and the
    /// check is made again in the background, at most once per [`RECHECK_AFTER`].
    pub(crate) async fn verified(self: &Arc<Self>, conn: &Conn) -> Result<(), StoreError> {
        if !self.lost.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut last = self.last.lock().await;
        let stands = last.at.elapsed() < RECHECK_AFTER;
        match &last.outcome {
            Outcome::Refused(e) if stands => return Err(StoreError::unavailable(e.clone())),
            Outcome::Unanswered => {
                if !stands && !self.checking.swap(true, Ordering::AcqRel) {
                    let (policy, conn) = (self.clone(), conn.clone());
                    tokio::spawn(async move {
                        let checked = policy.check(&conn).await;
                        *policy.last.lock().await = checked;
                        policy.checking.store(false, Ordering::Release);
                    });
                }
                return Ok(());
            }
            Outcome::Refused(_) | Outcome::Keeps => {}
        }
        if !self.lost.load(Ordering::Acquire) {
            return Ok(()); // checked by another caller meanwhile
        }
        *last = self.check(conn).await;
        match &last.outcome {
            Outcome::Refused(e) => Err(StoreError::unavailable(e.clone())),
            Outcome::Keeps | Outcome::Unanswered => Ok(()),
        }
    }

    async fn check(&self, conn: &Conn) -> Checked {
        // Cleared first: a connection lost during the check sets it again.
        self.lost.store(false, Ordering::Release);
        let Ok(verdicts) = conn.eviction_verdicts(Some(CHECK_TIMEOUT)).await else {
            self.lost.store(true, Ordering::Release);
            return Checked { at: Instant::now(), outcome: Outcome::Unanswered };
        };
        let mut outcome = Outcome::Keeps;
        for (node, verdict) in verdicts {
            let refusal = match verdict {
                Verdict::Keeps => continue,
                Verdict::Evicts(policy) => ConnectError::EvictingPolicy { node, policy },
                Verdict::Unread { config, info } if self.unverified == UnverifiedPolicy::Refuse => {
                    ConnectError::UnverifiedPolicy { node, config, info }
                }
                Verdict::Unread { .. } => continue,
                Verdict::Unanswered { .. } => {
                    outcome = Outcome::Unanswered;
                    continue;
                }
            };
            tracing::error!(error = %refusal, "a Redis node evicts keys, or its policy cannot be read: transitions are refused");
            outcome = Outcome::Refused(Arc::new(refusal));
            break;
        }
        if !matches!(outcome, Outcome::Keeps) {
            self.lost.store(true, Ordering::Release);
        }
        Checked { at: Instant::now(), outcome }
    }
}

fn config_policy(v: Value) -> Option<String> {
    let items = match v {
        Value::Array(items) => items,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => return None,
    };
    match items.as_slice() {
        [_, Value::BulkString(p)] => Some(String::from_utf8_lossy(p).into_owned()),
        _ => None,
    }
}

fn info_policy(v: Value) -> Option<String> {
    let text = info_text(v)?;
    text.lines().find_map(|l| l.trim().strip_prefix("maxmemory_policy:").map(|p| p.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_read_from_config_and_info_replies() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(
            config_policy(Value::Array(vec![bulk("maxmemory-policy"), bulk("noeviction")])).as_deref(),
            Some("noeviction")
        );
        assert_eq!(config_policy(Value::Array(vec![])), None);
        let info = bulk("# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\n");
        assert_eq!(info_policy(info).as_deref(), Some("allkeys-lru"));
        assert!(matches!(of_policy("noeviction".into()), Verdict::Keeps));
        assert!(matches!(of_policy("volatile-lfu".into()), Verdict::Evicts(p) if p == "volatile-lfu"));
    }
}
