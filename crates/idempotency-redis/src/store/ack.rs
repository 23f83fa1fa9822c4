//! The replica acknowledgement: what each write waits for (`WAIT`, or `WAITAOF` where every
//! primary has it), chosen at connect, and what the reply of the wait sent with a write says.

use std::time::Duration;

use idempotency::{NotAcknowledged, StoreError};
use redis::Value;

use super::{RedisStore, redis_error};
use crate::conn::Conn;
use crate::options::{ConnectError, RedisStoreOptions};

impl RedisStore {
    /// The replica acknowledgement each write waits for: `None` without
    /// [`RedisStoreOptions::replicas`]; otherwise the number of replicas, and whether it is
    /// `WAITAOF` (true) or `WAIT`.
    pub fn replica_ack(&self) -> Option<(u32, bool)> {
        self.ack.as_ref().map(|a| (a.replicas, a.aof))
    }

    /// Whether a write was acknowledged: `reply` is that of the `WAIT` (or `WAITAOF`) sent after
    /// it on its connection; fewer replicas than configured is [`StoreError::Unavailable`]
    /// caused by [`NotAcknowledged`]. Without [`RedisStoreOptions::replicas`], always.
    pub(super) fn acknowledged(&self, what: &'static str, reply: Option<Value>) -> Result<(), StoreError> {
        let Some(ack) = &self.ack else { return Ok(()) };
        let reply = reply
            .ok_or_else(|| StoreError::Corrupt(format!("no {} reply after the {what}", ack.command_name())))?
            .extract_error()
            .map_err(redis_error)?;
        let acknowledged = ack.replicas_in(&reply)?;
        if acknowledged >= i64::from(ack.replicas) {
            return Ok(());
        }
        tracing::warn!(what, acknowledged, wanted = ack.replicas, "a write was not acknowledged by enough replicas");
        Err(StoreError::unavailable(NotAcknowledged { what, acknowledged, wanted: ack.replicas, timeout: ack.timeout }))
    }
}

impl RedisStore {
    /// Whether `reply` is that of a wait that counted fewer replicas than configured.
    pub(super) fn too_few(&self, reply: Option<&Value>) -> bool {
        let Some(ack) = &self.ack else { return false };
        reply.is_some_and(|r| ack.replicas_in(r).is_ok_and(|n| n < i64::from(ack.replicas)))
    }
}

/// What each write waits for: `WAIT replicas timeout`, or `WAITAOF 1 replicas timeout` (the
/// primary's and the replicas' append-only files synced) where every primary has it.
#[derive(Debug, Clone)]
pub(super) struct Ack {
    replicas: u32,
    timeout: Duration,
    aof: bool,
}

impl Ack {
    /// What `options` ask each write to wait for: nothing without
    /// [`RedisStoreOptions::replicas`]; otherwise `WAITAOF` where every primary has it (read from
    /// `INFO` on `conn`), else `WAIT`.
    pub(super) async fn for_options(conn: &Conn, options: &RedisStoreOptions) -> Result<Option<Self>, ConnectError> {
        let ack = match options.replicas {
            0 => None,
            replicas => {
                let aof = conn.every_primary_has_waitaof().await.map_err(ConnectError::Unreachable)?;
                Some(Ack { replicas, timeout: options.replica_timeout, aof })
            }
        };
        if let Some(ack) = &ack {
            tracing::info!(command = ack.command_name(), replicas = ack.replicas, timeout = ?ack.timeout,
                "each transition waits for its replicas");
        }
        Ok(ack)
    }

    fn command_name(&self) -> &'static str {
        if self.aof { "WAITAOF" } else { "WAIT" }
    }

    /// The command sent after each write, in the same pipeline.
    pub(super) fn command(&self) -> redis::Cmd {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd(self.command_name());
        if self.aof {
            cmd.arg(1);
        }
        cmd.arg(self.replicas).arg(ms);
        cmd
    }

    /// How many replicas acknowledged, from the reply: `WAIT`'s integer, or `WAITAOF`'s pair
    /// (local, replicas), where a local file not synced counts as no replica at all.
    fn replicas_in(&self, reply: &Value) -> Result<i64, StoreError> {
        match (self.aof, reply) {
            (false, Value::Int(n)) => Ok(*n),
            (true, Value::Array(pair)) => match pair.as_slice() {
                [Value::Int(local), Value::Int(replicas)] => Ok(if *local >= 1 { *replicas } else { 0 }),
                _ => Err(StoreError::Corrupt(format!("unexpected WAITAOF reply {reply:?}"))),
            },
            _ => Err(StoreError::Corrupt(format!("unexpected {} reply {reply:?}", self.command_name()))),
        }
    }
}
