//! A Redis store for idempotency records: on one server, or spread over a Redis Cluster, for
//! services whose record traffic outgrows one database.
//!
//! [`RedisStore`] implements [`idempotency::Store`] and passes the core's conformance suite on
//! both (the suite's variant for stores whose records expire by themselves; see
//! [Retention](#retention)).
//!
//! ```no_run
//! use idempotency::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, Scope, Store, now};
//! use idempotency_redis::{RedisStore, RedisStoreOptions};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One server; for a cluster: "redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379".
//! let store = RedisStore::connect_with("redis://127.0.0.1:6379", RedisStoreOptions::default().prefix("leasebroker:")).await?;
//!
//! let key = IdempotencyKey::try_from("7c3f5d1e-91a4-4b8c")?;
//! let scope = Scope::new(Principal::new("team-a"), Endpoint::new("POST", "/v1/workers"), key);
//! let t = now();
//! let req = ClaimRequest {
//!     scope,
//!     fingerprint: Fingerprint::from_stored("sha256:00"),
//!     now: t,
//!     in_flight_ttl: std::time::Duration::from_secs(300),
//!     expires_at: t + chrono::Duration::hours(24),
//! };
//! assert!(matches!(store.claim(req.clone()).await?, ClaimOutcome::Owned(_)));
//! assert!(matches!(store.claim(req).await?, ClaimOutcome::Existing(_)));
//! # Ok(()) }
//! ```
//!
//! # The client
//!
//! The [`redis`] crate (redis-rs): the most used and longest maintained Rust client, with one
//! API for a single server (its `ConnectionManager`, which reconnects by itself) and a cluster
//! (its async cluster client, which follows `MOVED`/`ASK` and refreshes the slot map), both
//! multiplexing their callers over their connections, on tokio (on a single server the store
//! takes [`DEFAULT_CONNECTIONS`] connection managers in turn; see
//! [`RedisStoreOptions::connections`]; with [`RedisStoreOptions::replicas`] the transitions get
//! connections of their own, see [Replica acknowledgement](#replica-acknowledgement)). `fred`
//! would serve too;
//! redis-rs was chosen because it is the client most Rust users of Redis already have, its
//! cluster routing is explicit enough to ask each primary by address (the eviction check and
//! `ping` need that), and its `Script` type computes the digests that `EVALSHA` names.
//!
//! # Layout and atomicity
//!
//! A record is one Redis hash at one key: the prefix ([`RedisStoreOptions::prefix`], default
//! [`DEFAULT_PREFIX`]) followed by the hex SHA-256 of the principal, endpoint and key
//! ([`RedisStore::key_of`]). Every transition (claim, reclaim, complete, fail, heartbeat,
//! remove) is one Lua script on that one key, so it is atomic on a server and on a cluster
//! alike (a cluster runs a script on the primary that owns the key's slot); `get` is one
//! `HGETALL`. Scripts are called by SHA1 digest (`EVALSHA`); when a server has lost its script
//! cache (a restart, a failover, `SCRIPT FLUSH`) it answers `NOSCRIPT`, and the store sends the
//! same call once more as `EVAL` with the source, which caches the script again.
//!
//! - **Claim** is insert-or-read in one round trip: a live record is returned whole (a replay
//!   costs one round trip); no record, or an expired one, is replaced by a new in-flight record
//!   with a new record id, and the caller owns it. Of any number of concurrent claimers exactly
//!   one owns a new key.
//! - **Complete**, **fail**, **heartbeat** and **remove** are fenced on the record id and the
//!   generation, exactly as in the SQL stores: a claim that was superseded, or a record that is
//!   no longer in flight, gets [`StoreError::Fenced`](idempotency::StoreError::Fenced) and
//!   nothing is written (a fenced call never recreates a deleted record).
//! - **Reclaim** is a compare-and-set on the record id and generation the caller read, for a
//!   failed record or an in-flight one whose claim is stale; of concurrent reclaimers exactly one
//!   wins.
//! - Bodies above the caller's threshold arrive compressed ([`idempotency::StoredBody`]) and are
//!   stored as they are, binary-safe, with their encoding.
//!
//! # Retention
//!
//! A record's key expires at the record's `expires_at` (`PEXPIREAT`, rounded up to the
//! millisecond): set by the claim, moved by `complete`, and moved later (never earlier) by a
//! `reclaim`, so a retry near the end of the retention window is not removed while it runs.
//! Redis deletes expired keys itself, so no sweeper pass is needed:
//! [`sweep_expired`](idempotency::Store::sweep_expired) deletes nothing and returns `Ok(0)`.
//! A record whose `expires_at` has passed by the caller's clock but not yet by Redis's counts as
//! absent to a claim, as in every store. The in-flight TTL is separate: it is checked against
//! the record's `started_at` and never shortens the key's life.
//!
//! Expiry follows the Redis server's clock; a server clock ahead of the service's removes
//! records that much early. `get` reads a record until Redis removes it.
//!
//! # Eviction
//!
//! An evicted record is a duplicate waiting to happen: the next retry finds no record and runs
//! the request again. [`RedisStore::connect`] reads every primary's `maxmemory-policy` and
//! refuses anything but `noeviction` ([`ConnectError::EvictingPolicy`]). It reads it with
//! `CONFIG GET maxmemory-policy`; where `CONFIG` is refused (renamed, or denied by an ACL, as
//! on several managed services) from `INFO memory`; where both are refused, or a cluster's
//! primary does not answer, it refuses to connect ([`ConnectError::UnverifiedPolicy`]) unless
//! told to only warn
//! ([`UnverifiedPolicy::Warn`]). It reads them again whenever a call lost its connection or the
//! cluster connection was replaced (the client then talks to a node over a new connection: maybe
//! a server restarted with another configuration, or a replica promoted by a failover), before
//! the next transition: a primary that evicts then fails every transition as unavailable, with
//! the same error naming it and its policy, and the policy is read again at most once a second
//! until it is `noeviction` (test: `wait::the_eviction_policy_is_read_again_when_a_connection_is_made_again`).
//! A primary that does not answer that check holds up no transition (its own fail by
//! themselves) and is asked again in the background. A policy changed on a server whose
//! connections all stay up is not seen. With `noeviction` a full server refuses writes (`OOM`):
//! claims then fail as unavailable, which is never taken as ownership.
//!
//! # Durability: what each guarantee needs from Redis
//!
//! Redis acknowledges a write once it is in the primary's memory. What survives a primary's
//! death depends on its persistence and replication settings; the store cannot check these
//! (a single server may run without persistence by design), so the operator must choose them.
//!
//! | guarantee | needs | lost when a primary dies without it |
//! |---|---|---|
//! | one owner per key, fencing | the primary alive, or the record's write persisted before the primary restarts or is replaced | a claim, re-claim or completion written since the last persisted point: a retry finds no record (or an older generation) and runs the request again, with new sub-keys |
//! | replay for the retention window | `appendonly yes` | without an append-only file a restart loads the last RDB snapshot (minutes old, or nothing with `save ""`): every record since is gone |
//! | ... across a power loss or kernel crash | `appendfsync always` | with `everysec` (the default) up to about a second of acknowledged writes; with `no`, whatever the OS had not flushed (up to about 30 s). A crash of the Redis process alone loses nothing acknowledged with `everysec` |
//! | ... across a failover to a replica | a replica per primary, and [`RedisStoreOptions::replicas`]`(1)` (`WAIT 1 T` after each write; `WAITAOF 1 1 T` on Redis 7.2+ with `appendonly yes`) | replication is asynchronous: without the wait, the writes the promoted replica had not received, each acknowledged to the service. The test `failover::a_failover_keeps_what_the_replicas_acknowledged` makes a replica lag (paused, its stream backed up) and kills its primary: every record written while it lagged without the wait is gone after the promotion, and with the wait none was acknowledged (each failed as unavailable) while every acknowledged one survives |
//!
//! For the guarantees of the PostgreSQL store (a committed record survives any single crash),
//! run Redis with `appendonly yes` and `appendfsync always`; for a record to survive a failover,
//! give each primary a replica and wait for it (below).
//!
//! # Replica acknowledgement
//!
//! With [`RedisStoreOptions::replicas`]`(N)` (leasebroker: `--record-store-replicas N`, with
//! `--record-store-replica-timeout T`) every transition that writes is followed by `WAIT N T`
//! (by `WAITAOF 1 N T` when every primary runs Redis 7.2 or later with `appendonly yes`, read
//! from `INFO` at connect). `WAIT` counts the replicas that have the last write of the
//! connection that sends it, so the script and its `WAIT` go to the record's primary as one
//! pipeline over one connection; a retry of the cluster client (after a lost connection, or a
//! redirection) sends both again, together. A `WAIT` sent alone over a connection that wrote
//! nothing is answered at once with every replica still linked, however far behind (test:
//! `wait::a_connection_cut_after_the_claim_script_acknowledges_nothing`, a proxy that cuts the
//! connection right after the claim script's reply). When fewer than `N`
//! replicas acknowledge within `T`, the transition fails as
//! [`StoreError::Unavailable`](idempotency::StoreError::Unavailable) caused by
//! [`idempotency::NotAcknowledged`] (the service answers `503 store-unavailable` with
//! `Retry-After`), and:
//!
//! - a new **claim** is removed again (fenced on its record id): no handler runs for it, and a
//!   retry finds the key free rather than in flight;
//! - a **reclaim** is marked failed under its new generation, so the next retry reclaims it at once;
//! - a **completion** stays written on the primary (a script cannot be taken back once its reply
//!   is read), but the response is not answered as final: `idempotency-tower` answers `503` and
//!   does not retry the write; the retry replays the stored response, or, if a failover lost it,
//!   finds the claim and resumes after it goes stale;
//! - `fail`, `heartbeat` and `remove` fail as unavailable, as any store error.
//!
//! A script sent again after its reply was lost (the cluster client does so after an I/O error;
//! the layer retries a completion) finds the record as its first run left it and writes
//! nothing, so the `WAIT` after it counts nothing. Such a run is the caller's own: a claim's
//! record with its record id, a completion by its claim with its very response (another
//! response is fenced: a completed record is final), a `fail` by its claim. It is acknowledged
//! only after a `WAIT` that follows a write of the record (a script that re-writes its
//! generation unchanged), and a `WAIT` that already found too few replicas stands (test:
//! `wait::a_completion_sent_again_after_its_reply_was_lost_is_the_callers_own`). A claim or
//! reclaim whose call fails after its script may have run (its reply lost or late) is taken
//! back in a task of its own, fenced on its record id, so that it does not hold its key in
//! flight.
//!
//! `WAIT` blocks the connection that sends it until the replicas answer or `T` passes, so a
//! shard whose replica does not answer would hold up every command queued behind its
//! transitions on that shard's connection. The transitions therefore have connections of their
//! own (one more per node), and reads, the per-principal index and count, announcements and
//! `ping` keep the others: a refusal for lack of acknowledgement concerns the keys of the shard
//! that cannot acknowledge, and keys on the other shards are served as usual (tests:
//! `partial::a_shard_whose_replica_is_paused_fails_only_its_own_keys`, the shard that holds the
//! principal's index, its replica paused, kept busy by eight tasks; leasebroker's
//! `one_redis_shard_without_its_replica_refuses_only_its_own_keys`).
//!
//! What it does not do: `WAIT` makes a write durable on `N` replicas, not consensus. A failover
//! that promotes a replica which did not acknowledge (Redis picks the replica with the most data,
//! so with one replica per primary this is the acknowledging one) can still lose it, and a
//! replay of a record another process wrote is answered without waiting again (a claim that
//! finds a record still sends its `WAIT`, which cannot be known unneeded before the script's
//! answer; it is ignored). With 0 (the default) the store sends no `WAIT`, as before.
//!
//! # A Redis Cluster
//!
//! Connect with `redis+cluster://HOST:PORT[,HOST:PORT]...`. Records spread over all primaries
//! by their key's slot. When one primary is unreachable, calls for the records it holds fail as
//! unavailable (never as ownership), after [`RedisStoreOptions::cluster_retries`] retries, and
//! records on the other primaries keep working, provided the cluster keeps serving without full
//! slot coverage: set `cluster-require-full-coverage no`, or every node refuses every command
//! (`CLUSTERDOWN`) once the dead primary is marked failed (test:
//! `partial::a_shard_whose_primary_is_down_fails_only_its_own_keys`).
//! [`Store::ping`](idempotency::Store::ping) asks every primary at once, each within a second,
//! and reports the store ready while at least one of them answers and takes writes: the store
//! answers for the keys of those, and a readiness probe that took every replica of a service
//! out of its load balancer for one shard would stop them too. Each primary that fails is
//! logged, by address, at every ping; with none left the store is not ready.
//!
//! After a failover the cluster client reconnects to the lost node and refreshes its slot map by
//! itself, within seconds. In two long fault runs one process's client did not: a slot refresh
//! began and never ended, and the client answered no call (for six minutes, until the run
//! ended) while a fresh client served the same cluster
//! (docs/faultline/failover-redis-long-2026-12-03.md). So when every call on the cluster
//! connection goes unanswered (timed out, dropped by its caller, its node connection lost) for
//! [`RedisStoreOptions::cluster_reconnect_after`] (default [`DEFAULT_CLUSTER_RECONNECT_AFTER`]),
//! the store opens a new one from the URL's nodes and the calls that follow use it; an answer of
//! any kind, an error reply included, starts the period again.
//!
//! # TLS, readiness and the per-principal count
//!
//! `rediss://` connects with TLS (rustls), trusting the system's roots, or only a private CA
//! given with [`RedisStoreOptions::root_certificates_pem`]. [`Store::ping`](idempotency::Store::ping)
//! reports a server that refuses writes for lack of memory as not ready: one over its
//! `maxmemory` (`INFO memory`), or one that refused a write with `OOM` since the last claim that
//! succeeded (on a cluster: not ready when every primary is so, or does not answer; see
//! [A Redis Cluster](#a-redis-cluster)). [`Store::count_records`](idempotency::Store::count_records)
//! reads a sorted set per principal (`PREFIXprincipal:<sha256>`, members the record keys scored
//! by expiry): a claim, a reclaim, a renewal and a completion add their record (at its expiry),
//! a failure, a remove and a forget take it out, so it counts what the SQL stores count (records
//! completed or in flight, not failed). On a single server the claim and the completion, a first
//! execution's two transitions, add their record in their own script (the set is the script's
//! second key), atomically, and cost no round trip more; the other transitions, and every
//! transition on a cluster, write it with plain commands after the transition, not atomically with
//! it (Redis 7.0 or later for its expiry); a record it misses is not counted until its next
//! transition. On a cluster the set is one key, on one shard, while the principal's records are
//! on all of them: a transition waits at most half a second for its index write (which goes on
//! after it), and a count its primary does not answer within a second is `None` (the record
//! limit is not enforced for that call) rather than an error that would refuse every key of the
//! principal.
//!
//! # Waiting for a record in flight
//!
//! `complete` and `fail` announce that a record left `in_flight`: once the script has run they
//! `PUBLISH`, in a task of their own (the channel's node may be another shard, one that does not
//! answer), the record's [`change_tag`](idempotency::change_tag) on the prefix's channel
//! ([`changes_channel`], `PREFIXrecord-changes`), and [`Store::changes`](idempotency::Store::changes)
//! subscribes to it on a connection of its own. So a request of another process that waits for
//! the record (`Prefer: wait`, in `idempotency-tower`) is woken as soon as it is stored instead
//! of at its next poll. On a cluster a `PUBLISH` reaches every node's subscribers, so the one
//! subscription (to the first node of the URL that answers) hears every primary. An
//! announcement is not a guarantee: one lost (the subscription broke, the publisher died between
//! the script and the `PUBLISH`) costs the waiter its next poll, nothing more, and a broken
//! subscription wakes every waiter so each reads its record again.
//!
//! # Errors
//!
//! A Redis error (refused connection, timeout, `OOM`, `CLUSTERDOWN`) is
//! [`StoreError::Unavailable`](idempotency::StoreError::Unavailable); a value of the wrong type
//! at a record's key, or a hash that does not decode, is
//! [`StoreError::Corrupt`](idempotency::StoreError::Corrupt). A reply lost after the server
//! applied a script (a timeout) leaves the write in place: a claim whose call failed so is taken
//! back (see [Replica acknowledgement](#replica-acknowledgement)), a completion retried is
//! recognised as its caller's own; neither is ever a second owner.

#![warn(missing_docs)]

mod admin;
mod changes;
mod cluster;
mod codec;
mod conn;
mod options;
mod policy;
mod reply;
mod scripts;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use changes::channel as changes_channel;
pub use options::{
    CLUSTER_SCHEME, ConnectError, DEFAULT_CLUSTER_RECONNECT_AFTER, DEFAULT_CONNECTIONS, DEFAULT_PREFIX,
    DEFAULT_REPLICA_TIMEOUT, RedisStoreOptions, UnverifiedPolicy,
};
pub use store::RedisStore;
