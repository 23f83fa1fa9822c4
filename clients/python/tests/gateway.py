"""The real ``idempotency-gateway`` binary in front of an upstream service that counts its own
executions (the gateway's test upstream, ``crates/idempotency-gateway/tests/upstreams/upstream.py``),
each on a free port."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
from typing import Any

import httpx

from .leasebroker import REPO, binary, metric_total

UPSTREAM = REPO / "crates" / "idempotency-gateway" / "tests" / "upstreams" / "upstream.py"
ADMIN = "tok-gateway-admin-3e9b51c0"


class Process:
    """A child process whose output is read line by line; :meth:`stop` kills it."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def printed(self, pattern: str) -> str:
        """The first group of ``pattern`` in the first line that matches it (within 60 s)."""
        while True:
            try:
                line = self.lines.get(timeout=60)
            except queue.Empty:
                self.stop()
                raise AssertionError(f"{self.name} printed no {pattern!r} within 60 s") from None
            if line is None:
                raise AssertionError(f"{self.name} exited: {''.join(self.log)}")
            found = re.search(pattern, line)
            if found:
                return found.group(1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


class Gateway:
    """``idempotency-gateway`` with a memory record store in front of a counting upstream, both
    running; :meth:`stop` ends both (:meth:`stop_gateway` only the gateway)."""

    def __init__(self, *extra: str) -> None:
        self.upstream = Process("the upstream", [sys.executable, str(UPSTREAM), "--listen", "127.0.0.1:0"])
        self.upstream_url = self.upstream.printed(r"listening on (http://\S+)")
        args = [
            str(binary("idempotency-gateway", "GATEWAY_BIN")),
            "--upstream",
            self.upstream_url,
            "--record-store",
            "memory",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--admin-token",
            ADMIN,
            *extra,
        ]
        self.gateway = Process("idempotency-gateway", args)
        self.admin_url = self.gateway.printed(r"admin on (http://\S+)")
        self.url = self.gateway.printed(r"idempotency-gateway listening on (http://\S+)")

    def executions(self) -> int:
        """How many requests the upstream itself ran."""
        count: dict[str, Any] = httpx.get(self.upstream_url + "/__count", timeout=30).json()
        return int(count["executions"])

    def in_flight(self) -> list[dict[str, Any]]:
        response = httpx.get(
            self.admin_url + "/admin/v1/records?state=in_flight",
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=30,
        )
        response.raise_for_status()
        records: list[dict[str, Any]] = response.json()["records"]
        return records

    def requests(self, outcome: str) -> float:
        """``idempotency_requests_total{outcome=...}`` from the admin listener's ``/metrics``."""
        text = httpx.get(self.admin_url + "/metrics", timeout=30).text
        return metric_total(text, "idempotency_requests_total", "outcome", outcome)

    def stop_gateway(self) -> None:
        self.gateway.stop()

    def stop(self) -> None:
        self.gateway.stop()
        self.upstream.stop()
