"""Against the real leasebroker binary: one worker per operation, whatever happens to the client."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idempotency_client import Client, GaveUp, KeyReused, OperationReused

from .conftest import Call
from .leasebroker import TOKEN, Leasebroker

AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORKER = {"image": "worker-base:2025.11", "cpu": 2, "memory_gb": 4, "labels": {"team": "ci"}}
OPERATION = Path(__file__).with_name("operation.py")


@pytest.fixture
def broker(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Leasebroker]:
    marker = request.node.get_closest_marker("leasebroker")
    extra = marker.args if marker else ()
    server = Leasebroker(tmp_path, *extra)
    yield server
    server.stop()


def until(what: str, check: Callable[[], bool], deadline: float = 60.0) -> None:
    """Waits for ``check`` to hold (polling a state, not sleeping a guess)."""
    end = time.monotonic() + deadline
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline:.0f} s")
        time.sleep(0.05)


def operation(url: str, journal: Path, op: str, body: dict[str, Any] = WORKER) -> subprocess.Popen[str]:
    """The client as a process of its own, making one create under ``op``."""
    args = [sys.executable, str(OPERATION), url, TOKEN, str(journal), op, json.dumps(body)]
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
