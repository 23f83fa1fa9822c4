"""An HTTP client that keeps one ``Idempotency-Key`` per logical operation.

The key of an operation is made once, before its first attempt, and sent on every retry; with an
operation id and a journal, it is written to a SQLite file first, so a rerun after a crash sends the
same key and gets the first run's result instead of doing the work twice::

    from idempotency_client import Client

    with Client("http://127.0.0.1:8080", headers={"Authorization": "Bearer TOKEN"},
                journal="~/.local/state/ci/journal.db") as client:
        worker = client.request("POST", "/v1/workers", json={"image": "base", "cpu": 2, "memory_gb": 4},
                                operation="nightly-ci-4711").json()

Retried: connection errors, timeouts, 5xx, 429 and ``409 request-in-progress``, with exponential
backoff and full jitter, at least as long as ``Retry-After`` asks, within ``max_elapsed``. Never
retried: ``idempotency-key-reused`` (:class:`KeyReused`), 401/403 (:class:`Unauthorized`) and every
other 4xx (:class:`Refused`).
"""

from ._client import AsyncClient, Client
from ._errors import (
    GaveUp,
    IdempotencyError,
    InProgress,
    JournalError,
    KeyExpired,
    KeyReused,
    OperationReused,
    Problem,
    Refused,
    ServerError,
    Unauthorized,
)

__all__ = [
    "AsyncClient",
    "Client",
    "GaveUp",
    "IdempotencyError",
    "InProgress",
    "JournalError",
    "KeyExpired",
    "KeyReused",
    "OperationReused",
    "Problem",
    "Refused",
    "ServerError",
    "Unauthorized",
]
