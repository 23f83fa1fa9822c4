"""The journal: operation id -> key, request fingerprint, the key's expiry and the final outcome.

The key of an operation is written (and committed, ``synchronous=FULL``) before the first attempt
goes out, so a process killed mid-request reruns with the same key. The file is SQLite in WAL mode
with a busy timeout, and a new entry is one ``INSERT .. ON CONFLICT DO NOTHING``: several processes
may share one file, and processes racing on one operation id all get the key of whichever insert won.

Its table is the Rust SDK's (``lbctl --journal``) with two more columns, so either can open a file
the other made: ``outcome_headers`` (the kept response headers, JSON) and ``key_expires_at`` (the
server's ``Idempotency-Key-Expires``, RFC 3339 UTC).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TypeVar

from ._errors import JournalError, OperationReused

#: How long a writer waits for another process's lock before failing.
BUSY_TIMEOUT = 30.0

_COLUMNS = {
    "op_id": "TEXT PRIMARY KEY NOT NULL",
    "idem_key": "TEXT NOT NULL",
    "fingerprint": "TEXT NOT NULL",
    "created_at": "TEXT NOT NULL",
    "outcome_status": "INTEGER",
    "outcome_body": "BLOB",
    "finished_at": "TEXT",
    "outcome_headers": "TEXT",
    "key_expires_at": "TEXT",
}
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS operations ("
    + ", ".join(f"{name} {kind}" for name, kind in _COLUMNS.items())
    + ") STRICT"
)
_NOW = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
_SELECT = (
    "SELECT idem_key, fingerprint, created_at, key_expires_at, outcome_status, outcome_headers, "
    "outcome_body, finished_at FROM operations WHERE op_id = ?"
)
_EPOCH_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True)
class Outcome:
    """The final answer of an operation, as the journal recorded it."""

    status: int
    #: The kept headers (``_wire.KEPT_HEADERS``), lower-case names.
    headers: dict[str, str]
    body: bytes
    #: When it was recorded (RFC 3339, UTC).
    finished_at: str


@dataclass(frozen=True)
class Entry:
    """One operation in the journal."""

    operation: str
    key: str
    fingerprint: str
    created_at: str
    #: The server's ``Idempotency-Key-Expires`` (seconds since the epoch), once an answer carried it.
    key_expires_at: float | None = None
    outcome: Outcome | None = None


class Journal(Protocol):
    """Where a client keeps its operations: a SQLite file, or memory."""

    def begin(self, operation: str, fingerprint: str) -> Entry:
        """The entry of ``operation``, made with a new key if there is none; :class:`OperationReused`
        if it was begun with another request."""
        ...

    def note_expiry(self, operation: str, expires_at: float) -> None:
        """Records the key's expiry on the server."""
        ...

    def finish(self, operation: str, outcome: Outcome) -> None:
        """Records the final outcome."""
        ...

    def close(self) -> None:
        """Releases the file."""
        ...


def new_key() -> str:
    """A fresh key for a new operation (a UUIDv4)."""
    return str(uuid.uuid4())


def _valid_key(key: str) -> bool:
    return 1 <= len(key) <= 128 and all(0x21 <= ord(c) <= 0x7E for c in key)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class MemoryJournal:
    """A journal that lives as long as its client: operation ids hold within one process only."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def begin(self, operation: str, fingerprint: str) -> Entry:
        with self._lock:
            entry = self._entries.setdefault(operation, Entry(operation, new_key(), fingerprint, _now()))
        if entry.fingerprint != fingerprint:
            raise OperationReused(operation)
        return entry

    def note_expiry(self, operation: str, expires_at: float) -> None:
        with self._lock:
            self._entries[operation] = replace(self._entries[operation], key_expires_at=expires_at)

    def finish(self, operation: str, outcome: Outcome) -> None:
        with self._lock:
            recorded = replace(outcome, finished_at=_now())
            self._entries[operation] = replace(self._entries[operation], outcome=recorded)

    def close(self) -> None:
        pass


class SqliteJournal:
    """The journal in a SQLite file (created 0600, its missing directories 0700)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _create_private(self.path)
        self._lock = threading.Lock()
        self._db = _when_busy(lambda: _connect(self.path))

    def begin(self, operation: str, fingerprint: str) -> Entry:
        with self._lock, _database_errors():
            # Insert-or-keep in one statement: of several processes racing here exactly one insert
            # lands, and every one of them then reads that row.
            self._db.execute(
                "INSERT INTO operations (op_id, idem_key, fingerprint, created_at) "
                f"VALUES (?, ?, ?, {_NOW}) ON CONFLICT (op_id) DO NOTHING",
                (operation, new_key(), fingerprint),
            )
            row = self._db.execute(_SELECT, (operation,)).fetchone()
        entry = _entry(operation, row)
        if entry.fingerprint != fingerprint:
            raise OperationReused(operation)
        return entry

    def note_expiry(self, operation: str, expires_at: float) -> None:
        stamp = time.strftime(_EPOCH_FORMAT, time.gmtime(expires_at))
        self._update(operation, "key_expires_at = ?", (stamp,))

    def finish(self, operation: str, outcome: Outcome) -> None:
        self._update(
            operation,
            f"outcome_status = ?, outcome_headers = ?, outcome_body = ?, finished_at = {_NOW}",
            (outcome.status, json.dumps(outcome.headers), outcome.body),
        )

    def _update(self, operation: str, assignments: str, values: tuple[object, ...]) -> None:
        with self._lock, _database_errors():
            done = self._db.execute(
                f"UPDATE operations SET {assignments} WHERE op_id = ?", (*values, operation)
            )
        if done.rowcount == 0:
            raise JournalError(f"operation {operation!r} is not in the journal {self.path}")

    def close(self) -> None:
        with self._lock:
            self._db.close()


@contextmanager
def _database_errors() -> Iterator[None]:
    """Turns a database failure (locked past the busy timeout, disk full) into a JournalError."""
    try:
        yield
    except sqlite3.Error as error:
        raise JournalError(f"journal database error: {error}") from error


def _entry(operation: str, row: tuple[object, ...] | None) -> Entry:
    if row is None:
        raise JournalError(f"operation {operation!r} vanished from the journal")
    key, fingerprint, created_at, expires, status, headers, body, finished_at = row
    if not isinstance(key, str) or not _valid_key(key):
        raise JournalError(f"operation {operation!r} has a corrupt key in the journal")
    outcome = None
    if isinstance(status, int) and isinstance(finished_at, str):
        outcome = Outcome(
            status=status,
            headers=json.loads(headers) if isinstance(headers, str) else {},
            body=body if isinstance(body, bytes) else b"",
            finished_at=finished_at,
        )
    expires_at = None
    if isinstance(expires, str):
        expires_at = datetime.strptime(expires, _EPOCH_FORMAT).replace(tzinfo=UTC).timestamp()
    return Entry(operation, key, str(fingerprint), str(created_at), expires_at, outcome)


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before begin() returns, even across a power cut.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("BEGIN IMMEDIATE")
        db.execute(_SCHEMA)
        present = {row[1] for row in db.execute("PRAGMA table_info(operations)")}
        for name, kind in _COLUMNS.items():
            if name not in present:  # a file the Rust SDK made: add this client's columns
                db.execute(f"ALTER TABLE operations ADD COLUMN {name} {kind}")
        db.execute("COMMIT")
    except BaseException:
        db.close()
        raise
    return db


_T = TypeVar("_T")


def _when_busy(make: Callable[[], _T]) -> _T:
    """Processes opening a fresh file together race to switch it to WAL and to create the table, and
    SQLite answers some of those races with SQLITE_BUSY at once, without waiting on the busy
    timeout. Opening again a moment later finds the winner's work done."""
    deadline = time.monotonic() + BUSY_TIMEOUT
    delay = 0.005
    while True:
        try:
            return make()
        except sqlite3.OperationalError as error:
            busy = error.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() + delay > deadline:
                raise JournalError(f"journal database error: {error}") from error
        except sqlite3.Error as error:
            raise JournalError(f"journal database error: {error}") from error
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _create_private(path: Path) -> None:
    """Creates the missing directories (0700) and the file (0600) before SQLite opens it, so the keys
    and responses in it are never readable by others, not even for a moment. An existing directory
    keeps its mode; an existing file that group or others may read or write is refused."""
    try:
        missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        for directory in reversed(missing):
            directory.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    except OSError as error:
        raise JournalError(f"cannot create {path}: {error}") from error
    for suffix in ("", "-wal", "-shm"):
        file = Path(f"{path}{suffix}")
        try:
            mode = stat.S_IMODE(file.stat().st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            raise JournalError(
                f"{file} is readable or writable by group or others (mode {mode:03o}); "
                f"make it owner-only with `chmod 600 {file}`"
            )
