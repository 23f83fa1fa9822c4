//! The stored record, its state machine and the response it keeps.

use std::fmt;
use std::time::Duration;

use crate::derive::{SubKey, derive};
use crate::{Fingerprint, RecordId, Scope};
use bytes::Bytes;
use chrono::{DateTime, SubsecRound, Utc};

/// A point in time as stores keep it: UTC, microsecond precision.
pub type Timestamp = DateTime<Utc>;

/// The current time, truncated to the microsecond precision that every store keeps, so a
/// timestamp reads back equal to what was written.
pub fn now() -> Timestamp {
    Utc::now().trunc_subsecs(6)
}

/// The state of a record.
///
/// ```text
///   none --claim--> in_flight --complete--> completed --expiry--> none
///                    |   ^  \--fail--> failed --reclaim--> in_flight
///                    |   '--reclaim (stale)--'
///                    |--remove--> none
///                    '--mark_uncertain / mark_stale_uncertain--> uncertain
///   uncertain --take_over_uncertain--> in_flight      (run again: resend, or "never happened")
///   uncertain --resolve--> completed                  (what happened, told by an operator or a probe)
///   uncertain --forget / expiry--> none
/// ```
///
/// `uncertain` is for a caller that sends a request on (a gateway) and may not know whether it
/// acted: no TTL makes it run again, and only an explicit take-over or resolution moves it.
///
/// While its handler runs, the claim's owner renews it with `heartbeat` (a new `started_at`,
/// and an expiry no earlier than a TTL later), so only a dead attempt goes stale, and a record in
/// flight never expires under a live one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// A claim owns the request and its handler is (or was) running.
    InFlight,
    /// The handler finished with a terminal response, which is stored.
    Completed,
    /// The handler failed (5xx, error, panic); the next retry runs it again.
    Failed,
    /// The request was sent on and its outcome is unknown (the answer was lost, or the attempt
    /// died after sending it). Never run again on a guess: not by a TTL, not by `reclaim`; only
    /// [`Store::take_over_uncertain`](crate::Store::take_over_uncertain) runs it again and
    /// [`Store::resolve`](crate::Store::resolve) stores what happened.
    Uncertain,
}

impl RecordState {
    /// Every state, in the order of the state machine.
    pub const ALL: [Self; 4] = [Self::InFlight, Self::Completed, Self::Failed, Self::Uncertain];

    /// The stored name: `in_flight`, `completed`, `failed` or `uncertain`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Uncertain => "uncertain",
        }
    }

    /// Whether a stored record in this state may hold `response` (only a completed one holds
    /// one, and it always does): what a store checks as it decodes a record, the reason when
    /// not ([`StoreError::Corrupt`](crate::StoreError::Corrupt)'s words).
    pub fn check_response<T>(self, response: Option<&T>) -> Result<(), String> {
        if (self == Self::Completed) == response.is_some() {
            return Ok(());
        }
        Err(format!("a {self} record {} a response", if response.is_some() { "with" } else { "without" }))
    }

    /// Parses the stored name.
    pub fn from_stored(s: &str) -> Option<Self> {
        match s {
            "in_flight" => Some(Self::InFlight),
            "completed" => Some(Self::Completed),
            "failed" => Some(Self::Failed),
            "uncertain" => Some(Self::Uncertain),
            _ => None,
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a stored body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyEncoding {
    /// As sent.
    Identity,
    /// zstd-compressed.
    Zstd,
}

impl BodyEncoding {
    /// The stored name: `identity` or `zstd`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Identity => "identity",
            Self::Zstd => "zstd",
        }
    }

    /// Parses the stored name.
    pub fn from_stored(s: &str) -> Option<Self> {
        match s {
            "identity" => Some(Self::Identity),
            "zstd" => Some(Self::Zstd),
            _ => None,
        }
    }
}

/// A response body as stored: raw, or zstd-compressed above a size threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBody {
    encoding: BodyEncoding,
    bytes: Bytes,
}

/// The zstd level used for stored bodies: fast, and most JSON shrinks several times over.
const ZSTD_LEVEL: i32 = 3;

impl StoredBody {
    /// Encodes `body`, compressing it when it is longer than `threshold` bytes and compression
    /// actually makes it smaller.
    pub fn encode(body: Bytes, threshold: usize) -> Self {
        if body.len() > threshold
            && let Ok(z) = zstd::bulk::compress(&body, ZSTD_LEVEL)
            && z.len() < body.len()
        {
            return Self { encoding: BodyEncoding::Zstd, bytes: Bytes::from(z) };
        }
        Self { encoding: BodyEncoding::Identity, bytes: body }
    }

    /// Rebuilds a stored body from a store's columns.
    pub fn from_stored(encoding: BodyEncoding, bytes: impl Into<Bytes>) -> Self {
        Self { encoding, bytes: bytes.into() }
    }

    /// The encoding.
    pub fn encoding(&self) -> BodyEncoding {
        self.encoding
    }

    /// The bytes as stored (compressed when the encoding says so).
    pub fn stored_bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The original body, byte for byte.
    pub fn decode(&self) -> Result<Bytes, std::io::Error> {
        self.decode_at_most(usize::MAX)
    }

    /// The original body, byte for byte, if it is at most `limit` bytes; an error otherwise,
    /// found without inflating more than `limit + 1` bytes, so a stored zstd "bomb" costs no
    /// more memory than the largest response the store may hold.
    pub fn decode_at_most(&self, limit: usize) -> Result<Bytes, std::io::Error> {
        use std::io::Read;
        let too_large = || std::io::Error::new(std::io::ErrorKind::InvalidData, "stored body exceeds the limit");
        match self.encoding {
            BodyEncoding::Identity if self.bytes.len() > limit => Err(too_large()),
            BodyEncoding::Identity => Ok(self.bytes.clone()),
            BodyEncoding::Zstd => {
                let decoder = zstd::stream::read::Decoder::new(&self.bytes[..])?;
                let mut out = Vec::new();
                decoder.take(u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1)).read_to_end(&mut out)?;
                if out.len() > limit {
                    return Err(too_large());
                }
                Ok(Bytes::from(out))
            }
        }
    }
}

/// A terminal response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// The replayable headers, in order; a name may repeat.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: StoredBody,
}

impl StoredResponse {
    /// The headers in their stored form: a JSON array of `[name, value]` pairs.
    pub fn headers_json(&self) -> String {
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Parses headers from their stored form.
    pub fn headers_from_json(s: &str) -> Result<Vec<(String, String)>, serde_json::Error> {
        serde_json::from_str(s)
    }
}

/// One idempotency record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// (principal, endpoint, key).
    pub scope: Scope,
    /// Minted when the record was created; kept across re-claims.
    pub record_id: RecordId,
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// The state.
    pub state: RecordState,
    /// The fencing token: 1 on creation, one more on every re-claim.
    pub generation: i64,
    /// The stored response, when completed.
    pub response: Option<StoredResponse>,
    /// When the record was created.
    pub created_at: Timestamp,
    /// When the current claim began.
    pub started_at: Timestamp,
    /// When the record may be swept; the key is free again from then on.
    pub expires_at: Timestamp,
}

/// What to do with a request whose key already has a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Completed with the same fingerprint: replay the stored response.
    Replay(StoredResponse),
    /// Another request (a different fingerprint) already used this key.
    Mismatch,
    /// A live attempt owns it; try again after this long.
    InProgress {
        /// How long until the claim would go stale, at least one second.
        retry_after: Duration,
    },
    /// Failed, or in flight but stale: the caller may re-claim it with `Store::reclaim`.
    Reclaim,
    /// Uncertain: the request was sent on and nobody knows whether it acted. The caller decides
    /// by its own rule: hold it, take it over to run again
    /// ([`Store::take_over_uncertain`](crate::Store::take_over_uncertain)), or find out and
    /// [`resolve`](crate::Store::resolve) it. Never run again on a guess.
    Uncertain,
}

impl Record {
    /// The stable sub-key for the side effect `label` of this record; see [`crate::derive`].
    pub fn derive(&self, label: &str) -> SubKey {
        derive(&self.scope, &self.record_id, label)
    }

    /// True when the record has expired at `now` (`expires_at <= now`).
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.expires_at <= now
    }

    /// True when the record's key is free at `now`, so that a claim replaces the record with a
    /// new one: it has expired, and it is not in flight under a claim that is still live by
    /// `in_flight_ttl`. A store never gives an in-flight record an expiry before its claim can go
    /// stale, so the second condition only matters for a record written otherwise (a shorter TTL
    /// than the caller's, an older version): belt and braces against running a key twice.
    pub fn is_free(&self, now: Timestamp, in_flight_ttl: Duration) -> bool {
        self.is_expired(now) && (self.state != RecordState::InFlight || self.is_stale(now, in_flight_ttl))
    }

    /// True when an in-flight claim has outlived `in_flight_ttl` at `now`.
    pub fn is_stale(&self, now: Timestamp, in_flight_ttl: Duration) -> bool {
        self.state == RecordState::InFlight && now >= stale_after(self.started_at, in_flight_ttl)
    }

    /// Takes the stored response out of the record when [`Record::decide`] would replay it (the
    /// same fingerprint, completed), and leaves the record unchanged otherwise. For a caller
    /// that is done with the record once it replays: the response is moved, not copied.
    pub fn take_replay(&mut self, fingerprint: &Fingerprint) -> Option<StoredResponse> {
        if self.state == RecordState::Completed && self.fingerprint == *fingerprint {
            self.response.take()
        } else {
            None
        }
    }

    /// Decides what a request with `fingerprint` gets at `now` (docs/protocol.md#records).
    pub fn decide(&self, fingerprint: &Fingerprint, now: Timestamp, in_flight_ttl: Duration) -> Decision {
        if &self.fingerprint != fingerprint {
            return Decision::Mismatch;
        }
        match (self.state, &self.response) {
            (RecordState::Completed, Some(resp)) => Decision::Replay(resp.clone()),
            // A completed row without a response is corrupt; running again is the safe repair
            // only through a fenced re-claim, which the store refuses for completed rows.
            (RecordState::Completed, None) => Decision::InProgress { retry_after: Duration::from_secs(1) },
            (RecordState::Failed, _) => Decision::Reclaim,
            (RecordState::Uncertain, _) => Decision::Uncertain,
            (RecordState::InFlight, _) => {
                let stale_at = stale_after(self.started_at, in_flight_ttl);
                if now >= stale_at {
                    Decision::Reclaim
                } else {
                    let left = (stale_at - now).to_std().unwrap_or_default();
                    Decision::InProgress { retry_after: left.max(Duration::from_secs(1)) }
                }
            }
        }
    }
}

/// `t + d`, saturating at the latest time chrono represents: a retention or TTL of "forever"
/// (`Duration::MAX`) never overflows. The one way the crates add a duration to a timestamp.
///
/// ```
/// use std::time::Duration;
/// let t = idempotency::now();
/// assert_eq!(idempotency::later(t, Duration::from_secs(1)), t + chrono::Duration::seconds(1));
/// assert_eq!(idempotency::later(t, Duration::MAX), chrono::DateTime::<chrono::Utc>::MAX_UTC);
/// ```
pub fn later(t: Timestamp, d: Duration) -> Timestamp {
    chrono::Duration::from_std(d).ok().and_then(|d| t.checked_add_signed(d)).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `started_at + ttl`, saturating: when an in-flight record's claim goes stale.
pub fn stale_after(started_at: Timestamp, ttl: Duration) -> Timestamp {
    later(started_at, ttl)
}

/// The expiry an in-flight record gets from an attempt at `now` that asks for `expires_at`: that,
/// but never before the attempt's claim can go stale (`now + in_flight_ttl`), so a record in
/// flight never expires under a live attempt, however short the retention (docs/protocol.md#records).
fn in_flight_expiry(now: Timestamp, in_flight_ttl: Duration, expires_at: Timestamp) -> Timestamp {
    expires_at.max(stale_after(now, in_flight_ttl))
}

/// Proof that the caller owns a record's current attempt. `complete`, `fail`, `heartbeat` and
/// `remove` take it and only succeed while its generation is still the record's and the record is
/// in flight: a claim that went stale and was re-claimed by another attempt can no longer write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    record: Record,
}

impl Claim {
    /// Wraps the record as it stood right after the claim. For store implementations.
    pub fn new(record: Record) -> Self {
        Self { record }
    }

    /// The record as claimed.
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// The claim's fencing generation.
    pub fn generation(&self) -> i64 {
        self.record.generation
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.record.scope
    }

    /// A stable sub-key for one side effect of this request; see [`crate::derive`].
    pub fn derive(&self, label: &str) -> SubKey {
        self.record.derive(label)
    }
}

/// A request to claim a key.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The record's scope.
    pub scope: Scope,
    /// The incoming request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The time of the claim; it becomes `created_at` and `started_at`.
    pub now: Timestamp,
    /// How long the caller honours a claim that nobody renews. The new record expires no
    /// earlier than `now + in_flight_ttl`, and an expired record in flight under a claim still
    /// live by it is not replaced ([`Record::is_free`]).
    pub in_flight_ttl: Duration,
    /// When the record expires if it never completes (the caller's `now + retention`), but no
    /// earlier than `now + in_flight_ttl`: see [`ClaimRequest::record_expires_at`].
    pub expires_at: Timestamp,
}

impl ClaimRequest {
    /// The expiry of the record this claim creates: `expires_at`, or `now + in_flight_ttl` if
    /// that is later.
    pub fn record_expires_at(&self) -> Timestamp {
        in_flight_expiry(self.now, self.in_flight_ttl, self.expires_at)
    }

    /// The record this claim would create: in flight, generation 1, a fresh record id, expiring
    /// at [`ClaimRequest::record_expires_at`].
    pub fn new_record(&self) -> Record {
        Record {
            scope: self.scope.clone(),
            record_id: RecordId::random(),
            fingerprint: self.fingerprint.clone(),
            state: RecordState::InFlight,
            generation: 1,
            response: None,
            created_at: self.now,
            started_at: self.now,
            expires_at: self.record_expires_at(),
        }
    }
}

/// A request to reclaim a failed or stale record ([`crate::Store::reclaim`]), to mark a stale one
/// uncertain ([`crate::Store::mark_stale_uncertain`]), or to take an uncertain one over
/// ([`crate::Store::take_over_uncertain`]): each a compare-and-set on the record as read.
#[derive(Debug, Clone, Copy)]
pub struct ReclaimRequest<'a> {
    /// The record as the caller read it; the reclaim succeeds only while the record still has
    /// its `generation`.
    pub record: &'a Record,
    /// The time of the reclaim; it becomes the record's `started_at`.
    pub now: Timestamp,
    /// An in-flight record is stale, and may be reclaimed, once `started_at + in_flight_ttl <=
    /// now`.
    pub in_flight_ttl: Duration,
    /// The new attempt's `now + retention`: the record's `expires_at` becomes the latest of its
    /// own, this and `now + in_flight_ttl` (see [`ReclaimRequest::record_expires_at`]).
    pub expires_at: Timestamp,
}

impl ReclaimRequest<'_> {
    /// The earliest expiry the reclaimed record keeps: `expires_at`, or `now + in_flight_ttl`
    /// if that is later. A store sets the record's expiry to the later of its own and this.
    pub fn record_expires_at(&self) -> Timestamp {
        in_flight_expiry(self.now, self.in_flight_ttl, self.expires_at)
    }
}

/// A renewal of a live claim by the attempt that holds it; see [`crate::Store::heartbeat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    /// The time of the renewal: the record's `started_at` becomes the later of its own and this.
    pub now: Timestamp,
    /// How long the caller honours a claim that nobody renews: the record then expires no
    /// earlier than `now + in_flight_ttl`.
    pub in_flight_ttl: Duration,
    /// The renewing attempt's `now + retention`: the record's `expires_at` becomes the latest of
    /// its own, this and `now + in_flight_ttl` (see [`Renewal::record_expires_at`]).
    pub expires_at: Timestamp,
}

impl Renewal {
    /// The earliest expiry the renewed record keeps: `expires_at`, or `now + in_flight_ttl` if
    /// that is later. A store sets the record's expiry to the later of its own and this.
    pub fn record_expires_at(&self) -> Timestamp {
        in_flight_expiry(self.now, self.in_flight_ttl, self.expires_at)
    }
}

/// The result of [`crate::Store::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller created the record and owns the request.
    Owned(Claim),
    /// A live record exists; the caller does not own it. Use [`Record::decide`].
    Existing(Record),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, IdempotencyKey, Principal};

    fn record(state: RecordState, fp: &str) -> Record {
        let t = now();
        Record {
            scope: Scope::new(Principal::new("p"), Endpoint::new("POST", "/x"), IdempotencyKey::try_from("k").unwrap()),
            record_id: RecordId::random(),
            fingerprint: Fingerprint::from_stored(fp),
            state,
            generation: 1,
            response: (state == RecordState::Completed).then(|| StoredResponse {
                status: 201,
                headers: vec![],
                body: StoredBody::encode(Bytes::from_static(b"{}"), 1024),
            }),
            created_at: t,
            started_at: t,
            expires_at: t + chrono::Duration::hours(1),
        }
    }

    #[test]
    fn decisions() {
        let ttl = Duration::from_secs(300);
        let fp = Fingerprint::from_stored("sha256:a");
        let other = Fingerprint::from_stored("sha256:b");
        let done = record(RecordState::Completed, "sha256:a");
        assert!(matches!(done.decide(&fp, now(), ttl), Decision::Replay(r) if r.status == 201));
        assert_eq!(done.decide(&other, now(), ttl), Decision::Mismatch);

        let flying = record(RecordState::InFlight, "sha256:a");
        match flying.decide(&fp, flying.started_at + chrono::Duration::seconds(10), ttl) {
            Decision::InProgress { retry_after } => assert_eq!(retry_after, Duration::from_secs(290)),
            d => panic!("{d:?}"),
        }
        assert_eq!(flying.decide(&fp, flying.started_at + chrono::Duration::seconds(300), ttl), Decision::Reclaim);
        assert_eq!(flying.decide(&other, now(), ttl), Decision::Mismatch);
        assert_eq!(record(RecordState::Failed, "sha256:a").decide(&fp, now(), ttl), Decision::Reclaim);

        // Uncertain whatever its age: no TTL turns it into a reclaim; a mismatch still wins.
        let unsure = record(RecordState::Uncertain, "sha256:a");
        let much_later = unsure.started_at + chrono::Duration::days(1);
        assert_eq!(unsure.decide(&fp, much_later, ttl), Decision::Uncertain);
        assert!(!unsure.is_stale(much_later, ttl));
        assert_eq!(unsure.decide(&other, now(), ttl), Decision::Mismatch);
    }

    #[test]
    fn a_key_is_free_once_expired_unless_a_live_claim_holds_it() {
        let ttl = Duration::from_secs(300);
        let secs = chrono::Duration::seconds;
        for state in RecordState::ALL {
            let r = record(state, "sha256:a");
            let (t, expiry) = (r.started_at, r.expires_at);
            assert!(!r.is_free(expiry - secs(1), ttl), "{state:?}: not expired yet");
            // Expired an hour after the claim, with the claim five minutes old: stale, free.
            assert!(r.is_free(expiry, ttl), "{state:?}");
            // Expired while the claim is live (a TTL longer than the record's life).
            let live = r.is_free(expiry, Duration::from_secs(7200));
            assert_eq!(live, state != RecordState::InFlight, "{state:?}: only a live claim keeps an expired record");
            assert!(!r.is_free(t, ttl));
        }
    }

    #[test]
    fn an_in_flight_expiry_is_never_before_the_claim_can_go_stale() {
        let ttl = Duration::from_secs(300);
        let t = now();
        let scope =
            Scope::new(Principal::new("p"), Endpoint::new("POST", "/x"), IdempotencyKey::try_from("k").unwrap());
        let req = |retention: i64| ClaimRequest {
            scope: scope.clone(),
            fingerprint: Fingerprint::from_stored("sha256:a"),
            now: t,
            in_flight_ttl: ttl,
            expires_at: t + chrono::Duration::seconds(retention),
        };
        assert_eq!(req(2).new_record().expires_at, t + chrono::Duration::seconds(300), "a short retention");
        assert_eq!(req(3600).new_record().expires_at, t + chrono::Duration::seconds(3600));
        let renewal = Renewal { now: t, in_flight_ttl: ttl, expires_at: t };
        assert_eq!(renewal.record_expires_at(), t + chrono::Duration::seconds(300));
        let forever = Renewal { in_flight_ttl: Duration::MAX, ..renewal };
        assert_eq!(forever.record_expires_at(), DateTime::<Utc>::MAX_UTC, "saturates");
    }

    #[test]
    fn take_replay_agrees_with_decide() {
        let ttl = Duration::from_secs(300);
        let fp = Fingerprint::from_stored("sha256:a");
        for state in RecordState::ALL {
            for stored in ["sha256:a", "sha256:b"] {
                let r = record(state, stored);
                let mut taken = r.clone();
                match (r.decide(&fp, now(), ttl), taken.take_replay(&fp)) {
                    (Decision::Replay(a), Some(b)) => assert_eq!(a, b),
                    (_, None) => assert_eq!(taken, r, "a record that is not replayed is left as it was"),
                    (d, Some(_)) => panic!("{state:?} {stored}: decide says {d:?}, take_replay replays"),
                }
            }
        }
        // A completed record without a response is not replayed by either.
        let mut broken = record(RecordState::Completed, "sha256:a");
        broken.response = None;
        assert!(!matches!(broken.decide(&fp, now(), ttl), Decision::Replay(_)));
        assert_eq!(broken.take_replay(&fp), None);
    }

    #[test]
    fn bodies_round_trip_and_compress_above_the_threshold() {
        let small = Bytes::from_static(b"{\"id\":\"wkr-1\"}");
        let s = StoredBody::encode(small.clone(), 1024);
        assert_eq!(s.encoding(), BodyEncoding::Identity);
        assert_eq!(s.decode().unwrap(), small);

        let big = Bytes::from(b"{\"labels\":\"abcabcabc\"}".repeat(500));
        let b = StoredBody::encode(big.clone(), 1024);
        assert_eq!(b.encoding(), BodyEncoding::Zstd);
        assert!(b.stored_bytes().len() < big.len() / 10);
        assert_eq!(b.decode().unwrap(), big);

        // Incompressible bytes stay as they are.
        let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let n = StoredBody::encode(Bytes::from(noise.clone()), 1024);
        assert_eq!(n.decode().unwrap(), Bytes::from(noise));
    }

    #[test]
    fn a_stored_zstd_bomb_is_refused_without_inflating_it() {
        // 64 MiB of zeros compress to a few KiB; a record carrying them must not decode.
        let bomb = zstd::bulk::compress(&vec![0u8; 64 << 20], 19).unwrap();
        assert!(bomb.len() < 64 << 10, "{}", bomb.len());
        let stored = StoredBody::from_stored(BodyEncoding::Zstd, bomb);
        let err = stored.decode_at_most(1 << 20).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        let fits = StoredBody::encode(Bytes::from(vec![7u8; 4096]), 1024);
        assert_eq!(fits.decode_at_most(4096).unwrap().len(), 4096);
        assert!(fits.decode_at_most(4095).is_err());
        assert!(StoredBody::encode(Bytes::from_static(b"abc"), 1024).decode_at_most(2).is_err());
    }

    #[test]
    fn state_names_round_trip() {
        for s in RecordState::ALL {
            assert_eq!(RecordState::from_stored(s.as_str()), Some(s));
        }
        assert_eq!(RecordState::Uncertain.as_str(), "uncertain");
        let id = RecordId::random();
        assert_eq!(RecordId::from_hex(&id.to_hex()), Some(id));
    }
}
