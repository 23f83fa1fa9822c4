"""Runs each client test through the sync ``Client`` and the async ``AsyncClient`` alike."""

from __future__ import annotations

import os
from typing import Any, Protocol

import anyio
import httpx
import pytest

from idempotency_client import AsyncClient, Client


class Call(Protocol):
    def __call__(
        self,
        url: str,
        method: str,
        path: str,
        *,
        journal: str | os.PathLike[str] | None = None,
        max_elapsed: float = 60.0,
        headers: dict[str, str] | None = None,
        **request: Any,
    ) -> httpx.Response: ...


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest) -> Call:
    """One request through a fresh client of the kind under test (its journal closed afterwards)."""
    kind = request.param

    def call(
        url: str,
        method: str,
        path: str,
        *,
        journal: str | os.PathLike[str] | None = None,
        max_elapsed: float = 60.0,
        headers: dict[str, str] | None = None,
        **options: Any,
    ) -> httpx.Response:
        settings: dict[str, Any] = {"journal": journal, "max_elapsed": max_elapsed, "headers": headers}
        if kind == "sync":
            with Client(url, **settings) as client:
                return client.request(method, path, **options)

        async def run() -> httpx.Response:
            async with AsyncClient(url, **settings) as client:
                return await client.request(method, path, **options)

        return anyio.run(run)

    return call
