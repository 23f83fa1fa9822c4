"""One call's decisions, shared by the sync and the async client: what to send, whether and when to
retry, what the journal records, and how an answer from the journal is made. No I/O here."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

from . import _wire
from ._errors import GaveUp, KeyExpired, KeyReused, Refused, _RetryableAnswer, classify, is_retryable
from ._journal import Entry, Journal, Outcome, new_key

#: The backoff cap of the first retry; each retry doubles it up to MAX_DELAY (the Rust SDK's values).
MIN_DELAY = 0.2
#: The largest backoff cap.
MAX_DELAY = 30.0


@dataclass(frozen=True)
class Prepared:
    """A request as it goes out on every attempt, and its fingerprint."""

    method: str
    path: str
    content: bytes | None
    headers: dict[str, str]
    fingerprint: str
    #: The longest the server may hold it (``Prefer: wait``), added to each attempt's timeout.
    wait: float

    @property
    def mutating(self) -> bool:
        return self.method not in _wire.SAFE_METHODS


def prepare(method: str, path: str, body: Any, operation: str | None, wait: float | None) -> Prepared:
    method = method.upper()
    if not path.startswith("/"):
        raise ValueError(f"path must start with '/', got {path!r}")
    if operation is not None and (method in _wire.SAFE_METHODS or not operation):
        raise ValueError(f"an operation id names a mutation (POST, PUT, PATCH, DELETE), not {method}")
    content = None if body is None else _wire.encode_json(body)
    headers = {"Accept": "application/json"}
    if content is not None:
        headers["Content-Type"] = "application/json"
    if wait is not None:
        headers["Prefer"] = _wire.prefer_wait(wait)
    fingerprint = _wire.fingerprint(method, path, content or b"")
    return Prepared(method, path, content, headers, fingerprint, float(wait or 0))


class Attempts:
    """The retries of one call: the key, the budget, the backoff and the key's expiry."""

    def __init__(self, key: str | None, max_elapsed: float, timeout: float, expires_at: float | None) -> None:
        self.key = key
        self.max_elapsed = max_elapsed
        self.timeout = timeout
        #: When the server forgets the key (``Idempotency-Key-Expires``), seconds since the epoch.
        self.expires_at = expires_at
        self.count = 0
        self._start = time.monotonic()
        self._cap = MIN_DELAY

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def begin(self, request: Prepared) -> tuple[dict[str, str], float]:
        """Before an attempt: its headers and its timeout. Raises :class:`KeyExpired` when the server
        has forgotten the key: sent now, it would run the operation a second time."""
        if self.key is not None and self.expires_at is not None and time.time() >= self.expires_at:
            raise KeyExpired(self.key, self.expires_at)
        self.count += 1
        headers = dict(request.headers)
        if self.key is not None:
            headers[_wire.IDEMPOTENCY_KEY] = self.key
        remaining = self.max_elapsed - self.elapsed()
        return headers, max(0.001, min(self.timeout + request.wait, remaining))

    def note(self, response: httpx.Response) -> bool:
        """Takes the key's expiry from an answer; whether it changed."""
        expires = _wire.key_expires(response)
        if expires is None or expires == self.expires_at or self.key is None:
            return False
        self.expires_at = expires
        return True

    def pause(self, error: Exception) -> float:
        """The wait before the next attempt after ``error``. Raises ``error`` when it is final,
        :class:`GaveUp` when the budget has no room for another attempt, :class:`KeyExpired` when
        the key expires before then."""
        if not is_retryable(error):
            raise error
        jittered = random.uniform(0, self._cap)  # full jitter
        self._cap = min(self._cap * 2, MAX_DELAY)
        asked = error.retry_after if isinstance(error, _RetryableAnswer) else None
        # The server knows when it will be ready: waiting less than it asked only earns another 503.
        wait = jittered if asked is None else max(jittered, asked)
        # An attempt that starts at the deadline has no time left to run.
        if self.elapsed() + wait >= self.max_elapsed:
            raise GaveUp(self.count, self.elapsed(), error)
        if self.key is not None and self.expires_at is not None and time.time() + wait >= self.expires_at:
            raise KeyExpired(self.key, self.expires_at)
        return wait

    def answered(self, response: httpx.Response) -> Exception | None:
        """The error an answer is (``None`` for a 2xx)."""
        return classify(response, _wire.retry_after(response))


def final_outcome(response: httpx.Response, error: Exception | None) -> Outcome | None:
    """What the journal records of an answer: a success, or a refusal that no retry changes (a 4xx,
    a reused key). Not a 401/403 (the caller may fix the credentials) and nothing retryable: after
    a give-up the outcome is unknown, and a rerun finds it out with the same key."""
    if error is not None and not isinstance(error, Refused | KeyReused):
        return None
    return Outcome(response.status_code, _wire.kept_headers(response), response.content, finished_at="")


def from_journal(outcome: Outcome, request: httpx.Request) -> httpx.Response:
    """The answer the journal holds, as the response it was: its status, its kept headers (with
    ``Idempotent-Replayed: true`` and ``Idempotency-Client-Journal: <when recorded>``) and its body.
    A recorded refusal is raised again, as it was raised the first time."""
    headers = {
        **outcome.headers,
        _wire.IDEMPOTENT_REPLAYED: "true",
        _wire.JOURNAL_HEADER: outcome.finished_at,
    }
    response = httpx.Response(outcome.status, headers=headers, content=outcome.body, request=request)
    error = classify(response, None)
    if error is not None:
        raise error
    return response


@dataclass(frozen=True)
class Send:
    """Effect: send the request with these headers and timeout; the driver answers with the
    response, or with the :class:`httpx.TransportError` it raised."""

    request: Prepared
    headers: dict[str, str]
    timeout: float


@dataclass(frozen=True)
class Sleep:
    """Effect: wait this many seconds."""

    seconds: float


@dataclass(frozen=True)
class Journaled:
    """Effect: a journal call (it may block on another process's lock); the driver answers with its
    result."""

    call: Callable[..., Any]
    args: tuple[Any, ...]


Effect = Send | Sleep | Journaled
#: One call, as the effects it needs; the sync and the async client each drive it with their I/O.
Plan = Generator[Effect, object, httpx.Response]


def plan(
    journal: Journal,
    request: Prepared,
    url: httpx.URL,
    operation: str | None,
    budget: tuple[float, float],
) -> Plan:
    """The whole of one call: the journal's key (or a key for this call alone), an answer from the
    journal when it holds the final outcome, then attempts until one is final or the budget ends.
    ``url`` is the request's whole URL; ``budget`` is ``(max_elapsed, timeout)``."""
    max_elapsed, timeout = budget
    if operation is not None:
        entry = yield Journaled(journal.begin, (operation, request.fingerprint))
        assert isinstance(entry, Entry)
        if entry.outcome is not None:
            return from_journal(entry.outcome, httpx.Request(request.method, url))
        attempts = Attempts(entry.key, max_elapsed, timeout, entry.key_expires_at)
    else:
        # Without an operation id the key lives for this call's retries only.
        attempts = Attempts(new_key() if request.mutating else None, max_elapsed, timeout, None)
    while True:
        result = yield Send(request, *attempts.begin(request))
        if not isinstance(result, httpx.Response):
            assert isinstance(result, httpx.TransportError)
            yield Sleep(attempts.pause(result))
            continue
        if attempts.note(result) and operation is not None:
            yield Journaled(journal.note_expiry, (operation, attempts.expires_at))
        error = attempts.answered(result)
        outcome = final_outcome(result, error)
        if operation is not None and outcome is not None:
            yield Journaled(journal.finish, (operation, outcome))
        if error is None:
            return result
        yield Sleep(attempts.pause(error))
