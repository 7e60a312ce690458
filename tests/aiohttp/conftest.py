"""Shared pieces of the aiohttp adapter tests: scripts for the suite's fake engine
(``tests/_support/engine.py``), an abort recorder, one test application, servers in
both cancellation modes, and wire helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

import tether
import tether_aiohttp
from tests._support.engine import HANG, Engine
from tests._support.loops import LoopFactories, server_loops
from tests._support.servers import start_default_server as start_default_server


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """A test marked ``both_loops`` runs on asyncio's loop and on uvloop (the server
    runs on the test's loop); every other test on asyncio's own loop."""
    return server_loops(item)


HOLD = "hold"
"""A request the producer never finishes: it ends only by an abort."""


class Tracker:
    """What the server did, with one event to wait on any change."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.aborted: dict[str, float] = {}
        self.handled: list[str] = []
        self._changed = asyncio.Event()

    def on_abort(self, rid: str) -> None:
        self.aborted[rid] = asyncio.get_running_loop().time()
        self._changed.set()

    def note(self, into: list[str], rids: Iterable[str]) -> None:
        into.extend(rids)
        self._changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (callers bound this with a timeout)."""
        while not condition():
            self._changed.clear()
            await self._changed.wait()


def script(outputs: list[Any], end: object) -> list[Any]:
    """The engine's script for ``outputs`` that then finish the request (``"finish"``),
    fail it (``end`` is an exception) or hold it open (:data:`HOLD`)."""
    if isinstance(end, BaseException):
        return [*outputs, end]
    return [*outputs, HANG] if end == HOLD else outputs


@dataclass
class Env:
    registry: tether.Registry
    producer: Engine
    tracker: Tracker


def build_app(env: Env, **setup_options: float) -> web.Application:
    """One route, driven by its query: ``streaming``, ``n`` outputs, ``end``
    (``finish``, ``fail`` or ``hold``), ``batch`` size, ``timeout``, ``ping``, ``ndjson``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        query = request.query
        timeout = float(query["timeout"]) if "timeout" in query else None
        source: tether.Stream | tether.Batch
        if "batch" in query:
            source = env.registry.open_batch(int(query["batch"]), timeout=timeout)
            rids = source.rids
        else:
            source = env.registry.open(timeout=timeout)
            rids = (source.rid,)
        env.tracker.note(env.tracker.opened, rids)
        end: object = query.get("end", "finish")
        if end == "fail":
            end = RuntimeError("the engine broke")
        for index, rid in enumerate(rids):
            outputs = [{"text": f"{index}.{i}"} for i in range(int(query.get("n", "3")))]
            env.producer.submit(rid, script(outputs, end))
        try:
            return await tether_aiohttp.respond(
                request,
                source,
                streaming=query.get("streaming", "1") == "1",
                encoder=tether.NDJSON if "ndjson" in query else None,
                ping_interval=float(query.get("ping", "15")),
                headers={"X-Rid": rids[0]},
            )
        finally:
            env.tracker.note(env.tracker.handled, rids)

    app = web.Application()
    tether_aiohttp.setup(app, env.registry, **setup_options)
    app.router.add_get("/", handle)
    return app


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    tracker = Tracker()
    registry = tether.Registry(tracker.on_abort)
    producer = Engine(registry)
    yield Env(registry, producer, tracker)
    await producer.stop()


StartServer = Callable[[web.Application], Awaitable[int]]


@pytest.fixture(
    params=[False, True], ids=["handler_cancellation=False", "handler_cancellation=True"]
)
async def start_server(
    request: pytest.FixtureRequest, aiohttp_server: AiohttpServer
) -> AsyncIterator[StartServer]:
    """Start an app on 127.0.0.1 in one mode; returns its port. pytest-aiohttp's test
    server forces ``handler_cancellation=True``; the default mode needs an AppRunner."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> int:
        if request.param:
            return (await aiohttp_server(app)).port
        runner, port = await start_default_server(app)
        runners.append(runner)
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


async def raw_request(port: int, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a GET on a bare connection, so that the test decides when it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    """Read until ``marker`` arrived (callers bound this with a timeout)."""
    seen = b""
    while marker not in seen:
        data = await reader.read(4096)
        if not data:
            raise AssertionError(f"connection closed before {marker!r}; got {seen!r}")
        seen += data
    return seen


def sse_events(body: bytes) -> list[Any]:
    """The data of every SSE event in ``body`` (JSON decoded; ``"[DONE]"`` kept as is)."""
    events: list[Any] = []
    for frame in body.split(b"\n\n"):
        if frame.startswith(b"data: "):
            data = frame[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def chunked_body(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (head stripped, chunks joined)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
