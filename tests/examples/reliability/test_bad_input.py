"""Bad input against every server: a clear 4xx JSON error each time, nothing left in flight.

The table covers each kind of mistake a client makes; the property test throws
generated JSON bodies (valid, nearly valid and arbitrary) at ``/generate`` and
requires a 200 or a 4xx JSON error for every one, never a 5xx, never a hang (the
one 5xx allowed is the 504 of a body that asked for a deadline which passed).
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import api
import pytest
import pytest_asyncio
from api import MAX_BATCH, MAX_BODY_BYTES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .client import sse_payloads
from .harness import BOUND, SERVERS, Server, report, running, service

pytestmark = pytest.mark.asyncio(loop_scope="module")

JSON: Final = {"content-type": "application/json"}

BAD_BODIES: Final = [
    pytest.param(b"{oops", 400, id="malformed-json"),
    pytest.param(b"\xff\xfe{}", 400, id="not-utf8"),
    pytest.param(b"", 400, id="empty-body"),
    pytest.param(b'["text"]', 422, id="not-an-object"),
    pytest.param(b'{"text": 5}', 422, id="text-wrong-type"),
    pytest.param(b'{"text": ["a", 1]}', 422, id="batch-item-wrong-type"),
    pytest.param(b'{"text": "x", "max_tokens": "5"}', 422, id="max-tokens-wrong-type"),
    pytest.param(b'{"text": "x", "max_tokens": 2.5}', 422, id="max-tokens-float"),
    pytest.param(b'{"text": "x", "stream": "yes"}', 422, id="stream-wrong-type"),
    pytest.param(b'{"text": "x", "timeout": "soon"}', 422, id="timeout-wrong-type"),
    pytest.param(b'{"text": "x", "rid": 7}', 422, id="rid-wrong-type"),
    pytest.param(b'{"text": ["a", "b"], "rid": ["a"]}', 422, id="rid-count-mismatch"),
    pytest.param(b'{"max_tokens": 5}', 422, id="missing-text"),
    pytest.param(b"{}", 422, id="empty-object"),
    pytest.param(b'{"text": []}', 422, id="empty-batch"),
    pytest.param(json.dumps({"text": ["x"] * (MAX_BATCH + 1)}).encode(), 413, id="oversized-batch"),
    pytest.param(b'{"text": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, id="oversized-body"),
    pytest.param(b'{"text": "x", "max_tokens": 0}', 422, id="zero-max-tokens"),
    pytest.param(b'{"text": "x", "max_tokens": -3}', 422, id="negative-max-tokens"),
    pytest.param(b'{"text": "x", "max_tokens": 100000}', 422, id="huge-max-tokens"),
    pytest.param(b'{"text": "x", "timeout": 0}', 422, id="zero-timeout"),
]


GENERATED: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
"""The statuses the property test got, per server (printed with the figures)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    async with running(request.param, service(step_interval=0.001)) as running_server:
        yield running_server
    statuses = GENERATED.get(request.param)
    if statuses:
        report(
            request.config,
            f"bad input[{request.param}]: {sum(statuses.values())} generated bodies, "
            f"statuses {dict(sorted(statuses.items()))}, in flight after: "
            f"{running_server.ledger.in_flight}",
        )


@pytest_asyncio.fixture(loop_scope="module")
async def http(server: Server) -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=BOUND)
    async with aiohttp.ClientSession(server.url, timeout=timeout) as session:
        yield session


async def answer(
    http: aiohttp.ClientSession, method: str, path: str, body: bytes | None = None
) -> tuple[int, Any]:
    """Send one request; its status and decoded body: JSON, or the list of an event
    stream's payloads, or ``None`` for anything else."""
    async with http.request(method, path, data=body, headers=JSON) as response:
        raw = await response.read()
        if response.content_type == "application/json":
            return response.status, json.loads(raw)
        if response.content_type == "text/event-stream":
            return response.status, sse_payloads(raw)
        return response.status, None


def assert_json_error(status: int, body: Any, expected: int, path: str = "/generate") -> None:
    """tether's error shape, or OpenAI's on ``/v1/...`` (``{"message", "type",
    "param", "code"}``, and a 400 for a refusal that names a field)."""
    assert status == expected, body
    assert isinstance(body, dict), f"{status} without a JSON body"
    error = body["error"]
    if path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error", error
    else:
        assert error["code"] == status
    assert isinstance(error["message"], str)
    assert error["message"]


def openai_status(case_id: str, status: int) -> int:
    """What an OpenAI route answers where ``/generate`` answers ``status``: 400 for a
    refusal that names a field (the SDK raises ``BadRequestError``), a body too large
    still 413."""
    return 400 if status == 422 or case_id == "oversized-batch" else status


BAD_ROUTED_BODIES: Final = [
    *(pytest.param("/generate", *case.values, id=f"generate-{case.id}") for case in BAD_BODIES),
    *(
        pytest.param(
            "/v1/completions", case.values[0].replace(b'"text"', b'"prompt"'),
            openai_status(str(case.id), case.values[1]), id=f"completions-{case.id}",
        )
        for case in BAD_BODIES
        # (OpenAI's completions route has no rid and no timeout to get wrong)
        if b'"rid"' not in case.values[0] and b'"timeout"' not in case.values[0]
    ),
]  # fmt: skip
""":data:`BAD_BODIES` on both generation routes of the example API (``/v1/completions``
calls the prompt ``prompt``)."""


@pytest.mark.parametrize(("path", "body", "status"), BAD_ROUTED_BODIES)
async def test_a_bad_body_gets_a_clear_json_error_and_nothing_stays_in_flight(
    server: Server, http: aiohttp.ClientSession, path: str, body: bytes, status: int
) -> None:
    opened = server.ledger.stats().opened
    got, reply = await answer(http, "POST", path, body)
    assert_json_error(got, reply, status, path)
    assert server.ledger.stats().opened == opened
    assert server.ledger.in_flight == 0


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/nowhere", 404, id="unknown-route"),
        pytest.param("POST", "/v2/generate", 404, id="unknown-route-post"),
        pytest.param("GET", "/generate", 405, id="get-generate"),
        pytest.param("PUT", "/generate", 405, id="put-generate"),
        pytest.param("DELETE", "/metrics", 405, id="delete-metrics"),
    ],
)
async def test_an_unknown_route_or_method_gets_a_json_error(
    server: Server, http: aiohttp.ClientSession, method: str, path: str, status: int
) -> None:
    got, reply = await answer(http, method, path, b"{}")
    assert_json_error(got, reply, status)
    assert server.ledger.in_flight == 0


async def test_a_request_id_colliding_with_a_live_one_gets_409_and_leaves_it_alone(
    server: Server, http: aiohttp.ClientSession
) -> None:
    body = {"text": "long", "max_tokens": 4000, "stream": True, "rid": "mine"}
    async with http.post("/generate", json=body) as live:
        assert live.status == 200
        await live.content.readline()  # the first event: "mine" is in flight
        for clash in ({"text": "x", "rid": "mine"}, {"text": ["a", "b"], "rid": ["new", "mine"]}):
            got, reply = await answer(http, "POST", "/generate", json.dumps(clash).encode())
            assert_json_error(got, reply, 409)
            assert "mine" in reply["error"]["message"]
        assert "new" not in server.ledger  # a batch is registered whole or not at all
        assert "mine" in server.ledger
        live.close()
    await server.idle()
    assert server.ledger.aborts["mine"] == 1
    assert not server.ledger.problems()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value (NaN and infinities included: Python's json writes them)."""

NEAR_VALID = st.fixed_dictionaries(
    {"text": st.text(max_size=30) | st.lists(st.text(max_size=10), max_size=70)},
    optional={
        "max_tokens": st.integers(-3, 24) | JSON_VALUES,
        "stream": st.booleans() | JSON_VALUES,
        "timeout": st.floats(-1, 2) | JSON_VALUES,
        "rid": st.text(max_size=8) | st.lists(st.text(max_size=8), max_size=3) | JSON_VALUES,
    },
)
"""Bodies close to valid ones: every field, right or wrong, in any combination."""

BODIES = st.one_of(NEAR_VALID, JSON_VALUES).map(lambda value: json.dumps(value).encode())


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=BODIES)
async def test_any_json_body_gets_200_or_a_4xx_json_error_never_5xx_never_a_hang(
    server: Server, http: aiohttp.ClientSession, body: bytes
) -> None:
    # Generated request ids repeat from one example to the next: one account each.
    server.ledger.forget()
    async with asyncio.timeout(BOUND):
        status, reply = await answer(http, "POST", "/generate", body)
    GENERATED[server.name][status] += 1
    if status == 200:
        accepted = api.parse_generate(body)  # what the server accepted, the parser must
        if accepted.stream:
            assert reply[-1] == "[DONE]"
            late = [event["error"]["code"] for event in reply[:-1] if "error" in event]
            assert late == [] or (late == [504] and accepted.timeout is not None)
        else:
            assert isinstance(reply, list if accepted.batched else dict)
    elif status == 504:  # the body asked for a deadline, and it passed: the right answer
        assert api.parse_generate(body).timeout is not None, (status, reply)
        assert_json_error(status, reply, status)
    else:
        assert 400 <= status < 500, (status, reply)
        assert_json_error(status, reply, status)
    await server.idle()
    assert not server.ledger.problems()
