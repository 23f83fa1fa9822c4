"""The real ``leasebroker`` binary, started on a free port with its own SQLite database."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

TOKEN = "tok-alice-5a8d1c7e90b3"
ADMIN = "tok-admin-77c1e0a9d4f2"
REPO = Path(__file__).resolve().parents[3]


def binary(name: str = "leasebroker", variable: str = "LEASEBROKER_BIN") -> Path:
    """The workspace binary ``name``: ``$variable``, else the workspace's debug build. Missing: the
    test is skipped, loudly, and fails under ``CI=true``."""
    explicit = os.environ.get(variable)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    path = Path(explicit) if explicit else target / "debug" / name
    if not path.is_file():
        reason = f"{name} binary not found at {path} (build it: cargo build -p {name})"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        print(f"SKIPPED: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return path


def metric_total(text: str, name: str, label: str, value: str) -> float:
    """The sum of the Prometheus counter ``name`` over its series whose ``label`` is ``value``, in
    the exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'{label}="{value}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class Leasebroker:
    """A running ``leasebroker serve``; :meth:`stop` ends it."""

    def __init__(self, directory: Path, *extra: str) -> None:
        args = [
            str(binary()),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database",
            f"sqlite://{directory / 'lb.db'}",
            "--token",
            f"{TOKEN}=alice",
            "--admin-token",
            ADMIN,
            *([] if "--pool-nodes" in extra else ["--pool-nodes", "16"]),
            *extra,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        self.url = self._listening(lines)

    def _read(self, lines: queue.Queue[str | None]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            lines.put(line)
        lines.put(None)

    def _listening(self, lines: queue.Queue[str | None]) -> str:
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                self.stop()
                raise AssertionError("leasebroker did not say it listens within 60 s") from None
            if line is None:
                raise AssertionError(f"leasebroker exited: {''.join(self.log)}")
            found = re.search(r"leasebroker listening on (http://\S+)", line)
            if found:
                return found.group(1)

    def admin(self, path: str) -> Any:
        response = httpx.get(self.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        response.raise_for_status()
        return response.json()

    def fleet(self) -> dict[str, int]:
        fleet: dict[str, int] = self.admin("/admin/v1/fleet")
        return fleet

    def in_flight(self) -> int:
        return len(self.admin("/admin/v1/records?state=in_flight")["records"])

    def requests(self, outcome: str) -> float:
        """``idempotency_requests_total{outcome=...}`` from ``/metrics``."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return metric_total(text, "idempotency_requests_total", "outcome", outcome)

    def responses(self, code: str) -> float:
        """``leasebroker_http_responses_total{code=...}`` from ``/metrics``: the answers it sent
        with that status."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return metric_total(text, "leasebroker_http_responses_total", "code", code)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
