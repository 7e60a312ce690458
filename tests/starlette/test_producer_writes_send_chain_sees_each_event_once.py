"""With ``producer_writes``, whichever producer delivers (a task, an engine step on the
loop, an engine thread's hand-over), a send chain sees each body message once, as it
would if the handler's task wrote every event: what a middleware does before it hands
a message on (counts it, compresses it, logs it) happens once per event, and the
client gets each event once, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import fastapi
import pytest
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, one_stream_app, requested, serve
from .test_send_chain_under_every_producer import (
    OUTPUTS,
    SHAPES,
    Producer,
    gzipped_ndjson,
    one_response,
    sse,
    timed_send,
)


def recording(app: ASGIApp, bodies: list[bytes]) -> ASGIApp:
    """A pure ASGI middleware that records each body it is handed (a byte counter, an
    access log) before it passes the message on."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def record(message: Message) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message.get("body", b""))
            await send(message)

        await app(scope, receive, record)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_middleware_inside_a_timed_send_sees_each_event_once(shape: str) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    bodies: list[bytes] = []
    inner = one_stream_app(registry, opened, producer_writes=True)
    app = timed_send(recording(inner, bodies), BOUND)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, shape))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert b"".join(bodies) == body  # what the middleware saw is what went out
    assert registry.in_flight == 0
    assert registry.stats().aborted == {}


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_gzipped_stream_under_a_timed_send_decompresses_to_each_event_once(
    shape: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    inner = one_stream_app(registry, opened, producer_writes=True, encoder=tether.NDJSON)
    inner.user_middleware.insert(0, Middleware(GZipMiddleware, minimum_size=1))
    app = timed_send(inner, BOUND)
    async with serve(app, http="httptools") as (url, _):
        outputs, got = await gzipped_ndjson(url, opened, Producer(registry, shape))
    assert got == outputs
    assert registry.in_flight == 0


def failing_after_the_send(app: ASGIApp, nth: int) -> ASGIApp:
    """A pure ASGI middleware whose ``nth`` body message is sent, then fails with a
    ``RuntimeError`` of its own (a quota, a consistency check after the write)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        sent = 0

        async def send_then_check(message: Message) -> None:
            nonlocal sent
            await send(message)
            if message["type"] == "http.response.body":
                sent += 1
                if sent == nth:
                    raise RuntimeError("over quota")

        await app(scope, receive, send_then_check)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_send_chain_that_fails_after_sending_ends_the_response_with_each_event_once(
    shape: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = failing_after_the_send(one_stream_app(registry, opened, producer_writes=True), 5)
    async with (
        serve(app, http="httptools") as (url, _),
        requested(url, opened) as (reader, rid),
    ):
        outputs = [{"n": n} for n in range(OUTPUTS)]
        run = asyncio.create_task(Producer(registry, shape).run(rid, outputs))
        raw = b""
        async with asyncio.timeout(BOUND):  # until the server cuts it, or its end
            while not raw.endswith(b"\r\n0\r\n\r\n") and (more := await reader.read(65536)):
                raw += more
        await run
    # the first five events went out, once each; the fifth's failure ended the response
    assert [raw.count(b'data: {"n":%d}\n' % n) for n in range(OUTPUTS)] == [1] * 5 + [0] * (
        OUTPUTS - 5
    )
    assert registry.in_flight == 0


def naming_the_task(app: ASGIApp, names: list[str]) -> ASGIApp:
    """A pure ASGI middleware that tags each send with the current task's name (a
    log line's field, a task-local lookup), as code that runs in a task may."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:
            task = asyncio.current_task()
            names.append(task.get_name())  # type: ignore[union-attr]
            await send(message)

        await app(scope, receive, named)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_send_wrapper_that_reads_the_current_task_streams_whole(shape: str) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    names: list[str] = []
    app = naming_the_task(one_stream_app(registry, opened, producer_writes=True), names)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, shape))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert registry.in_flight == 0
    assert registry.stats().aborted == {}


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_fastapi_app_with_gzip_and_an_http_middleware_streams_whole(shape: str) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = fastapi.FastAPI()
    app.add_middleware(TetherMiddleware, registry=registry, producer_writes=True)
    app.add_middleware(GZipMiddleware, minimum_size=1)

    @app.get("/one")
    async def one(request: Request) -> Response:
        stream = registry.open()
        opened.put_nowait(stream.rid)
        return await respond(request, stream, streaming=True, encoder=tether.NDJSON)

    @app.middleware("http")
    async def tagging(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers["x-tagged"] = "1"
        return response

    async with serve(app, http="httptools") as (url, _):
        outputs, got = await gzipped_ndjson(url, opened, Producer(registry, shape))
    assert got == outputs
    assert registry.in_flight == 0


def guarded_timed_send(app: ASGIApp, failures: list[BaseException]) -> ASGIApp:
    """A pure ASGI middleware that bounds each ``send`` with ``asyncio.timeout`` and
    notes a send that fails instead of failing the app with it (a client gone, a send
    too slow: logged, the app goes on)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_note(message: Message) -> None:
            try:
                async with asyncio.timeout(BOUND):
                    await send(message)
            except Exception as exc:
                failures.append(exc)

        await app(scope, receive, send_or_note)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_send_wrapper_that_notes_failed_sends_gets_every_event_sent(shape: str) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    failures: list[BaseException] = []
    app = guarded_timed_send(one_stream_app(registry, opened, producer_writes=True), failures)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, shape))
    assert failures == []
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert registry.in_flight == 0
