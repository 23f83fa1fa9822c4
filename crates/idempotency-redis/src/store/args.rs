//! The scripts' arguments, encoded as the scripts read them (see [`crate::scripts`]).

use std::time::Duration;

use idempotency::{Claim, ClaimRequest, Record, StoredResponse, Timestamp};

use crate::codec::{encode_ts, expiry_millis};
#[cfg(feature = "testing")]
use crate::store::RedisStore;

/// The claim script's arguments: record id, fingerprint, now, expires_at, expires_at in epoch
/// milliseconds, principal, endpoint, key, stale cutoff (see [`crate::scripts::CLAIM`]).
pub(super) struct ClaimArgs<'a> {
    fresh: &'a Record,
    /// The scope as the record's fields keep it ([`idempotency::stored_component`]): its key is
    /// a digest of the whole scope already, and its fields need not hold a long part whole.
    stored: [std::borrow::Cow<'a, str>; 3],
    rid: String,
    now: String,
    eat: String,
    pub(super) eat_ms: String,
    cutoff: String,
}

impl<'a> ClaimArgs<'a> {
    /// The arguments that claim `req`'s key as `fresh` (made by `req.new_record()`, so expiring
    /// no earlier than the claim plus the in-flight TTL) when it is free.
    pub(super) fn new(req: &'a ClaimRequest, fresh: &'a Record) -> Self {
        let s = &req.scope;
        Self {
            fresh,
            stored: [s.principal.as_str(), s.endpoint.as_str(), s.key.as_str()].map(idempotency::stored_component),
            rid: fresh.record_id.to_hex(),
            now: encode_ts(req.now),
            eat: encode_ts(fresh.expires_at),
            eat_ms: expiry_millis(fresh.expires_at).to_string(),
            cutoff: stale_cutoff(req.now, req.in_flight_ttl),
        }
    }

    pub(super) fn args(&self) -> [&[u8]; 9] {
        let [principal, endpoint, key] = &self.stored;
        [
            self.rid.as_bytes(),
            self.fresh.fingerprint.as_str().as_bytes(),
            self.now.as_bytes(),
            self.eat.as_bytes(),
            self.eat_ms.as_bytes(),
            principal.as_bytes(),
            endpoint.as_bytes(),
            key.as_bytes(),
            self.cutoff.as_bytes(),
        ]
    }
}

/// The fence's arguments, first in every fenced script: the claim's record id and generation.
pub(super) struct Fence {
    rid: String,
    generation: String,
}

impl Fence {
    pub(super) fn new(claim: &Claim) -> Self {
        Self::of(claim.record())
    }

    /// The fence of `record` as it was claimed.
    pub(super) fn of(record: &Record) -> Self {
        Self { rid: record.record_id.to_hex(), generation: record.generation.to_string() }
    }

    pub(super) fn args(&self) -> [&[u8]; 2] {
        [self.rid.as_bytes(), self.generation.as_bytes()]
    }
}

/// The complete script's arguments after the fence's: status, headers, body, body encoding,
/// expires_at, expires_at in epoch milliseconds.
pub(super) struct CompleteArgs<'a> {
    response: &'a StoredResponse,
    status: String,
    headers: String,
    eat: String,
    eat_ms: String,
}

impl<'a> CompleteArgs<'a> {
    pub(super) fn new(response: &'a StoredResponse, expires_at: Timestamp) -> Self {
        Self {
            response,
            status: response.status.to_string(),
            headers: response.headers_json(),
            eat: encode_ts(expires_at),
            eat_ms: expiry_millis(expires_at).to_string(),
        }
    }

    pub(super) fn args(&self) -> [&[u8]; 6] {
        [
            self.status.as_bytes(),
            self.headers.as_bytes(),
            self.response.body.stored_bytes(),
            self.response.body.encoding().as_str().as_bytes(),
            self.eat.as_bytes(),
            self.eat_ms.as_bytes(),
        ]
    }
}

/// The latest `started_at` at which a claim is stale at `now` (`started_at + ttl <= now`),
/// floored to the microsecond, in stored form; empty when no claim can be that old, which
/// compares as never stale in the script.
pub(super) fn stale_cutoff(now: Timestamp, ttl: Duration) -> String {
    use chrono::SubsecRound;
    chrono::Duration::from_std(ttl)
        .ok()
        .and_then(|ttl| now.checked_sub_signed(ttl))
        .map(|c| encode_ts(c.trunc_subsecs(6)))
        .unwrap_or_default()
}

/// The store's script calls as data, for running its own scripts outside it: the benchmark's
/// floor sends them with `redis-benchmark`.
#[cfg(feature = "testing")]
impl RedisStore {
    /// The call [`Store::claim`](idempotency::Store::claim) sends for `req` when the record it
    /// would insert is `fresh`.
    pub fn claim_call(&self, req: &ClaimRequest, fresh: &Record) -> crate::testing::ScriptCall {
        let args = ClaimArgs::new(req, fresh);
        crate::testing::ScriptCall::new(&self.scripts.claim, self.key_of(&req.scope), &args.args())
    }

    /// The call [`Store::complete`](idempotency::Store::complete) sends for `claim`.
    pub fn complete_call(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> crate::testing::ScriptCall {
        let (fence, rest) = (Fence::new(claim), CompleteArgs::new(response, expires_at));
        let args: Vec<&[u8]> = fence.args().into_iter().chain(rest.args()).collect();
        crate::testing::ScriptCall::new(&self.scripts.complete, self.key_of(claim.scope()), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_cutoff_is_empty_when_no_claim_can_be_that_old() {
        let now = idempotency::now();
        assert_eq!(stale_cutoff(now, Duration::from_secs(300)), encode_ts(now - chrono::Duration::seconds(300)));
        assert_eq!(stale_cutoff(now, Duration::MAX), "");
    }
}
