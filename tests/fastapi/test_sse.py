"""FastAPI's own server-sent events (``EventSourceResponse`` generators) reading a
tether stream through ``tether_starlette.fastapi.events``, on a real uvicorn."""

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
