"""What the tests against real servers share: the client as a process of its own, and waiting for
a state."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .leasebroker import TOKEN

OPERATION = Path(__file__).with_name("operation.py")
WORKER = {"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4, "labels": {"team": "ci"}}


def until(what: str, check: Callable[[], bool], deadline: float = 60.0) -> None:
    """Waits for ``check`` to hold (polling a state, not sleeping a guess)."""
    end = time.monotonic() + deadline
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline:.0f} s")
        time.sleep(0.05)


def operation(
    url: str,
    journal: Path,
    op: str,
    body: dict[str, Any] = WORKER,
    *,
    path: str = "/v1/workers",
    headers: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """The client as a process of its own, making one create (``POST path``, leasebroker's
    ``/v1/workers`` unless given) under ``op``, with ``headers`` besides the bearer token."""
    args = [sys.executable, str(OPERATION), url, TOKEN, str(journal), op, json.dumps(body), "120", path]
    args.append(json.dumps(headers or {}))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, f"client exited {process.returncode}: {out} {err}"
    answer: dict[str, Any] = json.loads(out)
    return answer


def journaled_key(journal: Path, op: str) -> str:
    with sqlite3.connect(journal) as db:
        row = db.execute("SELECT idem_key FROM operations WHERE op_id = ?", (op,)).fetchone()
    assert row is not None, f"{op} is not in {journal}"
    return str(row[0])
