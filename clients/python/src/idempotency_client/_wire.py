"""What goes on the wire and what comes back, without I/O: the body, the fingerprint, the headers."""

from __future__ import annotations

import hashlib
import json
import math
import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

IDEMPOTENCY_KEY = "Idempotency-Key"
IDEMPOTENCY_KEY_EXPIRES = "Idempotency-Key-Expires"
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
#: Set on a response answered from the journal (nothing was sent); its value is when the journal
#: recorded the outcome.
JOURNAL_HEADER = "Idempotency-Client-Journal"
#: The response headers the journal keeps with an outcome, so an answer from the journal carries them.
KEPT_HEADERS = ("content-type", "location", "content-location", "etag", IDEMPOTENCY_KEY_EXPIRES.lower())
#: Methods that are idempotent by nature: retried without a key, never journaled.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def encode_json(value: Any) -> bytes:
    """The body sent for ``json=value``: compact, keys sorted, UTF-8, so one value is always the
    same bytes (the server fingerprints the bytes; a rerun must send exactly what the first run did)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def fingerprint(method: str, path: str, body: bytes) -> str:
    """SHA-256 of the method, the path and the body, as ``sha256:<hex>`` (the Rust SDK's
    ``RequestFingerprint``: the same request gets the same fingerprint in both)."""
    digest = hashlib.sha256()
    # Neither a method nor a path holds a space or a newline, so the framing is unambiguous.
    digest.update(f"{method} {path}\n".encode())
    digest.update(body)
    return f"sha256:{digest.hexdigest()}"


def http_date_epoch(value: str) -> float | None:
    """An HTTP-date (IMF-fixdate, or the obsolete forms) as seconds since the epoch."""
    try:
        parsed = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    return None if parsed.tzinfo is None else parsed.timestamp()


def retry_after(response: httpx.Response, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds: delay-seconds, or an HTTP-date (RFC 9110 10.2.3), never negative."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    at = http_date_epoch(value)
    if at is None:
        return None
    return max(0.0, at - (time.time() if now is None else now))


def key_expires(response: httpx.Response) -> float | None:
    """``Idempotency-Key-Expires`` as seconds since the epoch."""
    value = response.headers.get(IDEMPOTENCY_KEY_EXPIRES)
    return None if value is None else http_date_epoch(value)


def prefer_wait(wait: float) -> str:
    """The ``Prefer`` header for a wait in seconds (RFC 7240 takes whole seconds: rounded up)."""
    if not math.isfinite(wait) or wait < 0:
        raise ValueError(f"wait must be a non-negative number of seconds, got {wait!r}")
    return f"wait={math.ceil(wait)}"


def kept_headers(response: httpx.Response) -> dict[str, str]:
    """The headers of ``response`` that the journal keeps with an outcome."""
    return {name: response.headers[name] for name in KEPT_HEADERS if name in response.headers}
