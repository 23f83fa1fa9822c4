//! The Lua scripts: one per transition, each on one key (`KEYS[1]`, the record's hash). On a
//! single server `claim` and `complete` also take the principal's index (`KEYS[2]`,
//! [`crate::store`]'s per-principal sorted set) and add the record to it in the same script: the
//! first execution's two transitions are then two round trips, not four. On a cluster the index
//! is on another slot, and is written after the transition by plain commands.
//!
//! Stored fields: `p`, `e`, `k` (principal, endpoint, key), `rid` (record id, hex), `fp`, `st`
//! (state), `gen`, `cat`, `sat`, `eat` (created, started, expires: see [`crate::codec`]), and
//! once completed `rs`, `rh`, `rb`, `re` (status, headers as JSON, body bytes, body encoding).
//!
//! Timestamps are fixed-width digit strings that sort in time order, so the scripts compare them
//! as strings; no script does arithmetic on them (Lua numbers are doubles, and Redis turns a Lua
//! number into a string with 14 significant digits). Every value a script writes comes from
//! `ARGV` as the store formatted it, including the next generation.

use redis::Script;

/// The fence shared by `complete`, `fail`, `mark_uncertain`, `heartbeat` and `remove`: the record must exist,
/// carry the claim's record id (`ARGV[1]`) and generation (`ARGV[2]`), and be in flight;
/// otherwise the script returns 0 and writes nothing. A missing key reads as all-false and
/// fails the check, so a fenced call never recreates a record.
macro_rules! fence {
    () => {
        "local h = redis.call('HMGET', KEYS[1], 'rid', 'gen', 'st', 'sat')\n\
         if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'in_flight' then return 0 end\n"
    };
}

/// With the principal's index as `KEYS[2]` (a single server): the record's key added to it, scored
/// by `ARGV[N]` (its expiry in epoch milliseconds), and the index made to expire no earlier than
/// that (`NX`, then `GT`), as [`crate::store`]'s `index_key` does with plain commands.
macro_rules! index {
    ($argv:literal) => {
        concat!(
            "if KEYS[2] then\n",
            "  redis.call('ZADD', KEYS[2], ARGV[",
            $argv,
            "], KEYS[1])\n",
            "  redis.call('PEXPIREAT', KEYS[2], ARGV[",
            $argv,
            "], 'NX')\n",
            "  redis.call('PEXPIREAT', KEYS[2], ARGV[",
            $argv,
            "], 'GT')\n",
            "end\n"
        )
    };
}

/// Insert-or-read. ARGV: record id, fingerprint, now, expires_at, expires_at in epoch
/// milliseconds (rounded up), principal, endpoint, key, stale cutoff (the latest `started_at`
/// that is stale; empty when no claim can be that old).
///
/// A live record is returned whole (`HGETALL`) and left unchanged: one not expired
/// (`eat > now`), or one in flight under a claim that is not stale (`sat > cutoff`), whatever its
/// expiry. Otherwise, no record or one whose key is free, a new in-flight record replaces it, the
/// key expires at `expires_at` (the store makes it no earlier than the claim plus the in-flight
/// TTL), the record is indexed when `KEYS[2]` is given, and the script returns 1: the caller
/// owns it.
pub(crate) const CLAIM: &str = concat!(
    "\
local h = redis.call('HMGET', KEYS[1], 'eat', 'st', 'sat')
local eat = h[1]
if eat then
  if eat > ARGV[3] then return redis.call('HGETALL', KEYS[1]) end
  if h[2] == 'in_flight' and (ARGV[9] == '' or type(h[3]) ~= 'string' or h[3] > ARGV[9]) then
    return redis.call('HGETALL', KEYS[1])
  end
  redis.call('DEL', KEYS[1])
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('CORRUPT the key holds a hash without expires_at')
end
redis.call('HSET', KEYS[1], 'p', ARGV[6], 'e', ARGV[7], 'k', ARGV[8], 'rid', ARGV[1], 'fp', ARGV[2],
  'st', 'in_flight', 'gen', '1', 'cat', ARGV[3], 'sat', ARGV[3], 'eat', ARGV[4])
redis.call('PEXPIREAT', KEYS[1], ARGV[5])
",
    index!("5"),
    "return 1\n"
);

/// Compare-and-set re-claim. ARGV: record id, generation, now, stale cutoff (the latest
/// `started_at` that is stale; empty when no claim can be that old), expires_at (at least `now`
/// plus the in-flight TTL), expires_at in epoch milliseconds, the next generation.
///
/// Succeeds only for the record id and generation the caller read, when the record is failed or
/// in flight with `sat <= cutoff`: then it is in flight under the next generation from now, its
/// expiry moves to `expires_at` if that is later (the key's own expiry with it), and the script
/// returns the record. Otherwise nil, and nothing is written.
pub(crate) const RECLAIM: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'gen', 'st', 'sat', 'eat')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] then return false end
local stale = h[3] == 'in_flight' and type(h[4]) == 'string' and ARGV[4] ~= '' and h[4] <= ARGV[4]
if h[3] ~= 'failed' and not stale then return false end
redis.call('HSET', KEYS[1], 'st', 'in_flight', 'gen', ARGV[7], 'sat', ARGV[3])
if type(h[5]) ~= 'string' or ARGV[5] > h[5] then
  redis.call('HSET', KEYS[1], 'eat', ARGV[5])
  redis.call('PEXPIREAT', KEYS[1], ARGV[6])
end
return redis.call('HGETALL', KEYS[1])
";

/// in_flight -> completed, fenced. ARGV after the fence: status, headers, body, body encoding,
/// expires_at, expires_at in epoch milliseconds. Indexed when `KEYS[2]` is given. Returns 1, or 0
/// when fenced.
pub(crate) const COMPLETE: &str = concat!(
    fence!(),
    "redis.call('HSET', KEYS[1], 'st', 'completed', 'rs', ARGV[3], 'rh', ARGV[4], 'rb', ARGV[5], \
       're', ARGV[6], 'eat', ARGV[7])\n\
     redis.call('PEXPIREAT', KEYS[1], ARGV[8])\n",
    index!("8"),
    "return 1\n"
);

/// in_flight -> failed, fenced. Returns 1, or 0 when fenced.
pub(crate) const FAIL: &str = concat!(fence!(), "redis.call('HSET', KEYS[1], 'st', 'failed')\nreturn 1\n");

/// in_flight -> uncertain, fenced. Returns 1, or 0 when fenced.
pub(crate) const MARK_UNCERTAIN: &str = concat!(fence!(), "redis.call('HSET', KEYS[1], 'st', 'uncertain')\nreturn 1\n");

/// Compare-and-set of a stale in-flight record to uncertain. ARGV: record id, generation, stale
/// cutoff (empty when no claim can be that old), expires_at, expires_at in epoch milliseconds.
///
/// Succeeds only for the record id and generation the caller read, when the record is in flight
/// with `sat <= cutoff`: then it is uncertain under the same generation, its expiry moves to
/// `expires_at` if that is later (the key's own expiry with it), and the script returns the
/// record. Otherwise nil, and nothing is written.
pub(crate) const MARK_STALE_UNCERTAIN: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'gen', 'st', 'sat', 'eat')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] then return false end
if h[3] ~= 'in_flight' or type(h[4]) ~= 'string' or ARGV[3] == '' or h[4] > ARGV[3] then return false end
redis.call('HSET', KEYS[1], 'st', 'uncertain')
if type(h[5]) ~= 'string' or ARGV[4] > h[5] then
  redis.call('HSET', KEYS[1], 'eat', ARGV[4])
  redis.call('PEXPIREAT', KEYS[1], ARGV[5])
end
return redis.call('HGETALL', KEYS[1])
";

/// Compare-and-set take-over of an uncertain record. ARGV: record id, generation, now,
/// expires_at, expires_at in epoch milliseconds, the next generation.
///
/// Succeeds only for the record id and generation the caller read, when the record is
/// uncertain: then it is in flight under the next generation from now, its expiry moves to
/// `expires_at` if that is later (the key's own with it), and the script returns the record.
/// Otherwise nil, and nothing is written.
pub(crate) const TAKE_OVER_UNCERTAIN: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'gen', 'st', 'eat')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= 'uncertain' then return false end
redis.call('HSET', KEYS[1], 'st', 'in_flight', 'gen', ARGV[6], 'sat', ARGV[3])
if type(h[4]) ~= 'string' or ARGV[4] > h[4] then
  redis.call('HSET', KEYS[1], 'eat', ARGV[4])
  redis.call('PEXPIREAT', KEYS[1], ARGV[5])
end
return redis.call('HGETALL', KEYS[1])
";

/// uncertain -> completed. ARGV: record id, status, headers, body, body encoding, expires_at,
/// expires_at in epoch milliseconds. Returns the record as stored; 2 when it is in another
/// state (nothing written); 0 when the key holds another record or none.
pub(crate) const RESOLVE: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'st')
if h[1] ~= ARGV[1] then return 0 end
if h[2] ~= 'uncertain' then return 2 end
redis.call('HSET', KEYS[1], 'st', 'completed', 'rs', ARGV[2], 'rh', ARGV[3], 'rb', ARGV[4], 're', ARGV[5],
  'eat', ARGV[6])
redis.call('PEXPIREAT', KEYS[1], ARGV[7])
return redis.call('HGETALL', KEYS[1])
";

/// Renews a claim, fenced. ARGV after the fence: now, expires_at (at least `now` plus the
/// in-flight TTL), expires_at in epoch milliseconds. Neither `started_at` nor the expiry (the
/// key's own with it) moves backwards. Returns 1, or 0 when fenced.
pub(crate) const HEARTBEAT: &str = concat!(
    fence!(),
    "if type(h[4]) ~= 'string' or ARGV[3] > h[4] then redis.call('HSET', KEYS[1], 'sat', ARGV[3]) end\n\
     local eat = redis.call('HGET', KEYS[1], 'eat')\n\
     if type(eat) ~= 'string' or ARGV[4] > eat then\n\
       redis.call('HSET', KEYS[1], 'eat', ARGV[4])\n\
       redis.call('PEXPIREAT', KEYS[1], ARGV[5])\n\
     end\n\
     return 1\n"
);

/// Deletes the record, fenced. Returns 1, or 0 when fenced.
pub(crate) const REMOVE: &str = concat!(fence!(), "redis.call('DEL', KEYS[1])\nreturn 1\n");

/// Forgets a record that is not in flight. ARGV: record id. Returns the record (`HGETALL`)
/// after deleting it; 2 when it is in flight (nothing deleted); 0 when the key holds another
/// record or none.
pub(crate) const FORGET: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'st')
if h[1] ~= ARGV[1] then return 0 end
if h[2] == 'in_flight' then return 2 end
local all = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return all
";

/// Re-writes a record's generation, unchanged, when the record has the record id (`ARGV[1]`),
/// generation (`ARGV[2]`) and state (`ARGV[3]`) given, and each field named in `ARGV[4..]`
/// (pairs: field, value) holds that value; returns 1, or 0 (nothing written). For a transition
/// whose script ran twice (its reply was lost and it was sent again) and whose second run found
/// the record as its first run left it, and so wrote nothing: `WAIT` counts the replicas that
/// have the last write of its own connection, so the wait after this write covers the record as
/// it is.
pub(crate) const TOUCH: &str = "\
local h = redis.call('HMGET', KEYS[1], 'rid', 'gen', 'st')
if h[1] ~= ARGV[1] or h[2] ~= ARGV[2] or h[3] ~= ARGV[3] then return 0 end
for i = 4, #ARGV - 1, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) ~= ARGV[i + 1] then return 0 end
end
redis.call('HSET', KEYS[1], 'gen', ARGV[2])
return 1
";

/// The scripts with their SHA1 digests, computed once per store.
#[derive(Debug)]
pub(crate) struct Scripts {
    pub claim: Lua,
    pub reclaim: Lua,
    pub complete: Lua,
    pub fail: Lua,
    pub mark_uncertain: Lua,
    pub mark_stale_uncertain: Lua,
    pub take_over_uncertain: Lua,
    pub resolve: Lua,
    pub heartbeat: Lua,
    pub remove: Lua,
    pub forget: Lua,
    pub touch: Lua,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            claim: Lua::new(CLAIM),
            reclaim: Lua::new(RECLAIM),
            complete: Lua::new(COMPLETE),
            fail: Lua::new(FAIL),
            mark_uncertain: Lua::new(MARK_UNCERTAIN),
            mark_stale_uncertain: Lua::new(MARK_STALE_UNCERTAIN),
            take_over_uncertain: Lua::new(TAKE_OVER_UNCERTAIN),
            resolve: Lua::new(RESOLVE),
            heartbeat: Lua::new(HEARTBEAT),
            remove: Lua::new(REMOVE),
            forget: Lua::new(FORGET),
            touch: Lua::new(TOUCH),
        }
    }
}

/// One script: its source (sent with `EVAL` when the server lost it) and its `redis::Script`
/// (which knows the SHA1 that `EVALSHA` names).
#[derive(Debug)]
pub(crate) struct Lua {
    pub code: &'static str,
    pub script: Script,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Self { code, script: Script::new(code) }
    }
}
