"""End to end on a real uvicorn server on 127.0.0.1, with real HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from .conftest import BOUND, HANG, Engine, make_app, serve

DISCONNECT_BOUND = 0.1
"""Seconds within which a client disconnect must reach the producer's on_abort."""


async def sse_events(client: httpx.AsyncClient, url: str) -> list[str]:
    async with (
        aconnect_sse(client, "GET", url) as source,
        contextlib.aclosing(source.aiter_sse()) as events,
    ):
        return [event.data async for event in events]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param("", ['{"n":1}', '{"n":2}'], id="stream"),
        pytest.param(
            "?batch=2",
            [
                '{"index":0,"output":{"n":1}}',
                '{"index":0,"output":{"n":2}}',
                '{"index":1,"output":{"n":1}}',
                '{"index":1,"output":{"n":2}}',
            ],
            id="batch",
        ),
    ],
)
async def test_sse_stream_delivers_every_output_then_done(
    engine: Engine, query: str, expected: list[str]
) -> None:
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        events = await sse_events(client, f"{url}/stream{query}")

    assert sorted(events[:-1]) == expected
    assert events[-1] == "[DONE]"
    assert engine.registry.in_flight == 0


async def test_ndjson_stream_is_one_json_value_per_line_with_no_terminal(engine: Engine) -> None:
    async with (
        serve(make_app(engine)) as (url, _),
        httpx.AsyncClient(timeout=BOUND) as client,
        client.stream("GET", f"{url}/stream?encoder=ndjson") as response,
    ):
        lines = [line async for line in response.aiter_lines()]

    assert response.headers["content-type"] == "application/x-ndjson"
    assert [json.loads(line) for line in lines if line] == [{"n": 1}, {"n": 2}]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param("", {"n": 2}, id="stream"),
        pytest.param("?batch=3", [{"n": 2}] * 3, id="batch"),
    ],
)
async def test_json_answer_is_the_result_or_the_batch_results_in_order(
    engine: Engine, query: str, expected: Any
) -> None:
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        response = await client.post(f"{url}/json{query}")

    assert response.status_code == 200
    assert response.json() == expected
    assert response.headers["content-length"] == str(len(response.content))
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("batch", [0, 3], ids=["stream", "batch"])
async def test_client_disconnect_mid_stream_aborts_every_rid_within_100ms(
    engine: Engine, batch: int
) -> None:
    engine.script = [{"n": 1}, HANG]
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        async with aconnect_sse(client, "GET", f"{url}/stream?batch={batch}") as source:
            async with contextlib.aclosing(source.aiter_sse()) as events:
                first = await anext(events)
            left_at = time.perf_counter()  # the connection closes on leaving the block
        await engine.until(lambda: len(engine.aborted_at) == max(batch, 1))

        event = json.loads(first.data)
        assert "n" in (event["output"] if batch else event)  # (a batch's: in its envelope)
        assert max(engine.aborted_at.values()) - left_at < DISCONNECT_BOUND
        assert engine.registry.in_flight == 0


@pytest.mark.parametrize("batch", [0, 3], ids=["stream", "batch"])
async def test_client_disconnect_during_a_json_wait_aborts_every_rid_within_100ms(
    engine: Engine, batch: int
) -> None:
    engine.script = [HANG]
    async with serve(make_app(engine)) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /json?batch={batch} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
        await writer.drain()
        await engine.until(lambda: len(engine.submitted) == max(batch, 1))
        left_at = time.perf_counter()
        writer.close()
        await writer.wait_closed()
        await engine.until(lambda: len(engine.aborted_at) == max(batch, 1))

        assert max(engine.aborted_at.values()) - left_at < DISCONNECT_BOUND
        assert engine.registry.in_flight == 0
        assert await reader.read() == b""  # the server had not answered


@pytest.mark.parametrize("path", ["/stream", "/json"])
@pytest.mark.parametrize(
    ("script", "query", "status", "kind"),
    [
        pytest.param([ValueError("engine broke")], "", 500, "ProducerError", id="producer"),
        pytest.param([HANG], "?timeout=0.05", 504, "RequestTimeout", id="timeout"),
    ],
)
async def test_failure_before_the_first_output_gets_its_status_and_a_json_body(
    engine: Engine, path: str, script: list[Any], query: str, status: int, kind: str
) -> None:
    engine.script = script
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        response = await client.get(f"{url}{path}{query}")

    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == kind
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("path", ["/stream", "/json"])
async def test_overloaded_and_closed_registries_answer_503_with_retry_after(path: str) -> None:
    engine = Engine(max_in_flight=1)
    held = engine.registry.open()
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        overloaded = await client.get(f"{url}{path}")
        await held.aclose()
        await engine.registry.close(drain_timeout=0)
        closed = await client.get(f"{url}{path}")

    for response, kind in [(overloaded, "Overloaded"), (closed, "RegistryClosed")]:
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == kind
    assert engine.submitted == []


async def test_failure_after_the_first_output_is_one_error_event_then_done(
    engine: Engine,
) -> None:
    engine.script = [{"n": 1}, ValueError("engine broke")]
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        events = await sse_events(client, f"{url}/stream")

    assert len(events) == 3
    assert events[0] == '{"n":1}'
    assert json.loads(events[1])["error"]["type"] == "ProducerError"
    assert events[2] == "[DONE]"


@pytest.mark.parametrize(
    ("path", "content_type"),
    [("/stream", "text/event-stream; charset=utf-8"), ("/json", "application/json")],
)
async def test_head_gets_headers_only_and_aborts_the_work(
    engine: Engine, path: str, content_type: str
) -> None:
    engine.script = [HANG]
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        response = await client.head(f"{url}{path}")

    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.content == b""
    assert list(engine.aborted_at) == engine.submitted
    assert engine.registry.in_flight == 0


async def test_body_larger_than_one_receive_message_reaches_the_app_whole(
    engine: Engine,
) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: uvicorn hands it over in 64 KiB pieces
    async with serve(make_app(engine)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        response = await client.post(f"{url}/body", content=body)

    assert response.json()["sha256"] == hashlib.sha256(body).hexdigest()
    assert response.json()["messages"] > 1
