"""The retry rules, checked from what arrives at a scripted API: keys, counts and arrival times."""

from __future__ import annotations

import time
from email.utils import formatdate
from pathlib import Path

import httpx
import pytest

from idempotency_client import (
    GaveUp,
    KeyExpired,
    KeyReused,
    OperationReused,
    Refused,
    ServerError,
    Unauthorized,
)

from .conftest import Call
from .scripted import DROP, Arrival, Reply, created, problem, scripted

OK = created({"id": "thing-1"}, location="/v1/things/thing-1")


def test_retry_after_seconds_and_http_date_are_waited_out(call: Call) -> None:
    date_target: list[float] = []

    def too_many(arrival: Arrival) -> Reply:
        # An HTTP-date two to three seconds ahead (the format has whole seconds).
        target = float(int(arrival.wall) + 3)
        date_target.append(target)
        return problem(429, "too-many-requests", retry_after=formatdate(target, usegmt=True))

    with scripted([problem(503, "store-unavailable", retry_after="1"), too_many, OK]) as api:
        response = call(api.url, "POST", "/v1/things", json={"n": 1})
    assert response.status_code == 201
    first, second, third = api.arrivals
    assert second.at - first.at >= 1.0, "Retry-After: 1 was not waited out"
    assert third.wall >= date_target[0] - 0.01, "Retry-After as an HTTP-date was not waited out"
    assert first.key is not None
    assert api.keys == [first.key] * 3, "every attempt of one operation carries its one key"


def test_in_progress_is_retried_after_its_retry_after(call: Call) -> None:
    with scripted([problem(409, "request-in-progress", retry_after="1"), OK]) as api:
        assert call(api.url, "POST", "/v1/things", json={}).status_code == 201
    assert len(api.arrivals) == 2
    assert api.arrivals[1].at - api.arrivals[0].at >= 1.0
    assert api.keys[0] == api.keys[1]


def test_lost_answers_and_5xx_are_retried_with_the_same_key(call: Call) -> None:
    with scripted([DROP, problem(502, "upstream-unavailable"), Reply(500), OK]) as api:
        response = call(api.url, "POST", "/v1/things", json={"n": 1})
    assert response.status_code == 201
    assert response.json() == {"id": "thing-1"}
    assert len(api.arrivals) == 4
    assert len(set(api.keys)) == 1


@pytest.mark.parametrize("status", [409, 422, 400])
def test_key_reused_is_never_retried_whatever_its_status(call: Call, status: int) -> None:
    reused = problem(status, "idempotency-key-reused")
    with scripted([reused, OK]) as api, pytest.raises(KeyReused) as raised:
        call(api.url, "POST", "/v1/things", json={"n": 1})
    assert len(api.arrivals) == 1
    assert raised.value.status == status
    assert raised.value.problem is not None
    assert raised.value.problem.name == "idempotency-key-reused"


@pytest.mark.parametrize(
    "reply",
    [Reply(400), Reply(404), problem(409, "node-in-use"), problem(422, "invalid-request"), Reply(413)],
    ids=["400", "404", "409-conflict", "422", "413"],
)
def test_other_4xx_are_refused_without_a_retry(call: Call, reply: Reply) -> None:
    with scripted([reply, OK]) as api, pytest.raises(Refused) as raised:
        call(api.url, "POST", "/v1/things", json={"n": 1})
    assert len(api.arrivals) == 1
    assert raised.value.status == reply.status


@pytest.mark.parametrize("status", [401, 403])
def test_unauthorized_is_not_retried(call: Call, status: int) -> None:
    with scripted([problem(status, "unauthorized"), OK]) as api, pytest.raises(Unauthorized) as raised:
        call(api.url, "POST", "/v1/things", json={"n": 1})
    assert len(api.arrivals) == 1
    assert raised.value.status == status


def test_gives_up_within_the_budget(call: Call) -> None:
    busy = problem(503, "store-unavailable", retry_after="0")
    with scripted([busy]) as api, pytest.raises(GaveUp) as raised:
        call(api.url, "POST", "/v1/things", json={"n": 1}, max_elapsed=2.0)
    assert isinstance(raised.value.last, ServerError)
    assert raised.value.last.status == 503
    assert raised.value.attempts == len(api.arrivals) >= 2
    assert api.arrivals[-1].at - api.arrivals[0].at < 2.0, "an attempt went out after the budget"
    assert len(set(api.keys)) == 1


def test_a_retry_after_beyond_the_budget_gives_up_at_once(call: Call) -> None:
    with scripted([problem(503, "store-unavailable", retry_after="30")]) as api:
        started = time.monotonic()
        with pytest.raises(GaveUp):
            call(api.url, "POST", "/v1/things", json={"n": 1}, max_elapsed=5.0)
    assert len(api.arrivals) == 1
    assert time.monotonic() - started < 5.0, "waited although no attempt fits in the budget"


def test_transport_errors_in_gave_up(call: Call) -> None:
    with scripted([DROP]) as api, pytest.raises(GaveUp) as raised:
        call(api.url, "POST", "/v1/things", json={"n": 1}, max_elapsed=1.0)
    assert isinstance(raised.value.last, httpx.TransportError)


def test_prefer_wait_is_sent_when_asked(call: Call) -> None:
    with scripted([OK]) as api:
        call(api.url, "POST", "/v1/things", json={"n": 1}, wait=5)
        call(api.url, "POST", "/v1/things", json={"n": 1})
    assert api.arrivals[0].headers.get("prefer") == "wait=5"
    assert "prefer" not in api.arrivals[1].headers


def test_body_is_json_with_sorted_keys(call: Call) -> None:
    with scripted([OK]) as api:
        call(api.url, "POST", "/v1/things", json={"b": 1, "a": [1, "é"]})
    assert api.arrivals[0].body == '{"a":[1,"é"],"b":1}'.encode()
    assert api.arrivals[0].headers["content-type"] == "application/json"


def test_without_an_operation_each_call_is_a_new_key(call: Call) -> None:
    with scripted([OK]) as api:
        call(api.url, "POST", "/v1/things", json={"n": 1})
        call(api.url, "POST", "/v1/things", json={"n": 1})
    first, second = api.keys
    assert first
    assert second
    assert first != second


def test_reads_carry_no_key_and_are_retried(call: Call) -> None:
    with scripted([Reply(503), Reply(200, {"Content-Type": "application/json"}, b"{}")]) as api:
        assert call(api.url, "GET", "/v1/things/thing-1").status_code == 200
    assert api.keys == [None, None]


def test_an_expired_key_is_never_sent_again(call: Call, tmp_path: Path) -> None:
    past = formatdate(time.time() - 5, usegmt=True)
    journal = tmp_path / "journal.db"
    reply = problem(503, "store-unavailable", retry_after="0", idempotency_key_expires=past)
    with scripted([reply, OK]) as api:
        with pytest.raises(KeyExpired):
            call(api.url, "POST", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
        assert len(api.arrivals) == 1
        # The rerun learns the expiry from the journal: nothing is sent.
        with pytest.raises(KeyExpired):
            call(api.url, "POST", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
        assert len(api.arrivals) == 1


def test_a_key_that_expires_before_the_next_attempt_is_not_sent(call: Call) -> None:
    soon = formatdate(time.time() + 3, usegmt=True)
    reply = problem(503, "store-unavailable", retry_after="10", idempotency_key_expires=soon)
    with scripted([reply, OK]) as api, pytest.raises(KeyExpired):
        call(api.url, "POST", "/v1/things", json={"n": 1}, max_elapsed=60.0)
    assert len(api.arrivals) == 1


def test_a_journaled_outcome_is_answered_without_sending(call: Call, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    with scripted([OK]) as api:
        first = call(api.url, "POST", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
        again = call(api.url, "POST", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
    assert len(api.arrivals) == 1
    assert "idempotency-client-journal" not in first.headers
    assert again.headers["idempotency-client-journal"]
    assert again.headers["idempotent-replayed"] == "true"
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["location"] == "/v1/things/thing-1"
    assert again.headers["content-type"] == "application/json"


def test_another_request_under_a_journaled_operation_is_refused_locally(call: Call, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    with scripted([OK]) as api:
        call(api.url, "POST", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
        with pytest.raises(OperationReused):
            call(api.url, "POST", "/v1/things", json={"n": 2}, journal=journal, operation="op-1")
        with pytest.raises(OperationReused):
            call(api.url, "PUT", "/v1/things", json={"n": 1}, journal=journal, operation="op-1")
    assert len(api.arrivals) == 1


def test_a_journaled_refusal_is_raised_again_without_sending(call: Call, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    with scripted([problem(404, "not-found"), OK]) as api:
        for _ in range(2):
            with pytest.raises(Refused) as raised:
                call(api.url, "DELETE", "/v1/things/x", journal=journal, operation="op-1")
            assert raised.value.status == 404
    assert len(api.arrivals) == 1


def test_unauthorized_is_not_journaled(call: Call, tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    with scripted([problem(401, "unauthorized"), OK]) as api:
        with pytest.raises(Unauthorized):
            call(api.url, "POST", "/v1/things", json={}, journal=journal, operation="op-1")
        assert (
            call(api.url, "POST", "/v1/things", json={}, journal=journal, operation="op-1").status_code == 201
        )
    assert len(api.arrivals) == 2
    assert api.keys[0] == api.keys[1], "the rerun keeps the operation's key"


def test_a_tls_failure_is_not_retried(call: Call) -> None:
    with scripted([OK]) as api:
        https = api.url.replace("http://", "https://")
        with pytest.raises(httpx.ConnectError):
            call(https, "POST", "/v1/things", json={}, max_elapsed=30.0)
    assert api.connections == 1
