//! A downstream in memory that counts what it is asked to do: the ground truth of the suite.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use crate::effect::{CallError, Effect, Progress, Sent, Tagged};

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// id -> (tag, finished)
    resources: BTreeMap<String, (String, bool)>,
}

/// A downstream that makes one resource per landed call, keyed by the tag it carries.
#[derive(Debug)]
pub struct Downstream {
    name: String,
    long_running: bool,
    inner: Mutex<Inner>,
    sends: AtomicU64,
    undos: AtomicU64,
    polls: AtomicU64,
    lose_undo_answers: AtomicBool,
}

impl Downstream {
    /// A downstream whose effect is named `name`; `long_running`: a send is accepted and the
    /// resource finishes when [`Downstream::complete`] is called.
    pub fn new(name: &str, long_running: bool) -> Self {
        Self {
            name: name.to_owned(),
            long_running,
            inner: Mutex::default(),
            sends: AtomicU64::new(0),
            undos: AtomicU64::new(0),
            polls: AtomicU64::new(0),
            lose_undo_answers: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call with `tag` lands: makes a resource and returns its id.
    pub fn land(&self, tag: &str) -> String {
        let mut s = self.lock();
        s.next += 1;
        let id = format!("res-{:06}", s.next);
        s.resources.insert(id.clone(), (tag.to_owned(), false));
        id
    }

    /// A send that lands after `delay` and answers with its id.
    pub async fn send(&self, tag: String, delay: Duration) -> Result<Sent, CallError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        let id = self.land(&tag);
        Ok(if self.long_running { Sent::Accepted(id) } else { Sent::Done(id) })
    }

    /// A send that lands but whose answer is lost (a timeout after the fact).
    pub fn send_landed_answer_lost(&self, tag: String) -> Result<Sent, CallError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        self.land(&tag);
        Err(CallError::ambiguous("timed out (it landed)"))
    }

    /// A send that never lands and whose answer is lost (the caller cannot tell).
    pub fn send_dropped(&self, _tag: String) -> Result<Sent, CallError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        Err(CallError::ambiguous("timed out (it was dropped)"))
    }

    /// A send the downstream refuses (a 4xx): nothing made.
    pub fn send_refused(&self, _tag: String) -> Result<Sent, CallError> {
        self.sends.fetch_add(1, Ordering::SeqCst);
        Err(CallError::definite("no").with_status(409))
    }

    /// From now on (`true`), an undo removes its resource but its answer is lost (a timeout).
    pub fn lose_undo_answers(&self, lose: bool) {
        self.lose_undo_answers.store(lose, Ordering::SeqCst);
    }

    /// Calls sent, ever.
    pub fn sends(&self) -> u64 {
        self.sends.load(Ordering::SeqCst)
    }

    /// Undos that found their resource.
    pub fn undos(&self) -> u64 {
        self.undos.load(Ordering::SeqCst)
    }

    /// Polls of long-running resources.
    pub fn polls(&self) -> u64 {
        self.polls.load(Ordering::SeqCst)
    }

    /// The resources that exist.
    pub fn count(&self) -> usize {
        self.lock().resources.len()
    }

    /// The ids of the resources carrying `tag`.
    pub fn with_tag(&self, tag: &str) -> Vec<String> {
        self.lock().resources.iter().filter(|(_, (t, _))| t == tag).map(|(id, _)| id.clone()).collect()
    }

    /// A long-running resource finishes.
    pub fn complete(&self, id: &str) {
        if let Some(r) = self.lock().resources.get_mut(id) {
            r.1 = true;
        }
    }
}

#[async_trait]
impl Effect for Downstream {
    fn name(&self) -> &str {
        &self.name
    }

    async fn probe(&self, tag: &str) -> Result<Vec<String>, CallError> {
        Ok(self.with_tag(tag))
    }

    fn can_undo(&self) -> bool {
        !self.long_running
    }

    async fn undo(&self, id: &str) -> Result<bool, CallError> {
        let existed = self.lock().resources.remove(id).is_some();
        if existed {
            self.undos.fetch_add(1, Ordering::SeqCst);
        }
        if self.lose_undo_answers.load(Ordering::SeqCst) {
            return Err(CallError::ambiguous("timed out (the undo landed)"));
        }
        Ok(existed)
    }

    fn can_list(&self) -> bool {
        true
    }

    async fn list(&self, prefix: &str) -> Result<Vec<Tagged>, CallError> {
        Ok(self
            .lock()
            .resources
            .iter()
            .filter(|(_, (t, _))| t.starts_with(prefix))
            .map(|(id, (tag, _))| Tagged { tag: tag.clone(), id: id.clone() })
            .collect())
    }

    fn long_running(&self) -> bool {
        self.long_running
    }

    async fn poll(&self, _tag: &str, id: &str) -> Result<Progress, CallError> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        Ok(match self.lock().resources.get(id) {
            Some((_, true)) => Progress::Done,
            Some((_, false)) => Progress::Running,
            None => Progress::Failed("gone".into()),
        })
    }
}
