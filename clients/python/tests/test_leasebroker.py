"""Against the real leasebroker binary: one worker per operation, whatever happens to the client."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from idempotency_client import Client, GaveUp, KeyReused, OperationReused

from .conftest import Call
from .leasebroker import TOKEN, Leasebroker
from .support import WORKER, journaled_key, operation, result, until

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Leasebroker]:
    marker = request.node.get_closest_marker("leasebroker")
    extra = marker.args if marker else ()
    server = Leasebroker(tmp_path, *extra)
    yield server
    server.stop()


def test_a_rerun_after_the_final_outcome_answers_from_the_journal(
    call: Call, broker: Leasebroker, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    first = call(
        broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-1", journal=journal, headers=AUTH
    )
    assert first.status_code == 201
    assert broker.fleet()["workers_active"] == 1
    broker.stop()  # anything sent now fails, and would end in GaveUp after max_elapsed
    again = call(
        broker.url,
        "POST",
        "/v1/workers",
        json=WORKER,
        operation="ci-1",
        journal=journal,
        headers=AUTH,
        max_elapsed=2,
    )
    assert again.status_code == 201
    assert again.json() == first.json()
    assert again.headers["location"] == first.headers["location"]
    assert again.headers["idempotency-client-journal"]


@pytest.mark.leasebroker("--sim-latency-ms", "3000")
def test_a_client_killed_mid_operation_and_rerun_makes_one_worker(
    broker: Leasebroker, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    child = operation(broker.url, journal, "ci-kill")
    # The create is on the server, its VM boot held up by the simulated latency: kill the client now.
    until("the create is in flight", lambda: broker.in_flight() == 1)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    in_flight_key = broker.admin("/admin/v1/records?state=in_flight")["records"][0]["key"]
    assert journaled_key(journal, "ci-kill") == in_flight_key, "the key was journaled before it was sent"

    rerun = result(operation(broker.url, journal, "ci-kill"))
    assert rerun["status"] == 201
    fleet = broker.fleet()
    assert fleet["workers_active"] == 1, fleet
    assert fleet["vm_boots_total"] == 1, fleet
    assert rerun["body"]["id"].startswith("wkr-")


@pytest.mark.leasebroker("--sim-latency-ms", "1000")
def test_several_processes_share_one_journal(broker: Leasebroker, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    same = [operation(broker.url, journal, "ci-shared") for _ in range(4)]
    distinct = [operation(broker.url, journal, f"ci-own-{i}") for i in range(4)]
    shared_ids = {result(p)["body"]["id"] for p in same}
    own_ids = {result(p)["body"]["id"] for p in distinct}
    assert len(shared_ids) == 1, "four processes on one operation made more than one worker"
    assert len(own_ids) == 4
    fleet = broker.fleet()
    assert fleet["workers_active"] == 5, fleet
    assert fleet["vm_boots_total"] == 5, fleet
    with sqlite3.connect(journal) as db:
        keys = [row[0] for row in db.execute("SELECT idem_key FROM operations")]
    assert len(keys) == len(set(keys)) == 5


def test_another_request_under_an_operation_is_refused_locally(
    call: Call, broker: Leasebroker, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.db"
    call(broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-1", journal=journal, headers=AUTH)
    executed = broker.requests("executed")
    bigger = {**WORKER, "cpu": 8}
    with pytest.raises(OperationReused):
        call(broker.url, "POST", "/v1/workers", json=bigger, operation="ci-1", journal=journal, headers=AUTH)
    assert broker.requests("executed") == executed
    assert broker.requests("mismatch") == 0
    assert broker.fleet()["workers_active"] == 1


@pytest.mark.leasebroker("--mismatch-status", "422")
def test_a_mismatch_from_the_server_is_never_retried(call: Call, broker: Leasebroker, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    # The operation's key is journaled by a first run that reached no server...
    with pytest.raises(GaveUp):
        call(
            "http://127.0.0.1:9",
            "POST",
            "/v1/workers",
            json=WORKER,
            operation="ci-1",
            journal=journal,
            max_elapsed=1,
        )
    key = journaled_key(journal, "ci-1")
    # ...and someone else used that key for another request.
    other = {**WORKER, "cpu": 8}
    used = httpx.post(
        f"{broker.url}/v1/workers", json=other, headers={**AUTH, "Idempotency-Key": key}, timeout=60
    )
    assert used.status_code == 201
    with pytest.raises(KeyReused) as raised:
        call(broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-1", journal=journal, headers=AUTH)
    assert raised.value.status == 422
    assert broker.requests("mismatch") == 1, "the mismatch was sent more than once"
    assert broker.fleet()["workers_active"] == 1


def test_each_call_without_an_operation_is_its_own_operation(broker: Leasebroker) -> None:
    with Client(broker.url, headers=AUTH) as client:
        first = client.request("POST", "/v1/workers", json=WORKER)
        second = client.request("POST", "/v1/workers", json=WORKER)
        listed = client.request("GET", "/v1/workers").json()["workers"]
    assert first.json()["id"] != second.json()["id"]
    assert len(listed) == 2


@pytest.mark.leasebroker("--rate-limit", "1", "--rate-limit-burst", "1")
def test_a_429_is_waited_out_for_its_retry_after(call: Call, broker: Leasebroker, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    call(broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-1", journal=journal, headers=AUTH)
    # The principal's one request a second is spent right before the client's (a request without a
    # key: refused, nothing stored, but counted by the rate limit however long the create took),
    # so the client's first attempt is refused with Retry-After: 1.
    httpx.post(f"{broker.url}/v1/workers", json=WORKER, headers=AUTH, timeout=60)
    refused = broker.responses("429")
    started = time.monotonic()
    second = call(
        broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-2", journal=journal, headers=AUTH
    )
    waited = time.monotonic() - started
    assert second.status_code == 201
    assert broker.responses("429") == refused + 1, "the client came back before Retry-After"
    assert waited >= 1.0, f"answered after {waited:.2f} s, sooner than Retry-After"
    fleet = broker.fleet()
    assert (fleet["workers_active"], fleet["vm_boots_total"]) == (2, 2), fleet


@pytest.mark.leasebroker("--pool-nodes", "1")
def test_a_503_is_waited_out_for_its_retry_after(call: Call, broker: Leasebroker, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    first = call(
        broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-1", journal=journal, headers=AUTH
    )

    # The pool's one node is taken: the next create answers 503 capacity-exhausted, Retry-After: 5.
    # Once it did, the first worker is deleted, so the retry the client makes after 5 s finds a node.
    def free_the_node() -> None:
        until("the create was refused with 503", lambda: broker.responses("503") == 1)
        deleted = httpx.delete(
            f"{broker.url}/v1/workers/{first.json()['id']}",
            headers={**AUTH, "Idempotency-Key": '"free-the-node"'},
            timeout=60,
        )
        assert deleted.status_code in (200, 202, 204), deleted.text

    freeing = threading.Thread(target=free_the_node)
    freeing.start()
    started = time.monotonic()
    second = call(
        broker.url, "POST", "/v1/workers", json=WORKER, operation="ci-2", journal=journal, headers=AUTH
    )
    waited = time.monotonic() - started
    freeing.join(timeout=60)
    assert second.status_code == 201, second.text
    assert broker.responses("503") == 1, "the client came back before Retry-After"
    assert waited >= 5.0, f"answered after {waited:.2f} s, sooner than Retry-After"
    fleet = broker.fleet()
    assert (fleet["workers_active"], fleet["vm_boots_total"]) == (1, 2), fleet
