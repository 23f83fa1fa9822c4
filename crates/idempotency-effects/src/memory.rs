//! The in-memory ledger: one process, for tests. Every method holds one lock for its whole
//! transaction.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use crate::ledger::{Decided, Intent, IntentState, Ledger, LedgerError, Mark, NewIntent, OperationRow, Ownership};
use crate::{micros, now_micros};

#[derive(Debug, Default)]
struct State {
    ops: HashMap<String, (OperationRow, i64)>,
    intents: BTreeMap<String, Intent>,
    /// What finished operations keep: tag -> resource id.
    owned: HashMap<String, String>,
    /// Tags this ledger issued whose intents are gone: tag -> when.
    spent: HashMap<String, i64>,
}

impl State {
    /// Remembers the tags of `op_id`'s intents as issued here, then deletes those `keep` does
    /// not keep (as the SQL ledger's `SPEND_INTENTS`).
    fn spend(&mut self, op_id: &str, now: i64, keep: impl Fn(&Intent) -> bool) {
        for i in self.intents.values().filter(|i| i.op_id == op_id) {
            self.spent.entry(i.intent_id.clone()).or_insert(now);
        }
        self.intents.retain(|_, i| i.op_id != op_id || keep(i));
    }

    /// The fence: the operation must be there and live.
    fn guard(&self, op_id: &str) -> Result<(), LedgerError> {
        match self.ops.get(op_id).map(|(op, _)| op.mark) {
            Some(Mark::Live) => Ok(()),
            mark => Err(LedgerError::refused_by(mark)),
        }
    }
}

/// An in-memory [`Ledger`].
#[derive(Debug, Default)]
pub struct MemoryLedger {
    state: Mutex<State>,
}

impl MemoryLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn stamp(seen: i64, ahead: Duration) -> i64 {
    now_micros().saturating_add(micros(ahead)).max(seen + 1)
}

#[async_trait]
impl Ledger for MemoryLedger {
    async fn decide(&self, op: &OperationRow, new: &NewIntent, ahead: Duration) -> Result<Decided, LedgerError> {
        let mut s = self.lock();
        match s.ops.get_mut(&op.op_id) {
            Some((row, _)) if row.mark == Mark::Live => {
                row.last_attempt_at = op.last_attempt_at;
                row.next_check_at = op.next_check_at;
            }
            Some((row, _)) => return Err(LedgerError::refused_by(Some(row.mark))),
            None => {
                let mut row = op.clone();
                row.mark = Mark::Live;
                s.ops.insert(op.op_id.clone(), (row, 0));
            }
        }
        if let Some(intent) = s.intents.get(&new.intent_id) {
            return Ok(Decided::Existing(intent.clone()));
        }
        let intent = Intent {
            intent_id: new.intent_id.clone(),
            op_id: op.op_id.clone(),
            effect: new.effect.clone(),
            keeps: new.keeps,
            state: IntentState::Pending,
            resource_id: None,
            created_at: op.last_attempt_at,
            sent_at: stamp(0, ahead),
            watcher: None,
            watch_until: 0,
        };
        s.intents.insert(intent.intent_id.clone(), intent.clone());
        Ok(Decided::Fresh(intent))
    }

    async fn stamp(
        &self,
        op_id: &str,
        intent_id: &str,
        seen: i64,
        ahead: Duration,
    ) -> Result<Option<i64>, LedgerError> {
        let mut s = self.lock();
        s.guard(op_id)?;
        let Some(i) = s.intents.get_mut(intent_id) else { return Ok(None) };
        if !matches!(i.state, IntentState::Pending | IntentState::Failed) || i.sent_at != seen {
            return Ok(None);
        }
        let at = stamp(seen, ahead);
        i.state = IntentState::Pending;
        i.sent_at = at;
        Ok(Some(at))
    }

    async fn adopt(&self, op_id: &str, intent_id: &str, candidate: &str) -> Result<String, LedgerError> {
        let mut s = self.lock();
        s.guard(op_id)?;
        let Some(i) = s.intents.get_mut(intent_id) else { return Ok(candidate.to_owned()) };
        Ok(i.resource_id.get_or_insert_with(|| candidate.to_owned()).clone())
    }

    async fn record(
        &self,
        op_id: &str,
        intent_id: &str,
        resource_id: &str,
        state: IntentState,
    ) -> Result<String, LedgerError> {
        let mut s = self.lock();
        let Some(i) = s.intents.get_mut(intent_id) else {
            return Err(LedgerError::refused_by(s.ops.get(op_id).map(|(o, _)| o.mark)));
        };
        if i.state == IntentState::Pending {
            i.state = state;
        }
        let recorded = i.resource_id.get_or_insert_with(|| resource_id.to_owned()).clone();
        s.guard(op_id)?;
        Ok(recorded)
    }

    async fn release(&self, intent_id: &str, sent_at: i64) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        Ok(match s.intents.get_mut(intent_id) {
            Some(i) if i.state == IntentState::Pending && i.sent_at == sent_at => {
                i.state = IntentState::Failed;
                true
            }
            _ => false,
        })
    }

    async fn finish(&self, op_id: &str, now: i64) -> Result<(), LedgerError> {
        let mut s = self.lock();
        s.guard(op_id)?;
        let (row, marked_at) = s.ops.get_mut(op_id).expect("guarded");
        row.mark = Mark::Finished;
        row.next_check_at = now;
        *marked_at = now;
        let kept: Vec<(String, String)> = s
            .intents
            .values()
            .filter(|i| i.op_id == op_id && i.keeps && i.state == IntentState::Done)
            .filter_map(|i| Some((i.intent_id.clone(), i.resource_id.clone()?)))
            .collect();
        for (tag, id) in kept {
            s.owned.entry(tag).or_insert(id);
        }
        s.spend(op_id, now, |i| i.state == IntentState::Accepted);
        Ok(())
    }

    async fn operation(&self, op_id: &str) -> Result<Option<OperationRow>, LedgerError> {
        Ok(self.lock().ops.get(op_id).map(|(o, _)| o.clone()))
    }

    async fn intent(&self, intent_id: &str) -> Result<Option<Intent>, LedgerError> {
        Ok(self.lock().intents.get(intent_id).cloned())
    }

    async fn intents(&self, op_id: &str) -> Result<Vec<Intent>, LedgerError> {
        Ok(self.lock().intents.values().filter(|i| i.op_id == op_id).cloned().collect())
    }

    async fn due(&self, now: i64, limit: u32) -> Result<Vec<OperationRow>, LedgerError> {
        let s = self.lock();
        let mut due: Vec<&OperationRow> = s
            .ops
            .values()
            .map(|(o, _)| o)
            .filter(|o| matches!(o.mark, Mark::Live | Mark::RollingBack) && o.next_check_at <= now)
            .collect();
        due.sort_by(|a, b| (a.next_check_at, &a.op_id).cmp(&(b.next_check_at, &b.op_id)));
        let half = limit.div_ceil(2) as usize;
        let mut rows: Vec<OperationRow> = due.iter().take(half).map(|o| (*o).clone()).collect();
        rows.extend(due.iter().rev().take(half).map(|o| (*o).clone()));
        rows.sort_by(|a, b| a.op_id.cmp(&b.op_id));
        rows.dedup_by(|a, b| a.op_id == b.op_id);
        Ok(rows)
    }

    async fn put_off(&self, op_id: &str, at: i64) -> Result<(), LedgerError> {
        if let Some((o, _)) = self.lock().ops.get_mut(op_id) {
            o.next_check_at = at;
        }
        Ok(())
    }

    async fn take_for_rollback(&self, op_id: &str, seen_last_attempt: i64) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        Ok(match s.ops.get_mut(op_id) {
            Some((o, _)) if o.mark == Mark::Live && o.last_attempt_at == seen_last_attempt => {
                o.mark = Mark::RollingBack;
                true
            }
            _ => false,
        })
    }

    async fn take_unbegun(&self, op: &OperationRow) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        if s.ops.contains_key(&op.op_id) {
            return Ok(false);
        }
        s.ops.insert(op.op_id.clone(), (OperationRow { mark: Mark::RollingBack, ..op.clone() }, 0));
        Ok(true)
    }

    async fn rolled_back(&self, op_id: &str, now: i64) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        let done = match s.ops.get_mut(op_id) {
            Some((o, marked_at)) if o.mark == Mark::RollingBack => {
                o.mark = Mark::RolledBack;
                *marked_at = now;
                true
            }
            _ => false,
        };
        if done {
            s.spend(op_id, now, |_| false);
        }
        Ok(done)
    }

    async fn prune(&self, before: i64) -> Result<u64, LedgerError> {
        let mut s = self.lock();
        let watched: Vec<String> =
            s.intents.values().filter(|i| i.state == IntentState::Accepted).map(|i| i.op_id.clone()).collect();
        let gone: Vec<String> = s
            .ops
            .iter()
            .filter(|(id, (o, at))| {
                matches!(o.mark, Mark::RolledBack | Mark::Finished) && *at < before && !watched.contains(id)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            s.ops.remove(id);
        }
        let before_len = s.intents.len();
        s.intents.retain(|_, i| !gone.contains(&i.op_id));
        s.spent.retain(|_, at| *at >= before);
        Ok((gone.len() + before_len - s.intents.len()) as u64)
    }

    async fn ownership(&self, tag: &str, resource_id: &str, settled_before: i64) -> Result<Ownership, LedgerError> {
        let s = self.lock();
        if s.owned.get(tag).is_some_and(|id| id == resource_id) {
            return Ok(Ownership::Owned);
        }
        if let Some(i) = s.intents.get(tag) {
            let mark = s.ops.get(&i.op_id).map(|(o, _)| o.mark);
            let owned = matches!(mark, Some(Mark::Live | Mark::RollingBack))
                || i.state == IntentState::Accepted
                || i.sent_at > settled_before;
            return Ok(if owned { Ownership::Owned } else { Ownership::Unowned });
        }
        Ok(if s.owned.contains_key(tag) || s.spent.contains_key(tag) { Ownership::Unowned } else { Ownership::Foreign })
    }

    async fn disown(&self, resource_id: &str) -> Result<u64, LedgerError> {
        let mut s = self.lock();
        let tags: Vec<String> = s.owned.iter().filter(|(_, id)| *id == resource_id).map(|(t, _)| t.clone()).collect();
        let now = now_micros();
        for tag in &tags {
            s.owned.remove(tag);
            s.spent.insert(tag.clone(), now);
        }
        Ok(tags.len() as u64)
    }

    async fn to_watch(&self, watcher: &str, now: i64, limit: u32) -> Result<Vec<Intent>, LedgerError> {
        let s = self.lock();
        let mut rows: Vec<Intent> = s
            .intents
            .values()
            .filter(|i| {
                i.state == IntentState::Accepted && (i.watch_until < now || i.watcher.as_deref() == Some(watcher))
            })
            .cloned()
            .collect();
        rows.sort_by(|a, b| (a.watch_until, &a.intent_id).cmp(&(b.watch_until, &b.intent_id)));
        rows.truncate(limit as usize);
        Ok(rows)
    }

    async fn take_watch(
        &self,
        intent_id: &str,
        watcher: &str,
        seen_until: i64,
        until: i64,
    ) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        Ok(match s.intents.get_mut(intent_id) {
            Some(i) if i.state == IntentState::Accepted && i.watch_until == seen_until => {
                i.watcher = Some(watcher.to_owned());
                i.watch_until = until;
                true
            }
            _ => false,
        })
    }

    async fn conclude(&self, intent_id: &str, watcher: &str, state: IntentState) -> Result<bool, LedgerError> {
        let mut s = self.lock();
        Ok(match s.intents.get_mut(intent_id) {
            Some(i) if i.state == IntentState::Accepted && i.watcher.as_deref() == Some(watcher) => {
                i.state = state;
                i.watcher = None;
                true
            }
            _ => false,
        })
    }

    async fn insert_operations(&self, rows: &[OperationRow]) -> Result<(), LedgerError> {
        let mut s = self.lock();
        for r in rows {
            s.ops.insert(r.op_id.clone(), (r.clone(), 0));
        }
        Ok(())
    }
}
