"""Runs each client test through the sync ``Client`` and the async ``AsyncClient`` alike."""

from __future__ import annotations

from typing import Any, Protocol

import anyio
import httpx
import pytest

from idempotency_client import AsyncClient, Client


class Call(Protocol):
    def __call__(self, url: str, method: str, path: str, **options: Any) -> httpx.Response: ...


CLIENT_SETTINGS = ("journal", "max_elapsed", "headers")


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest) -> Call:
    """One request through a fresh client of the kind under test (its journal closed afterwards).
    ``journal``, ``max_elapsed`` and ``headers`` go to the client (``max_elapsed`` 60 s unless
    given), everything else to ``request``."""
    kind = request.param

    def call(url: str, method: str, path: str, **options: Any) -> httpx.Response:
        settings: dict[str, Any] = {"max_elapsed": 60.0}
        settings.update({name: options.pop(name) for name in CLIENT_SETTINGS if name in options})
        if kind == "sync":
            with Client(url, **settings) as client:
                return client.request(method, path, **options)

        async def run() -> httpx.Response:
            async with AsyncClient(url, **settings) as client:
                return await client.request(method, path, **options)

        return anyio.run(run)

    return call
