"""The errors a request can end with, shaped by what the caller does next, and RFC 9457 problems."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from typing import Any

import httpx

#: The problem a server sends when a key comes back with a different request (status 409, 422 or 400).
KEY_REUSED = "idempotency-key-reused"
#: The problem a server sends while the first request with a key is still running (status 409).
IN_PROGRESS = "request-in-progress"


@dataclass(frozen=True)
class Problem:
    """An RFC 9457 problem details object, as a server sends it with ``application/problem+json``."""

    #: A URI naming the problem; its last path segment is the short name (:attr:`name`).
    type: str = "about:blank"
    title: str | None = None
    status: int | None = None
    detail: str | None = None
    #: The whole object as received, extension members included.
    members: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The short name: the last ``/``-separated segment of :attr:`type` (``idempotency-key-reused``)."""
        return self.type.rsplit("/", 1)[-1]

    @classmethod
    def from_body(cls, body: bytes) -> Problem | None:
        """Parses a response body; ``None`` when it is not a JSON object."""
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(value, dict):
            return None

        def text(name: str) -> str | None:
            member = value.get(name)
            return member if isinstance(member, str) else None

        status = value.get("status")
        return cls(
            type=text("type") or "about:blank",
            title=text("title"),
            status=status if isinstance(status, int) and not isinstance(status, bool) else None,
            detail=text("detail"),
            members=value,
        )

    def __str__(self) -> str:
        text = self.detail or self.title
        return f"{self.name}: {text}" if text else self.name


class IdempotencyError(Exception):
    """The base of every error this package raises."""


class _AnsweredError(IdempotencyError):
    """An error that is a server's answer: its status, its parsed problem, and the response."""

    _what = "answered"

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status: int = response.status_code
        self.problem: Problem | None = Problem.from_body(response.content)
        what = f"{self._what} ({self.status})"
        super().__init__(f"{what}: {self.problem}" if self.problem else what)


class KeyReused(_AnsweredError):
    """The key was first used with a different request (problem ``idempotency-key-reused``, whatever
    its status: 409, 422 or 400). A bug in the caller: never retried."""

    _what = "idempotency key reused with a different request"


class Refused(_AnsweredError):
    """The server made a permanent decision against the request (a 4xx such as 400, 404, 409 or 422).
    Never retried."""

    _what = "refused"


class Unauthorized(_AnsweredError):
    """The credentials were missing, wrong or not allowed (401 or 403). Never retried."""

    _what = "unauthorized"


class _RetryableAnswer(_AnsweredError):
    def __init__(self, response: httpx.Response, retry_after: float | None) -> None:
        super().__init__(response)
        #: How long the server asked to wait (``Retry-After``), in seconds.
        self.retry_after = retry_after


class ServerError(_RetryableAnswer):
    """The server failed or shed load (5xx or 429): retried, and found in :attr:`GaveUp.last` when the
    budget ran out."""

    _what = "server error"


class InProgress(_RetryableAnswer):
    """The first request with this key is still running on the server (409 ``request-in-progress``):
    retried, and found in :attr:`GaveUp.last` when the budget ran out."""

    _what = "in progress"


class GaveUp(IdempotencyError):
    """The budget (``max_elapsed``) ran out while the errors were retryable. The operation may or may
    not have happened: run it again with the same operation id to find out."""

    def __init__(self, attempts: int, elapsed: float, last: Exception) -> None:
        super().__init__(f"gave up after {attempts} attempts in {elapsed:.1f}s; last error: {last}")
        self.attempts = attempts
        self.elapsed = elapsed
        #: The last attempt's error: :class:`ServerError`, :class:`InProgress` or an
        #: :class:`httpx.TransportError` (connection refused or reset, timeout).
        self.last = last


class KeyExpired(IdempotencyError):
    """The server's record of the key has expired (its ``Idempotency-Key-Expires`` has passed), so a
    request with it would run as a new operation: it is never sent again. Whether the operation
    happened is for the caller to find out; a new attempt needs a new operation id."""

    def __init__(self, key: str, expired_at: float) -> None:
        super().__init__(f"idempotency key {key} expired on the server; not sent (use a new operation id)")
        self.key = key
        #: When the key expired, in seconds since the epoch.
        self.expired_at = expired_at


class OperationReused(IdempotencyError):
    """The operation id is journaled for a different request (method, path or body): its key would
    be refused by the server, or worse, answered with the other request's result. Nothing was sent."""

    def __init__(self, operation: str) -> None:
        super().__init__(
            f"operation {operation!r} was first used with a different request; not sent "
            "(use a new operation id)"
        )
        self.operation = operation


class JournalError(IdempotencyError):
    """The journal cannot be used: an existing file readable or writable by group or others, a
    damaged entry, or a database failure."""


def classify(response: httpx.Response, retry_after: float | None) -> IdempotencyError | None:
    """The error a complete response is; ``None`` for a success (2xx).

    The problem type decides before the status does: the reused-key status is configurable on the
    server (409, 422 or 400), and 409 also means "in progress" or a conflict the handler decided.
    """
    status = response.status_code
    if 200 <= status < 300:
        return None
    problem = Problem.from_body(response.content)
    if problem is not None and problem.name == KEY_REUSED:
        return KeyReused(response)
    if status == 409 and problem is not None and problem.name == IN_PROGRESS:
        return InProgress(response, retry_after)
    if status in (401, 403):
        return Unauthorized(response)
    if status == 429 or status >= 500:
        return ServerError(response, retry_after)
    return Refused(response)


def is_retryable(error: Exception) -> bool:
    """Whether sending the same request again, with the same key, may succeed."""
    return isinstance(error, _RetryableAnswer) or _is_retryable_transport(error)


def _is_retryable_transport(error: Exception) -> bool:
    # A TLS failure is not retried: an untrusted certificate does not become trusted by asking again.
    if not isinstance(error, httpx.TransportError) or isinstance(
        error, httpx.UnsupportedProtocol | httpx.ProxyError
    ):
        return False
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return False
        cause = cause.__cause__ or cause.__context__
    return True
