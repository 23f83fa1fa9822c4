"""``Client`` and ``AsyncClient``: one plan per call (``_call.plan``), driven with blocking I/O or with
async I/O."""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any, Self

import anyio.to_thread
import httpx

from ._call import Effect, Journaled, Plan, Send, Sleep, plan, prepare
from ._journal import Journal, MemoryJournal, SqliteJournal

_USER_AGENT = "idempotency-client-python/0.1.0"


class _Base:
    _http: httpx.Client | httpx.AsyncClient

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        journal: str | os.PathLike[str] | None = None,
        max_elapsed: float = 600.0,
        timeout: float = 30.0,
    ) -> None:
        if max_elapsed <= 0 or timeout <= 0:
            raise ValueError("max_elapsed and timeout are positive numbers of seconds")
        self.max_elapsed = max_elapsed
        self.timeout = timeout
        self._journal: Journal = MemoryJournal() if journal is None else SqliteJournal(journal)
        # Redirects are not followed: a followed redirect would send a mutation somewhere else.
        self._http = self._connect(
            base_url=base_url, headers={"User-Agent": _USER_AGENT, **(headers or {})}, follow_redirects=False
        )

    def _connect(self, **settings: Any) -> httpx.Client | httpx.AsyncClient:
        raise NotImplementedError

    def _plan(self, method: str, path: str, body: Any, operation: str | None, wait: float | None) -> Plan:
        prepared = prepare(method, path, body, operation, wait)
        url = self._http.build_request(prepared.method, path).url
        return plan(self._journal, prepared, url, operation, (self.max_elapsed, self.timeout))

    @staticmethod
    def _send_args(send: Send) -> dict[str, Any]:
        return {
            "method": send.request.method,
            "url": send.request.path,
            "content": send.request.content,
            "headers": send.headers,
            "timeout": send.timeout,
        }


class Client(_Base):
    """Sends every mutation with one ``Idempotency-Key`` per logical operation and retries it
    safely; with ``journal``, the key of a named operation survives a restart of the process.

    ``Client(base_url, *, headers=None, journal=None, max_elapsed=600.0, timeout=30.0)``: ``headers``
    go with every request, ``journal`` is the path of the SQLite journal (``None``: memory, for this
    client's life), ``max_elapsed`` is the budget of one call in seconds, retries included, and
    ``timeout`` that of one attempt."""

    _http: httpx.Client

    def _connect(self, **settings: Any) -> httpx.Client:
        return httpx.Client(**settings)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        operation: str | None = None,
        wait: float | None = None,
    ) -> httpx.Response:
        """Sends ``method path`` (``json`` as its body) until it succeeds, is refused, or the budget
        runs out; with ``operation``, under the journal's key for that operation."""
        steps = self._plan(method, path, json, operation, wait)
        answer: object = None
        while True:
            try:
                effect = steps.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            answer = self._run(effect)

    def _run(self, effect: Effect) -> object:
        if isinstance(effect, Sleep):
            time.sleep(effect.seconds)
            return None
        if isinstance(effect, Journaled):
            return effect.call(*effect.args)
        try:
            return self._http.request(**self._send_args(effect))
        except httpx.TransportError as error:
            return error

    def close(self) -> None:
        """Closes the connections and the journal."""
        self._http.close()
        self._journal.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_Base):
    """:class:`Client` on async I/O (asyncio or trio); the journal is used from a worker thread."""

    _http: httpx.AsyncClient

    def _connect(self, **settings: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**settings)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        operation: str | None = None,
        wait: float | None = None,
    ) -> httpx.Response:
        """:meth:`Client.request`, awaited."""
        steps = self._plan(method, path, json, operation, wait)
        answer: object = None
        while True:
            try:
                effect = steps.send(answer)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            answer = await self._run(effect)

    async def _run(self, effect: Effect) -> object:
        if isinstance(effect, Sleep):
            await anyio.sleep(effect.seconds)
            return None
        if isinstance(effect, Journaled):
            return await anyio.to_thread.run_sync(effect.call, *effect.args)
        try:
            return await self._http.request(**self._send_args(effect))
        except httpx.TransportError as error:
            return error

    async def aclose(self) -> None:
        """Closes the connections and the journal."""
        await self._http.aclose()
        await anyio.to_thread.run_sync(self._journal.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
