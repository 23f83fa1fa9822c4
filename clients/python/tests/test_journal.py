"""The journal file: private on creation, refused when exposed, readable in the Rust SDK's layout."""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import stat
from pathlib import Path

import pytest

from idempotency_client import Client, JournalError

from .scripted import created, scripted

# The table of the Rust SDK's journal (lbctl), read from its source.
RUST_JOURNAL = Path(__file__).resolve().parents[3] / "crates/leasebroker-client/src/journal.rs"


def rust_schema() -> str:
    found = re.search(r'const SCHEMA: &str = "([^"]+)";', RUST_JOURNAL.read_text())
    assert found, f"no SCHEMA in {RUST_JOURNAL}"
    return found.group(1)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_creates_the_file_0600_in_new_directories_0700(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ci" / "journal.db"
    with scripted([created({})]) as api, Client(api.url, journal=path) as client:
        client.request("POST", "/v1/things", json={}, operation="op-1")
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    assert mode(path.parent.parent) == 0o700
    for suffix in ("-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            assert mode(side) & 0o077 == 0


@pytest.mark.parametrize("exposed", [0o644, 0o660, 0o604])
def test_refuses_a_journal_others_can_read_or_write(tmp_path: Path, exposed: int) -> None:
    path = tmp_path / "journal.db"
    Client("http://127.0.0.1:9", journal=path).close()
    os.chmod(path, exposed)
    with pytest.raises(JournalError) as raised:
        Client("http://127.0.0.1:9", journal=path)
    message = str(raised.value)
    assert str(path) in message
    assert f"chmod 600 {path}" in message
    assert "\n" not in message


def test_opens_a_journal_in_the_rust_sdk_layout(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    body = b'{"n":1}'
    # The documented fingerprint: SHA-256 of "METHOD PATH\n" and the body.
    fingerprint = "sha256:" + hashlib.sha256(b"POST /v1/things\n" + body).hexdigest()
    with sqlite3.connect(path) as db:
        db.execute(rust_schema())
        db.execute(
            "INSERT INTO operations (op_id, idem_key, fingerprint, created_at) VALUES (?, ?, ?, ?)",
            ("op-1", "key-made-by-lbctl", fingerprint, "2026-01-01T00:00:00.000Z"),
        )
    with scripted([created({"id": "t"})]) as api, Client(api.url, journal=path) as client:
        client.request("POST", "/v1/things", json={"n": 1}, operation="op-1")
        again = client.request("POST", "/v1/things", json={"n": 1}, operation="op-1")
    assert api.keys == ["key-made-by-lbctl"]
    assert api.arrivals[0].body == body
    assert again.headers["idempotency-client-journal"]


def test_a_damaged_key_is_an_error_not_a_send(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with scripted([created({})]) as api:
        with Client(api.url, journal=path) as client:
            client.request("POST", "/v1/things", json={}, operation="op-1")
        with sqlite3.connect(path) as db:
            db.execute("UPDATE operations SET idem_key = 'has space', outcome_status = NULL")
        with Client(api.url, journal=path) as client, pytest.raises(JournalError):
            client.request("POST", "/v1/things", json={}, operation="op-1")
    assert len(api.arrivals) == 1


# The fingerprint of the quick start's request (both READMEs): the TypeScript suite checks the same
# value, so the two clients fingerprint one request alike.
QUICK_START_FINGERPRINT = "sha256:1c18cda41ba53ada6b1e907130c7025b461a19f9d944ba3f33a374d396cd76d4"


def test_the_fingerprint_is_the_documented_one(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    body = {"image": "worker-base:2025.11", "cpu": 16, "memory_gb": 64}
    with scripted([created({})]) as api, Client(api.url, journal=path) as client:
        client.request("POST", "/v1/workers", json=body, operation="nightly-ci-4711")
    with sqlite3.connect(path) as db:
        (fingerprint,) = db.execute("SELECT fingerprint FROM operations").fetchone()
    assert fingerprint == QUICK_START_FINGERPRINT
    assert api.arrivals[0].body == b'{"cpu":16,"image":"worker-base:2025.11","memory_gb":64}'
