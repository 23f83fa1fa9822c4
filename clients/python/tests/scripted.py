"""A scripted HTTP API on loopback (standard library only): it answers each request with the next
reply of its script and records what arrived, when, and with which key."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Close the connection without answering: the answer is lost.
DROP = "drop"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def problem(status: int, name: str, **headers: str) -> Reply:
    """An RFC 9457 problem reply; keyword headers use ``_`` for ``-`` (``retry_after="1"``)."""
    body = json.dumps({"type": f"/problems/{name}", "title": name, "status": status}).encode()
    named = {k.replace("_", "-").title(): v for k, v in headers.items()}
    return Reply(status, {"Content-Type": "application/problem+json", **named}, body)


def created(body: object, **headers: str) -> Reply:
    named = {k.replace("_", "-").title(): v for k, v in headers.items()}
    return Reply(201, {"Content-Type": "application/json", **named}, json.dumps(body).encode())


@dataclass(frozen=True)
class Arrival:
    at: float  # time.monotonic()
    wall: float  # time.time()
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def key(self) -> str | None:
        return self.headers.get("idempotency-key")


Step = Reply | str | Callable[[Arrival], Reply]


class _Server(ThreadingHTTPServer):
    connections = 0

    def verify_request(self, request: object, client_address: object) -> bool:
        self.connections += 1  # one thread accepts: no lock needed
        return True


class Scripted:
    """The server: ``replies`` answer the first, second, ... request; the last one repeats. A reply
    is a :class:`Reply`, :data:`DROP`, or a function of the arrival that makes one."""

    def __init__(self, replies: list[Step]) -> None:
        self.replies = replies
        self.arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _next(self, arrival: Arrival) -> Reply | str:
        with self._lock:
            self.arrivals.append(arrival)
            step = self.replies[min(len(self.arrivals), len(self.replies)) - 1]
        return step if isinstance(step, Reply | str) else step(arrival)

    @property
    def connections(self) -> int:
        """TCP connections accepted (a TLS handshake that fails is one, with no arrival)."""
        return self._server.connections

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                arrival = Arrival(time.monotonic(), time.time(), self.command, self.path, headers, body)
                reply = scripted._next(arrival)
                if isinstance(reply, str):
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    @property
    def keys(self) -> list[str | None]:
        return [a.key for a in self.arrivals]


@contextmanager
def scripted(replies: list[Step]) -> Iterator[Scripted]:
    server = Scripted(replies)
    thread = threading.Thread(target=server._server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server._server.shutdown()
        server._server.server_close()
