"""Against the real ``idempotency-gateway`` in front of a service that counts what it ran: one
execution per operation, whatever happens to the client."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from idempotency_client import GaveUp, KeyReused, OperationReused

from .conftest import Call
from .gateway import Gateway
from .support import journaled_key, operation, result, until

# The gateway's principal is the bearer credential (hashed): any token names a tenant.
AUTH = {"Authorization": "Bearer tok-gateway-tenant-1"}
ORDER = {"item": "rack-7", "count": 2}
SLOW = {"X-Upstream-Delay-Ms": "3000"}


@pytest.fixture
def gateway(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    marker = request.node.get_closest_marker("gateway")
    server = Gateway(*(marker.args if marker else ()))
    yield server
    server.stop()


def test_a_rerun_after_the_final_outcome_answers_from_the_journal(
    call: Call, gateway: Gateway, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    first = call(gateway.url, "POST", "/orders", json=ORDER, operation="gw-1", journal=journal, headers=AUTH)
    assert first.status_code == 201
    assert gateway.executions() == 1
    gateway.stop_gateway()  # anything sent now fails, and would end in GaveUp after max_elapsed
    again = call(
        gateway.url,
        "POST",
        "/orders",
        json=ORDER,
        operation="gw-1",
        journal=journal,
        headers=AUTH,
        max_elapsed=2,
    )
    assert again.status_code == 201
    assert again.json() == first.json()
    assert again.headers["location"] == first.headers["location"]
    assert again.headers["idempotency-client-journal"]
    assert gateway.executions() == 1


def test_a_client_killed_mid_operation_and_rerun_makes_one_execution(
    gateway: Gateway, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    # The upstream holds its answer 3 s after it ran the request (a header the client sends on
    # every attempt, outside the fingerprint): kill the client while it waits.
    child = operation(gateway.url, journal, "gw-kill", ORDER, path="/orders", headers=SLOW)
    until("the request reached the upstream", lambda: gateway.executions() == 1)
    assert len(gateway.in_flight()) == 1
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    in_flight_key = gateway.in_flight()[0]["key"]
    assert journaled_key(journal, "gw-kill") == in_flight_key, "the key was journaled before it was sent"

    rerun = result(operation(gateway.url, journal, "gw-kill", ORDER, path="/orders", headers=SLOW))
    assert rerun["status"] == 201
    assert rerun["body"]["order"] == 1, rerun
    assert gateway.executions() == 1, "the operation ran twice behind the gateway"


def test_another_request_under_an_operation_is_refused_locally(
    call: Call, gateway: Gateway, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    call(gateway.url, "POST", "/orders", json=ORDER, operation="gw-1", journal=journal, headers=AUTH)
    bigger = {**ORDER, "count": 8}
    with pytest.raises(OperationReused):
        call(gateway.url, "POST", "/orders", json=bigger, operation="gw-1", journal=journal, headers=AUTH)
    assert gateway.executions() == 1
    assert gateway.requests("mismatch") == 0


@pytest.mark.gateway("--mismatch-status", "422")
def test_a_mismatch_from_the_gateway_is_never_retried(call: Call, gateway: Gateway, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    # The operation's key is journaled by a first run that reached no server...
    with pytest.raises(GaveUp):
        call(
            "http://127.0.0.1:9",
            "POST",
            "/orders",
            json=ORDER,
            operation="gw-1",
            journal=journal,
            max_elapsed=1,
        )
    key = journaled_key(journal, "gw-1")
    # ...and someone else used that key for another request.
    other = {**ORDER, "count": 8}
    used = httpx.post(
        f"{gateway.url}/orders", json=other, headers={**AUTH, "Idempotency-Key": key}, timeout=60
    )
    assert used.status_code == 201
    with pytest.raises(KeyReused) as raised:
        call(gateway.url, "POST", "/orders", json=ORDER, operation="gw-1", journal=journal, headers=AUTH)
    assert raised.value.status == 422
    assert gateway.requests("mismatch") == 1, "the mismatch was sent more than once"
    assert gateway.executions() == 1
