//! What a service supplies about a downstream side effect.

use std::fmt;

use async_trait::async_trait;

/// A resource found downstream, carrying one of this service's tags.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tagged {
    /// The tag stamped into the call that made it (a derived sub-key, `sk-...`).
    pub tag: String,
    /// The downstream's id of the resource.
    pub id: String,
}

/// How far a long-running effect has come, as [`Effect::poll`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Still running: look again later.
    Running,
    /// Finished well.
    Done,
    /// Finished badly; the reason is kept in the log.
    Failed(String),
}

/// A downstream call that did not succeed, classified by what the caller may conclude.
///
/// - [`CallError::definite`]: the downstream certainly did nothing (it answered "no": a 4xx;
///   or the call never left: connection refused). The intent is released (marked failed) and a
///   retry may call again at once.
/// - [`CallError::ambiguous`]: it may have happened (a timeout, a reset, a 5xx). The intent
///   stays pending, and no retry calls again before it has probed by tag and the settle window
///   has passed since the last send.
#[derive(Debug)]
pub struct CallError {
    definite: bool,
    status: Option<u16>,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl CallError {
    /// The downstream certainly did nothing.
    pub fn definite(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self { definite: true, status: None, source: e.into() }
    }

    /// The call may have taken effect.
    pub fn ambiguous(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self { definite: false, status: None, source: e.into() }
    }

    /// Records the downstream's HTTP status, if it answered one.
    pub fn with_status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }

    /// True when the downstream certainly did nothing.
    pub fn is_definite(&self) -> bool {
        self.definite
    }

    /// The downstream's HTTP status, if recorded.
    pub fn status(&self) -> Option<u16> {
        self.status
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.definite { "refused" } else { "may have happened" };
        match self.status {
            Some(s) => write!(f, "downstream call {kind} (status {s}): {}", self.source),
            None => write!(f, "downstream call {kind}: {}", self.source),
        }
    }
}

impl std::error::Error for CallError {}

/// Why a resource was undone, as [`Effect::undone`] is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undone {
    /// A second resource with one tag (a call that landed after the settle window); `kept` is
    /// the one the operation adopted.
    Duplicate {
        /// The resource kept.
        kept: String,
    },
    /// Nothing owned it (the inventory sweep): a call that landed after its operation ended.
    Orphan,
    /// Its operation was abandoned and rolled back.
    RolledBack,
}

/// What a successful send returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// The effect happened; the downstream's id of what it made (or acted on).
    Done(String),
    /// A long-running effect was accepted (say, `202`) and finishes later; its id. A
    /// [`crate::Watcher`] polls it to the end.
    Accepted(String),
}

/// A downstream side effect, described by what only the service knows. The `send` itself is
/// given to [`crate::Attempt::run`] with each request (it carries the request's data); what is
/// here is what a retry, the reaper and the inventory sweep need without the request.
///
/// Everything is keyed by the *tag*: the derived sub-key the send stamps into the downstream
/// call (a VM's tag, a DNS record's comment, a job's name), which the downstream must echo back.
#[async_trait]
pub trait Effect: Send + Sync + fmt::Debug {
    /// The effect's name, the label its sub-key is derived with (`"boot"`, `"dns-record"`).
    /// Never change it for an effect in use: retries would stop finding their intents.
    fn name(&self) -> &str;

    /// What exists downstream carrying `tag`: the ids of the resources a call with this tag
    /// made. Empty when nothing exists (yet). An error means "cannot tell": the attempt answers
    /// 503 and guesses nothing.
    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError>;

    /// Whether [`Effect::undo`] is supported.
    fn can_undo(&self) -> bool {
        false
    }

    /// Undoes the resource `id` (compensation): deletes a VM, a record. `Ok(true)` when it was
    /// there, `Ok(false)` when it was gone already. Used by the reaper (rollback), the inventory
    /// sweep (orphans) and a retry that finds two resources with one tag (a late landing).
    async fn undo(&self, id: &str) -> Result<bool, CallError> {
        let _ = id;
        Err(CallError::definite(format!("the effect {:?} cannot be undone", self.name())))
    }

    /// Whether [`Effect::list`] is supported, so the inventory sweep covers this effect.
    fn can_list(&self) -> bool {
        false
    }

    /// Everything downstream whose tag starts with `prefix` (this service's tags), for the
    /// inventory sweep.
    async fn list(&self, prefix: &str) -> Result<Vec<Tagged>, CallError> {
        let _ = prefix;
        Ok(Vec::new())
    }

    /// Whether the call is idempotent downstream by itself (a delete by id, a "set to" call):
    /// sending it twice does no harm. Then a retry that finds the call pending and nothing by
    /// tag sends again at once instead of waiting out the settle window. Default: false.
    fn idempotent(&self) -> bool {
        false
    }

    /// Told after the library undid `id` (tagged `tag`) and found it there, so a service can
    /// count and log it (a metric, an audit line). Does nothing by default.
    fn undone(&self, tag: &str, id: &str, why: &Undone) {
        let _ = (tag, id, why);
    }

    /// Whether the resource outlives its operation (a create: yes; a reboot: no). A finished
    /// operation keeps ownership of the resource of each such effect, so the inventory sweep
    /// leaves it alone until the service calls [`crate::Ledger::disown`].
    fn keeps(&self) -> bool {
        true
    }

    /// Whether the effect is long-running: a send returns [`Sent::Accepted`], a probe that
    /// finds it means "accepted", and a [`crate::Watcher`] polls it to the end.
    fn long_running(&self) -> bool {
        false
    }

    /// For a long-running effect: how far the resource `id` tagged `tag` has come.
    async fn poll(&self, tag: &str, id: &str) -> Result<Progress, CallError> {
        let _ = (tag, id);
        Ok(Progress::Done)
    }
}
