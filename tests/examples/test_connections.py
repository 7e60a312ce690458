"""Requests that share one connection to an example server (issue 17's first point).

uvicorn starts a connection's next request from inside the previous request's
``send()`` when requests are pipelined, and, after a body over 64 KiB, from a reader
callback that carries the context of the request that last resumed reading: the new
request's task inherits the previous request's context. On the shipped example that
once answered pipelined JSON + JSON with ``[200, 499]``, and let the client of a
request after a large upload leave unnoticed. Each test speaks HTTP/1.1 over a raw
socket, so that its requests really share one connection, to every example server on
every uvicorn stack (h11 or httptools, asyncio's loop or uvloop) and to the aiohttp
server on both loops.

One server per (server, stack) serves the module; counters are compared before and
after, so the tests do not depend on their order. Once it has stopped, its output
must hold no failure (no traceback, no error log).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest
import pytest_asyncio
from engine import expected_text

from tests._support.raw_http import connection, leave, read_response, request

from .conftest import SERVER_STACKS, Served, Stack, eventually, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

BOUND: Final = 10.0
"""A generous bound on any one exchange with a server."""

ABORT_BOUND: Final = 1.0
"""Seconds within which a client leaving must abort its work in the engine."""

LONG: Final = 4096
"""``max_tokens`` that keeps the engine busy for seconds (2 ms steps): a request that
only ends by being aborted within the test."""

UPLOAD: Final = 128 * 1024
"""A body large enough that uvicorn pauses reading (past 64 KiB) and resumes it from
the request's own task."""


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[pytest.param(param.values, id=param.id) for param in SERVER_STACKS],
)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    name, stack = request.param
    assert isinstance(stack, Stack)
    async with served(name, "--step-ms", "2", stack=stack) as running:
        yield running
    # Stopped: the output is complete.
    assert running.failure_lines() == [], "\n".join(running.output)


@pytest_asyncio.fixture(loop_scope="module")
async def http(server: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as client:
        yield client


def generate(**fields: Any) -> bytes:
    """A ``POST /generate`` request with ``fields`` as its JSON body."""
    return request("POST", "/generate", json.dumps(fields).encode(), json=True)


def streamed_text(body: bytes) -> str:
    """The text of a server-sent event stream that ended with ``[DONE]``."""
    data = [
        line.removeprefix(b"data: ") for line in body.splitlines() if line.startswith(b"data: ")
    ]
    assert data[-1:] == [b"[DONE]"], body[-200:]
    return "".join(json.loads(event)["text"] for event in data[:-1])


async def stats(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/stats")
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


async def settled(http: httpx.AsyncClient) -> dict[str, Any]:
    """The server's stats once nothing is in flight in tether or in the engine."""
    latest: dict[str, Any] = {}

    async def idle() -> bool:
        latest.update(await stats(http))
        return latest["in_flight"] == 0 and latest["engine"]["running"] == 0

    await eventually(idle)
    return latest


async def abort_after_leaving(http: httpx.AsyncClient, writer: Any) -> float:
    """Wait until the connection's one long request is in flight, close the connection,
    and return how long the server took to abort its work in the engine."""
    before = await settled_except_one(http)
    left_at = await leave(writer)

    async def aborted() -> bool:
        now = await stats(http)
        return bool(now["engine"]["aborted"] > before["engine"]["aborted"])

    await eventually(aborted)
    took = time.perf_counter() - left_at
    after = await settled(http)
    assert after["engine"]["aborted"] - before["engine"]["aborted"] == 1
    disconnected = after["aborted"].get("client_disconnected", 0)
    assert disconnected - before["aborted"].get("client_disconnected", 0) == 1
    return took


async def settled_except_one(http: httpx.AsyncClient) -> dict[str, Any]:
    """The server's stats once exactly one request is in flight (the test's long one)."""
    latest: dict[str, Any] = {}

    async def one() -> bool:
        latest.update(await stats(http))
        return latest["in_flight"] == 1 and latest["engine"]["running"] == 1

    await eventually(one)
    return latest


async def test_pipelined_json_requests_each_get_their_own_answer(
    server: Served, http: httpx.AsyncClient
) -> None:
    before = await settled(http)
    async with connection(server.url) as (reader, writer):
        writer.write(generate(text="first", max_tokens=5) + generate(text="second", max_tokens=7))
        answers = [await read_response(reader), await read_response(reader)]
    after = await settled(http)

    assert [status for status, _ in answers] == [200, 200], answers
    texts = [json.loads(body)["text"] for _, body in answers]
    assert texts == [expected_text("first", 5), expected_text("second", 7)]
    assert after["aborted"] == before["aborted"]  # neither was taken for a cancelled one


async def test_pipelined_stream_then_json_each_get_their_own_answer(
    server: Served, http: httpx.AsyncClient
) -> None:
    before = await settled(http)
    async with connection(server.url) as (reader, writer):
        writer.write(
            generate(text="streamed", max_tokens=6, stream=True)
            + generate(text="answered", max_tokens=4)
        )
        (stream_status, stream_body), (json_status, json_body) = [
            await read_response(reader),
            await read_response(reader),
        ]
    after = await settled(http)

    assert (stream_status, json_status) == (200, 200), (stream_body, json_body)
    assert streamed_text(stream_body) == expected_text("streamed", 6)
    assert json.loads(json_body)["text"] == expected_text("answered", 4)
    assert after["aborted"] == before["aborted"]


async def test_client_leaving_during_a_pipelined_request_aborts_that_request_alone(
    server: Served, http: httpx.AsyncClient
) -> None:
    await settled(http)
    async with connection(server.url) as (reader, writer):
        writer.write(generate(text="short", max_tokens=3) + generate(text="long", max_tokens=LONG))
        status, body = await read_response(reader)
        took = await abort_after_leaving(http, writer)

    assert (status, json.loads(body)["text"]) == (200, expected_text("short", 3))
    assert took < ABORT_BOUND, f"the server noticed the client leaving after {took:.2f}s"


async def test_a_request_after_a_large_upload_notices_its_client_leaving(
    server: Served, http: httpx.AsyncClient
) -> None:
    await settled(http)
    prompt = "u" * UPLOAD
    async with connection(server.url) as (reader, writer):
        writer.write(generate(text=prompt, max_tokens=3))
        status, body = await read_response(reader)
        writer.write(generate(text="after", max_tokens=LONG))
        took = await abort_after_leaving(http, writer)

    assert (status, json.loads(body)["text"]) == (200, expected_text(prompt, 3))
    assert took < ABORT_BOUND, f"the server noticed the client leaving after {took:.2f}s"
