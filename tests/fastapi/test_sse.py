"""FastAPI's own server-sent events (``EventSourceResponse`` generators) reading a
tether stream or batch through ``tether_starlette.fastapi.events``, on a real uvicorn."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.sse import EventSourceResponse

from tests._support.engine import Engine
from tests._support.waiting import eventually
from tests.starlette.conftest import BOUND, serve
from tether_starlette import TetherMiddleware
from tether_starlette.fastapi import RegistryDep, events


def make_app(producer: Engine, script: list[Any]) -> FastAPI:
    """``POST /events`` delivers ``script`` up front (``"fail"``: a producer error;
    ``"hang"``: nothing more, the request stays open) and streams it."""
    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=producer.registry)

    @app.post("/events", response_class=EventSourceResponse)
    async def stream_events(registry: RegistryDep) -> AsyncIterator[Any]:
        stream = registry.open()
        for index, step in enumerate(script):
            if step == "fail":
                registry.fail(stream.rid, RuntimeError("out of memory"))
            elif step != "hang":
                registry.deliver(stream.rid, step, finished=index == len(script) - 1)
        async for output in events(stream):
            yield output

    return app


def data_lines(text: str) -> list[Any]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data:")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


async def test_outputs_then_done() -> None:
    producer = Engine()
    app = make_app(producer, [{"t": 1}, {"t": 2}])
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/events")
    assert data_lines(answer.text) == [{"t": 1}, {"t": 2}, "[DONE]"]
    assert producer.registry.in_flight == 0


async def test_a_failure_after_the_first_output_is_one_error_event_then_done() -> None:
    producer = Engine()
    app = make_app(producer, [{"t": 1}, "fail"])
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/events")
    lines = data_lines(answer.text)
    assert lines[0] == {"t": 1}
    assert lines[1]["error"]["code"] == 500
    assert "out of memory" not in answer.text  # (a producer's text is logged, not sent)
    assert lines[2:] == ["[DONE]"]


async def test_a_client_that_leaves_ends_the_generator_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer = Engine()
    app = make_app(producer, [{"t": 1}, "hang"])
    caplog.set_level(logging.INFO)
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        async with client.stream("POST", f"{url}/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the first event: leave
        await eventually(lambda: producer.aborted != [] and producer.registry.in_flight == 0)
    # (uvicorn waits for the request's task when it stops: what it logged is in)
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
    assert len(producer.aborted) == 1


def make_batch_app(
    producer: Engine, outputs: list[Any], *, fail: bool = False, keep_going: bool = False
) -> FastAPI:
    """``POST /batch`` delivers one output per sub-request (a dict with its own
    ``"index"``, as every OpenAI choice has), the last failed with ``fail``."""
    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=producer.registry)

    @app.post("/batch", response_class=EventSourceResponse)
    async def stream_batch(registry: RegistryDep) -> AsyncIterator[Any]:
        batch = registry.open_batch(len(outputs), keep_going=keep_going)
        for number, (rid, output) in enumerate(zip(batch.rids, outputs, strict=True)):
            if fail and number == len(outputs) - 1:
                registry.fail(rid, RuntimeError("out of memory"))
            else:
                registry.deliver(rid, output, finished=True)
        async for event in events(batch):
            yield event

    return app


async def test_a_batch_streams_each_output_under_its_own_index() -> None:
    producer = Engine()
    outputs = [{"index": 7, "text": "a"}, {"index": 7, "text": "b"}]
    app = make_batch_app(producer, outputs)
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/batch")
    *items, done = data_lines(answer.text)
    assert done == "[DONE]"
    # the output's own "index" cannot stand for the sub-request's
    assert sorted(items, key=lambda item: item["index"]) == [
        {"index": 0, "output": {"index": 7, "text": "a"}},
        {"index": 1, "output": {"index": 7, "text": "b"}},
    ]
    assert producer.registry.in_flight == 0


async def test_a_failed_sub_request_ends_a_batch_with_one_error_event() -> None:
    producer = Engine()
    app = make_batch_app(producer, [{"t": 1}, {"t": 2}], fail=True)
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/batch")
    lines = data_lines(answer.text)
    assert lines[-1] == "[DONE]"
    assert lines[-2]["error"]["code"] == 500
    assert "out of memory" not in answer.text
    assert producer.registry.in_flight == 0


async def test_a_keep_going_batch_reports_a_failed_sub_request_in_its_place() -> None:
    producer = Engine()
    app = make_batch_app(producer, [{"t": 1}, {"t": 2}], fail=True, keep_going=True)
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/batch")
    *items, done = data_lines(answer.text)
    assert done == "[DONE]"
    by_index = {item["index"]: item for item in items}
    assert by_index[0] == {"index": 0, "output": {"t": 1}}
    assert by_index[1]["error"]["code"] == 500
    assert "out of memory" not in answer.text
    assert producer.registry.in_flight == 0
