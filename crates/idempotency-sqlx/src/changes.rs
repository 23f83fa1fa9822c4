//! Announcements that a record left `in_flight` or was forgotten, between processes on one
//! PostgreSQL database, for both PostgreSQL stores: `complete`, `fail` and `forget` hand the record's [`change_tag`] to a
//! background task once their statement has committed, the task sends whatever tags are queued
//! as `NOTIFY` payloads on [`CHANGES_CHANNEL`], and [`Store::changes`](idempotency::Store::changes)
//! listens on one connection per store, so a request waiting with `Prefer: wait` in another
//! process is woken at once.
//!
//! Why not `NOTIFY` in the completion's own statement: a transaction that notifies takes a
//! server-wide lock on the notification queue at commit and holds it until the commit is
//! durable, so every completion's commit waited for every other one's. Off the request's path,
//! one task sends the announcements of many completions in one short transaction of its own,
//! and the completions commit side by side. An announcement may be lost (the queue full, the
//! send failed, a process that reads one tag per payload, as releases before batching did,
//! during a rolling upgrade): waiters also read their record again with backoff, so a lost
//! one costs a waiter its next poll.

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use idempotency::{RecordChanges, Scope, change_tag};
use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::mpsc;

/// The channel of the announcements that a record left `in_flight`; a payload is one or more
/// records' [`change_tag`]s, separated by single spaces.
pub const CHANGES_CHANNEL: &str = "idempotency_record_changes";

/// PostgreSQL refuses a payload of 8000 bytes or more (with the default page size).
const MAX_PAYLOAD: usize = 7999;

/// Tags waiting to be sent. When it is full (the database is slower than the completions, or
/// unreachable) a tag is dropped: its waiters, who poll the record with backoff anyway, find the
/// change at their next poll instead of at once.
const QUEUE: usize = 8192;

/// Tags taken off the queue for one statement (32 payloads at most).
const BATCH: usize = 32 * (MAX_PAYLOAD / 33);

/// Sends all of a batch's payloads in one statement, one transaction, one round trip.
const NOTIFY: &str = "SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS payload";

/// A PostgreSQL store's side of the announcements: the task that sends them and the listener
/// that hears them, each started on first use (they need a tokio runtime; without one there are
/// none, and waiters poll). Clones share both; the sending task ends when the last clone is
/// dropped (the store with it), the listener when the store and every [`RecordChanges`] it
/// handed out are.
#[derive(Debug, Clone, Default)]
pub(crate) struct Announcements {
    sender: Arc<OnceLock<Option<mpsc::Sender<String>>>>,
    listener: Arc<OnceLock<Option<Arc<RecordChanges>>>>,
}

impl Announcements {
    /// Announcements that are never sent (the store still listens for others'): for a database
    /// no process waits on, and to measure what sending them costs.
    pub(crate) fn never() -> Self {
        let sender = OnceLock::new();
        let _ = sender.set(None);
        Self { sender: Arc::new(sender), listener: Arc::default() }
    }

    /// Queues the announcement that `scope`'s record left `in_flight`; call it once the change
    /// committed. Never waits and never fails: a lost announcement costs a waiter its next poll.
    pub(crate) fn announce(&self, pool: &PgPool, scope: &Scope) {
        let sender = self.sender.get_or_init(|| {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            Some(spawn_sender(&runtime, pool.clone()).0)
        });
        let Some(sender) = sender else { return };
        if let Err(e) = sender.try_send(change_tag(scope)) {
            tracing::debug!(error = %e, "record change not announced; its waiters find it by polling");
        }
    }

    /// The waiters woken by the announcements of [`CHANGES_CHANNEL`], heard on one connection of
    /// `pool`'s from the first call on.
    pub(crate) fn changes(&self, pool: &PgPool) -> Option<Arc<RecordChanges>> {
        self.listener
            .get_or_init(|| {
                let runtime = tokio::runtime::Handle::try_current().ok()?;
                let changes = Arc::new(RecordChanges::new());
                runtime.spawn(listen(pool.clone(), Arc::downgrade(&changes)));
                Some(changes)
            })
            .clone()
    }
}

/// Starts the task that sends the tags queued on the returned sender, until every sender is
/// dropped (then it drops its `pool`).
fn spawn_sender(runtime: &tokio::runtime::Handle, pool: PgPool) -> (mpsc::Sender<String>, tokio::task::JoinHandle<()>) {
    let (sender, queue) = mpsc::channel(QUEUE);
    (sender, runtime.spawn(send_queued(pool, queue)))
}

/// Sends whatever tags are queued, in one statement, while the previous statement was running
/// the next batch gathers. The statement takes a connection of the pool's like any request.
async fn send_queued(pool: PgPool, mut queue: mpsc::Receiver<String>) {
    let mut tags = Vec::with_capacity(BATCH);
    while queue.recv_many(&mut tags, BATCH).await > 0 {
        if let Err(e) = notify(&pool, &payloads(&tags, MAX_PAYLOAD)).await {
            tracing::debug!(error = %e, tags = tags.len(), "record changes not announced; their waiters find them by polling");
        }
        tags.clear();
    }
}

/// Sends `payloads` on [`CHANGES_CHANNEL`] in one statement.
async fn notify(pool: &PgPool, payloads: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query(NOTIFY).bind(CHANGES_CHANNEL).bind(payloads).execute(pool).await?;
    Ok(())
}

/// `tags` joined by single spaces into as few payloads as fit in `max` bytes each, in order;
/// each tag lands in exactly one payload. A tag that could not be read back out of a payload
/// (empty, holding a space) or that alone is longer than `max` is left out; a [`change_tag`]
/// is 32 hex digits, so none is.
fn payloads(tags: &[String], max: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for tag in tags {
        if tag.is_empty() || tag.contains(' ') || tag.len() > max {
            tracing::debug!(len = tag.len(), "not a tag an announcement can carry");
            continue;
        }
        if !current.is_empty() && current.len() + 1 + tag.len() > max {
            out.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(tag);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The tags a payload carries.
fn tags(payload: &str) -> impl Iterator<Item = &str> {
    payload.split(' ').filter(|t| !t.is_empty())
}

/// Wakes the waiters of each announced record until the store is dropped. The feed is
/// [`listening`](RecordChanges::listening) once `LISTEN` has run; a broken connection is
/// [`lost`](RecordChanges::lost) (announcements may have been missed: every waiter reads its
/// record again, a replay cache drops its copies) and is opened again, listening again.
async fn listen(pool: PgPool, changes: Weak<RecordChanges>) {
    loop {
        let Some(mut listener) = connect(&pool, &changes).await else { return };
        loop {
            let received = listener.try_recv().await;
            let Some(changes) = changes.upgrade() else { return };
            match received {
                Ok(Some(n)) => tags(n.payload()).for_each(|tag| changes.wake(tag)),
                broken => {
                    let error = broken.err().map(|e| e.to_string());
                    tracing::warn!(?error, "listening for record changes broke; waiters poll until it is back");
                    changes.lost();
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A connection that listens on [`CHANGES_CHANNEL`], tried once a second until one does, the
/// feed then [`listening`](RecordChanges::listening); `None` once the store is gone.
async fn connect(pool: &PgPool, changes: &Weak<RecordChanges>) -> Option<PgListener> {
    loop {
        if changes.strong_count() == 0 {
            return None;
        }
        match PgListener::connect_with(pool).await {
            Ok(mut l) => match l.listen(CHANGES_CHANNEL).await {
                Ok(()) => {
                    changes.upgrade()?.listening();
                    return Some(l);
                }
                Err(e) => tracing::warn!(error = %e, "cannot LISTEN for record changes; waiters poll meanwhile"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot open the connection that listens for record changes"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn tag(i: usize, len: usize) -> String {
        let t = format!("{i:x}");
        format!("{}{t}", "0".repeat(len - t.len()))
    }

    /// Every tag in exactly one payload, in order, none over the limit, and no more payloads
    /// than needed: each (but the last) could not have taken the next tag.
    fn check(tags: &[String], max: usize) -> Vec<String> {
        let out = payloads(tags, max);
        assert!(out.iter().all(|p| !p.is_empty() && p.len() <= max), "a payload over {max} bytes");
        let back: Vec<&str> = out.iter().flat_map(|p| super::tags(p)).collect();
        assert_eq!(back, tags.iter().map(String::as_str).collect::<Vec<_>>());
        for pair in out.windows(2) {
            let next = super::tags(&pair[1]).next().expect("a tag");
            assert!(pair[0].len() + 1 + next.len() > max, "a payload was cut before it was full");
        }
        out
    }

    #[test]
    fn a_batch_over_the_limit_becomes_several_payloads_each_tag_in_exactly_one() {
        // 32-byte tags as `change_tag` makes them: 242 fit in 7,985 bytes, 243 would need 8,018.
        let tags: Vec<String> = (0..1000).map(|i| tag(i, 32)).collect();
        let out = check(&tags, MAX_PAYLOAD);
        assert_eq!(out.len(), 5);
        assert_eq!(out[0].len(), 242 * 33 - 1);
        let mut seen = HashMap::new();
        for t in out.iter().flat_map(|p| super::tags(p)) {
            *seen.entry(t).or_insert(0) += 1;
        }
        assert_eq!(seen.len(), 1000);
        assert!(seen.values().all(|&n| n == 1));

        // Exactly at the limit: 80 tags of 99 bytes and their 79 spaces are 7,999 bytes.
        let tags: Vec<String> = (0..161).map(|i| tag(i, 99)).collect();
        let out = check(&tags, MAX_PAYLOAD);
        assert_eq!(out.iter().map(String::len).collect::<Vec<_>>(), [7999, 7999, 99]);
    }

    #[test]
    fn small_batches_are_one_payload_and_untransportable_tags_are_left_out() {
        assert_eq!(payloads(&[], MAX_PAYLOAD), Vec::<String>::new());
        let tags: Vec<String> = (0..3).map(|i| tag(i, 32)).collect();
        assert_eq!(check(&tags, MAX_PAYLOAD), [tags.join(" ")]);
        let odd = ["a".to_owned(), String::new(), "b c".to_owned(), "x".repeat(11), "d".to_owned()];
        assert_eq!(payloads(&odd, 10), ["a d"]);
        assert_eq!(super::tags(" a  b ").collect::<Vec<_>>(), ["a", "b"]);
    }

    /// The payloads as PostgreSQL takes them: one at the limit is sent (one byte more is
    /// refused), and the sending task
    /// delivers every queued tag, then ends with its last sender (it does not keep the pool).
    #[cfg(feature = "testing")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn payloads_at_the_limit_are_delivered_and_the_task_ends_with_its_sender() {
        let Some(db) = crate::testing::TestDatabase::create().await else { return };
        let pool = PgPool::connect(db.url()).await.expect("connect");
        let mut listener = PgListener::connect_with(&pool).await.expect("listener");
        listener.listen(CHANGES_CHANNEL).await.expect("listen");
        let heard = |n: usize, mut listener: PgListener| async move {
            let mut got = Vec::new();
            while got.len() < n {
                let note = tokio::time::timeout(Duration::from_secs(30), listener.recv())
                    .await
                    .expect("the announcements arrived")
                    .expect("receive");
                assert!(note.payload().len() <= MAX_PAYLOAD);
                got.extend(tags(note.payload()).map(str::to_owned));
            }
            (got, listener)
        };

        let over = notify(&pool, &["0".repeat(MAX_PAYLOAD + 1)]).await;
        assert!(over.is_err(), "PostgreSQL took a payload over the limit: the limit is wrong");
        let wide: Vec<String> = (0..160).map(|i| tag(i, 99)).collect();
        notify(&pool, &payloads(&wide, MAX_PAYLOAD)).await.expect("PostgreSQL takes a 7,999-byte payload");
        let (got, listener) = heard(160, listener).await;
        assert_eq!(got, wide);

        let (sender, task) = spawn_sender(&tokio::runtime::Handle::current(), pool.clone());
        let queued: Vec<String> = (0..600).map(|i| tag(i, 32)).collect();
        for t in &queued {
            sender.try_send(t.clone()).expect("room in the queue");
        }
        let (mut got, _listener) = heard(600, listener).await;
        got.sort();
        assert_eq!(got, queued);
        drop(sender);
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the task ended when its sender was dropped")
            .expect("the task did not panic");
    }
}
