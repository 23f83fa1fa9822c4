//! Announcements that a record left `in_flight` or was forgotten, between processes: `complete`,
//! `fail` and `forget`
//! `PUBLISH` the record's [`change_tag`] on the prefix's channel once their script has run, and
//! [`Store::changes`](idempotency::Store::changes) subscribes to it on a connection of its own,
//! so a request waiting with `Prefer: wait` in another process is woken at once. On a cluster,
//! a (non-sharded) `PUBLISH` reaches the subscribers of every node, so one subscription to any
//! node hears every primary's announcements.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::StreamExt;
use idempotency::RecordChanges;

use crate::conn::Conn;

/// The channel of the announcements of records under `prefix`.
pub fn channel(prefix: &str) -> String {
    format!("{prefix}record-changes")
}

/// Publishes `tag` on `channel`. A lost announcement costs a waiter its next poll, nothing more.
pub(crate) async fn announce(conn: &Conn, channel: &str, tag: &str) {
    if let Err(e) = conn.query(redis::cmd("PUBLISH").arg(channel).arg(tag)).await {
        tracing::debug!(error = %e, "could not announce a record change; waiters find it by polling");
    }
}

/// How often a subscriber with nothing to hear checks whether its store is gone.
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// Wakes the waiters of each announced record until the store is dropped, subscribed through
/// the first of `clients` that answers (the server, or a node of the cluster). A broken
/// subscription wakes every waiter (announcements may have been missed: each reads its record
/// again) and is made again, on the next client.
pub(crate) async fn listen(clients: Arc<Vec<redis::Client>>, channel: String, changes: Weak<RecordChanges>) {
    let mut turn = 0usize;
    loop {
        if changes.strong_count() == 0 || clients.is_empty() {
            return;
        }
        let client = &clients[turn % clients.len()];
        turn = turn.wrapping_add(1);
        let pubsub = async {
            let mut p = client.get_async_pubsub().await?;
            p.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(p)
        };
        let pubsub = match pubsub.await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "cannot subscribe to record changes; waiters poll meanwhile");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Waiters that subscribed before this did may have missed theirs.
        if let Some(c) = changes.upgrade() {
            c.listening();
        }
        let mut messages = pubsub.into_on_message();
        loop {
            match tokio::time::timeout(IDLE_CHECK, messages.next()).await {
                Ok(Some(msg)) => {
                    let Some(c) = changes.upgrade() else { return };
                    if let Ok(tag) = msg.get_payload::<String>() {
                        c.wake(&tag);
                    }
                }
                Ok(None) => break,
                Err(_) if changes.strong_count() == 0 => return,
                Err(_) => {}
            }
        }
        tracing::warn!("the subscription to record changes ended; waiters poll until it is back");
        if let Some(c) = changes.upgrade() {
            c.lost();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
