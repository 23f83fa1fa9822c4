//! Operating the Redis store: listing records with `SCAN`, finding one by its id, forgetting one,
//! resolving an uncertain one.
//!
//! A record's key is the prefix and a digest of its scope, so nothing indexes records by id,
//! state or principal: a listing walks the prefix's keys with `SCAN` (node by node on a
//! cluster), reads each record and keeps those that match. A page's cursor names the node, the
//! `SCAN` cursor and the last key returned from that `SCAN` batch, so no page starts at an
//! offset. One call reads at most [`MAX_EXAMINED`] records: a page of a selective filter may
//! then hold fewer records than asked while `next_cursor` says where to go on. Finding a record
//! by its id reads the `rid` of every key under the prefix until it is found.

use futures::future::try_join_all;
use idempotency::{Forget, Record, RecordId, RecordPage, RecordQuery, Resolve, StoreError, StoredResponse, Timestamp};
use redis::Value;

use crate::conn::Node;
use crate::store::{RedisStore, record_reply, redis_error};

/// How many keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 256;

/// The most records one listing call reads.
pub(crate) const MAX_EXAMINED: usize = 4096;

/// Where a listing goes on: node index, `SCAN` cursor, the last key suffix returned from that
/// `SCAN` batch (empty: none).
#[derive(Debug, PartialEq, Eq)]
struct Cursor {
    node: usize,
    scan: u64,
    last: String,
}

impl Cursor {
    fn parse(s: &str) -> Option<Self> {
        let mut parts = s.splitn(3, '.');
        let node = parts.next()?.parse().ok()?;
        let scan = parts.next()?.parse().ok()?;
        let last = parts.next()?.to_owned();
        (last.is_empty() || is_suffix(&last)).then_some(Self { node, scan, last })
    }

    fn render(&self) -> String {
        format!("{}.{}.{}", self.node, self.scan, self.last)
    }
}

/// A record key's part after the prefix: 64 lowercase hex digits.
fn is_suffix(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `prefix` as a `SCAN MATCH` pattern that matches it literally, then anything.
fn pattern(prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('*');
    p
}

impl RedisStore {
    /// One `SCAN` step on `node`: the next cursor and the record keys' suffixes, sorted.
    async fn scan_step(&self, node: &Node, scan: u64) -> Result<(u64, Vec<String>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(scan).arg("MATCH").arg(pattern(self.prefix())).arg("COUNT").arg(SCAN_COUNT);
        let reply = self.conn.query_on(node, &cmd).await.map_err(redis_error)?;
        let bad = || StoreError::Corrupt("an unexpected SCAN reply".to_owned());
        let Value::Array(mut parts) = reply else { return Err(bad()) };
        let (Some(Value::Array(keys)), Some(Value::BulkString(next))) = (parts.pop(), parts.pop()) else {
            return Err(bad());
        };
        let next: u64 = std::str::from_utf8(&next).ok().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        let mut suffixes: Vec<String> = keys
            .into_iter()
            .filter_map(|k| match k {
                Value::BulkString(k) => String::from_utf8(k).ok(),
                _ => None,
            })
            .filter_map(|k| k.strip_prefix(self.prefix()).filter(|s| is_suffix(s)).map(str::to_owned))
            .collect();
        suffixes.sort_unstable();
        suffixes.dedup();
        Ok((next, suffixes))
    }

    /// The records at these key suffixes (a key that vanished meanwhile is left out).
    async fn read_all(&self, suffixes: &[String]) -> Result<Vec<(String, Record)>, StoreError> {
        let reads = suffixes.iter().map(|s| async move {
            let key = format!("{}{s}", self.prefix());
            let reply = self.conn.query(redis::cmd("HGETALL").arg(key)).await.map_err(redis_error)?;
            Ok::<_, StoreError>(record_reply(reply)?.map(|r| (s.clone(), r)))
        });
        Ok(try_join_all(reads).await?.into_iter().flatten().collect())
    }

    pub(crate) async fn admin_list(&self, query: &RecordQuery) -> Result<RecordPage, StoreError> {
        let mut at = match &query.cursor {
            None => Cursor { node: 0, scan: 0, last: String::new() },
            Some(c) => Cursor::parse(c).ok_or(StoreError::InvalidCursor)?,
        };
        let nodes = self.conn.nodes().await.map_err(redis_error)?;
        if query.cursor.is_some() && at.node >= nodes.len() {
            return Err(StoreError::InvalidCursor);
        }
        let size = query.page_size();
        let (mut records, mut examined) = (Vec::new(), 0);
        while let Some(node) = nodes.get(at.node) {
            let (next, mut suffixes) = self.scan_step(node, at.scan).await?;
            if !at.last.is_empty() {
                suffixes.retain(|s| *s > at.last);
            }
            examined += suffixes.len();
            for (suffix, record) in self.read_all(&suffixes).await? {
                if !query.matches(&record) {
                    continue;
                }
                records.push(record);
                if records.len() == size {
                    // The rest of this batch comes first on the next page.
                    let cursor = Cursor { node: at.node, scan: at.scan, last: suffix };
                    return Ok(RecordPage { records, next_cursor: Some(cursor.render()) });
                }
            }
            at = if next == 0 {
                Cursor { node: at.node + 1, scan: 0, last: String::new() }
            } else {
                Cursor { node: at.node, scan: next, last: String::new() }
            };
            if examined >= MAX_EXAMINED && at.node < nodes.len() {
                return Ok(RecordPage { records, next_cursor: Some(at.render()) });
            }
        }
        Ok(RecordPage { records, next_cursor: None })
    }

    /// The key suffix and record with this id, by a scan of every key's `rid`.
    pub(crate) async fn admin_find(&self, id: &RecordId) -> Result<Option<(String, Record)>, StoreError> {
        let rid = id.to_hex();
        let rid = rid.as_bytes();
        for node in self.conn.nodes().await.map_err(redis_error)? {
            let mut scan = 0;
            loop {
                let (next, suffixes) = self.scan_step(&node, scan).await?;
                let reads = suffixes.iter().map(|s| async move {
                    let key = format!("{}{s}", self.prefix());
                    let v = self.conn.query(redis::cmd("HGET").arg(key).arg("rid")).await.map_err(redis_error)?;
                    Ok::<_, StoreError>(matches!(v, Value::BulkString(ref b) if b.as_slice() == rid))
                });
                let hits = try_join_all(reads).await?;
                if let Some(i) = hits.iter().position(|h| *h) {
                    let found = self.read_all(std::slice::from_ref(&suffixes[i])).await?.pop();
                    if let Some((s, r)) = found.filter(|(_, r)| r.record_id == *id) {
                        return Ok(Some((s, r)));
                    }
                }
                if next == 0 {
                    break;
                }
                scan = next;
            }
        }
        Ok(None)
    }

    pub(crate) async fn admin_forget(&self, id: &RecordId) -> Result<Forget, StoreError> {
        let Some((suffix, record)) = self.admin_find(id).await? else { return Ok(Forget::Absent) };
        let key = format!("{}{suffix}", self.prefix());
        let rid = id.to_hex();
        match self.eval(&self.scripts.forget, &key, &[rid.as_bytes()]).await? {
            Value::Int(0) => Ok(Forget::Absent),
            Value::Int(2) => Ok(Forget::InFlight(record)),
            reply => match record_reply(reply)? {
                Some(r) => {
                    self.unindex_record(&r.scope.principal, &key).await;
                    // Other processes drop their copies of the record.
                    self.announce_change(&r.scope);
                    Ok(Forget::Forgotten(r))
                }
                None => Err(StoreError::Corrupt("the forget script returned no record".to_owned())),
            },
        }
    }
}

impl RedisStore {
    pub(crate) async fn admin_resolve(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Result<Resolve, StoreError> {
        let Some((suffix, record)) = self.admin_find(id).await? else { return Ok(Resolve::Absent) };
        let key = format!("{}{suffix}", self.prefix());
        let rid = id.to_hex();
        let (status, headers) = (response.status.to_string(), response.headers_json());
        let (eat, eat_ms) = (crate::codec::encode_ts(expires_at), crate::codec::expiry_millis(expires_at).to_string());
        let args: [&[u8]; 7] = [
            rid.as_bytes(),
            status.as_bytes(),
            headers.as_bytes(),
            response.body.stored_bytes(),
            response.body.encoding().as_str().as_bytes(),
            eat.as_bytes(),
            eat_ms.as_bytes(),
        ];
        match self.eval(&self.scripts.resolve, &key, &args).await? {
            Value::Int(0) => Ok(Resolve::Absent),
            // In another state: read it again, as it stands now.
            Value::Int(2) => Ok(Resolve::NotUncertain(self.admin_find(id).await?.map_or(record, |(_, r)| r))),
            reply => match record_reply(reply)? {
                Some(r) => {
                    self.index_key(&r.scope.principal, &key, &eat_ms).await;
                    self.announce_change(&r.scope);
                    Ok(Resolve::Resolved(r))
                }
                None => Err(StoreError::Corrupt("the resolve script returned no record".to_owned())),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_foreign_ones_are_refused() {
        let c = Cursor { node: 2, scan: 1234, last: "ab".repeat(32) };
        assert_eq!(Cursor::parse(&c.render()), Some(c));
        let c = Cursor { node: 0, scan: 7, last: String::new() };
        assert_eq!(Cursor::parse(&c.render()), Some(c));
        for bad in ["", "1", "1.2", "x.1.", "1.-1.", "1.2.zz", "1.2.ABAB"] {
            assert_eq!(Cursor::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_prefix_is_matched_literally() {
        assert_eq!(pattern("lb:"), "lb:*");
        assert_eq!(pattern("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\*");
    }
}
