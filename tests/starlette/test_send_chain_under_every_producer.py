"""The server's ``send`` chain (tether's middleware, the user's middlewares, uvicorn)
behaves the same whichever producer shape delivers the outputs: a task per request
(``deliver``), one engine step on the loop (``deliver_many``), or an engine thread
(``deliver_many_threadsafe``). A middleware that wraps ``send`` sees what it would
see if the handler's task wrote every event itself: a running task, one context
across the response, a timeout bound to the request, never to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import socket
import threading
import zlib
from collections.abc import AsyncIterator
from typing import Any, Final

import fastapi
import hypercorn.asyncio
import hypercorn.config
import pytest
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.aborts import Aborted
from tests._support.raw_http import read_response
from tests._support.stalled import http_get
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, one_stream_app, requested, serve, stalled_request

SHAPES: Final = ("task", "step", "thread")
OUTPUTS: Final = 40
PAD: Final = "x" * 2048

SENT: contextvars.ContextVar[int] = contextvars.ContextVar("SENT", default=0)
"""Body messages sent so far in this request, as a middleware counts them."""


def timed_send(app: ASGIApp, seconds: float) -> ASGIApp:
    """A pure ASGI middleware that bounds each ``send`` with ``asyncio.timeout`` (a
    common way to cap a write to a slow client)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_within(message: Message) -> None:
            async with asyncio.timeout(seconds):
                await send(message)

        await app(scope, receive, send_within)

    return wrapped


class Producer:
    """Delivers ``outputs`` to ``rid`` in one of :data:`SHAPES`, one output per step."""

    def __init__(self, registry: tether.Registry, shape: str) -> None:
        self.registry = registry
        self.shape = shape

    async def run(self, rid: str, outputs: list[Any]) -> None:
        registry, last = self.registry, len(outputs) - 1
        if self.shape == "thread":
            loop = asyncio.get_running_loop()

            def engine() -> None:
                for index, item in enumerate(outputs):
                    registry.deliver_many_threadsafe([(rid, item, index == last)])
                    # the loop ran the step before the next one (a handshake, no sleep)
                    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(BOUND)

            await asyncio.to_thread(engine)
            return
        for index, item in enumerate(outputs):
            if self.shape == "task":
                registry.deliver(rid, item, finished=index == last)
            else:
                registry.deliver_many([(rid, item, index == last)])
            await asyncio.sleep(0)


def sse(outputs: list[Any]) -> bytes:
    frames = (f"data: {json.dumps(item, separators=(',', ':'))}\n\n" for item in outputs)
    return ("".join(frames) + "data: [DONE]\n\n").encode()


async def one_response(url: str, opened: asyncio.Queue[str], producer: Producer) -> bytes:
    async with requested(url, opened) as (reader, rid):
        outputs = [{"n": n} for n in range(OUTPUTS)]
        run = asyncio.create_task(producer.run(rid, outputs))
        status, body = await read_response(reader)
        await run
    assert status == 200
    return body


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_middleware_that_bounds_send_with_asyncio_timeout_streams_whole(
    shape: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = timed_send(one_stream_app(registry, opened), BOUND)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, shape))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert registry.in_flight == 0
    assert registry.stats().aborted == {}


async def test_a_middleware_s_send_timeout_cuts_that_request_never_the_engine_s_task() -> None:
    """A send that stalls past a middleware's ``asyncio.timeout`` fails its own request
    (the timeout is the request's); the engine's task, which delivered the output
    whose send stalled, goes on serving every other request."""
    aborted = Aborted()
    ended = aborted.seen
    registry = tether.Registry(aborted)
    opened: asyncio.Queue[str] = asyncio.Queue()
    # tether's own send timeout far away: the middleware's 0.3 s is what must fire.
    app = timed_send(one_stream_app(registry, opened, send_timeout=BOUND), 0.3)
    async with (
        serve(app, http="httptools") as (url, _),
        stalled_request(url, opened, http_get("/one")) as (_, rid),
    ):
        stop = asyncio.Event()
        delivered = 0

        async def engine() -> None:  # one task for every request, as engines run
            nonlocal delivered
            while not stop.is_set():
                registry.deliver(rid, {"i": delivered, "pad": PAD})
                delivered += 1
                await asyncio.sleep(0.005)  # the engine's pace

        engine_task = asyncio.create_task(engine())
        abort_seen = asyncio.create_task(ended.wait())
        try:  # the request ends, or the engine's task does (it must not)
            await asyncio.wait(
                (engine_task, abort_seen), timeout=BOUND, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop.set()
            abort_seen.cancel()
        await asyncio.wait((engine_task,), timeout=BOUND)
    assert not engine_task.cancelled(), "the middleware's timeout cancelled the engine's task"
    assert engine_task.exception() is None
    assert aborted == [rid]
    assert registry.in_flight == 0


def counting_sends(app: ASGIApp, totals: list[int]) -> ASGIApp:
    """A middleware that counts body messages in a context variable (set, not reset:
    the count lives in the request's context) and records the count at the last."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.body":
                SENT.set(SENT.get() + 1)
                if not message.get("more_body", False):
                    totals.append(SENT.get())
            await send(message)

        await app(scope, receive, counted)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_send_chain_sees_one_context_for_the_whole_response(shape: str) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    totals: list[int] = []
    bodies: list[int] = []

    def counting_bodies(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def count(message: Message) -> None:
                if message["type"] == "http.response.body":
                    bodies.append(1)
                await send(message)

            await app(scope, receive, count)

        return wrapped

    app = counting_bodies(counting_sends(one_stream_app(registry, opened), totals))
    async with serve(app, http="httptools") as (url, _):
        await one_response(url, opened, Producer(registry, shape))
    assert totals == [len(bodies)]  # every body message counted in one context
    assert registry.in_flight == 0


def reentering(app: ASGIApp, registry: tether.Registry, rids: list[str], how: str) -> ASGIApp:
    """A middleware whose ``send`` calls back into the registry when it sees the body
    of output 3: it aborts its own request (a byte quota, say), or delivers one more
    output to it (an echo)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_and_call_back(message: Message) -> None:
            if b'"n":3}' in message.get("body", b""):
                if how == "abort":
                    registry.abort(rids[0])
                else:
                    registry.deliver(rids[0], {"n": "echo"})
            await send(message)

        await app(scope, receive, send_and_call_back)

    return wrapped


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("how", ["abort", "deliver"])
async def test_a_send_chain_that_reenters_the_registry_ends_its_request_once_in_order(
    shape: str, how: str
) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    opened: asyncio.Queue[str] = asyncio.Queue()
    rids: list[str] = []

    inner = one_stream_app(registry, opened)
    app = reentering(inner, registry, rids, how)
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        async with (
            serve(app, http="httptools") as (url, _),
            requested(url, opened) as (reader, rid),
        ):
            rids.append(rid)
            run = asyncio.create_task(
                Producer(registry, shape).run(rid, [{"n": n} for n in range(8)])
            )
            _, body = await read_response(reader)
            await run
    finally:
        loop.set_exception_handler(None)
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    got = [json.loads(frame.removeprefix(b"data: ")) for frame in frames[:-2]]
    if how == "abort":
        assert got[:4] == [{"n": n} for n in range(4)]
        assert list(got[4]) == ["error"]
        assert len(got) == 5
        assert aborted == [rid]
    else:
        assert got == [{"n": n} for n in range(4)] + [{"n": "echo"}] + [
            {"n": n} for n in range(4, 8)
        ]
        assert aborted == []
    assert seen == []
    assert registry.in_flight == 0


class Passing(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


@contextlib.asynccontextmanager
async def hypercorn_serving(app: ASGIApp) -> AsyncIterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hypercorn.config.Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = config.errorlog = None
    stop = asyncio.Event()
    task = asyncio.create_task(hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        async with asyncio.timeout(BOUND):
            await task


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stack", ["hypercorn", "uvicorn-h11", "uvicorn-base-http-middleware"])
async def test_every_server_stack_streams_whole_under_every_producer_shape(
    stack: str, shape: str
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = one_stream_app(registry, opened)
    producer = Producer(registry, shape)
    if stack == "hypercorn":
        async with hypercorn_serving(app) as url:
            body = await one_response(url, opened, producer)
    elif stack == "uvicorn-h11":
        async with serve(app, http="h11") as (url, _):
            body = await one_response(url, opened, producer)
    else:
        app.user_middleware.insert(0, Middleware(Passing))
        async with serve(app, http="httptools") as (url, _):
            body = await one_response(url, opened, producer)
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert registry.in_flight == 0


def fastapi_app(
    registry: tether.Registry, opened: asyncio.Queue[str], *, http_mw: bool
) -> fastapi.FastAPI:
    """The same endpoint on FastAPI; ``http_mw`` adds an ``@app.middleware("http")``
    (FastAPI's way to add a middleware: a BaseHTTPMiddleware underneath)."""
    app = fastapi.FastAPI()
    app.add_middleware(TetherMiddleware, registry=registry)

    @app.get("/one")
    async def one(request: Request) -> Response:
        stream = registry.open()
        opened.put_nowait(stream.rid)
        return await respond(request, stream, streaming=True)

    if http_mw:

        @app.middleware("http")
        async def timing(request: Request, call_next: RequestResponseEndpoint) -> Response:
            response = await call_next(request)
            response.headers["x-timed"] = "1"
            return response

    return app


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("http_mw", [False, True], ids=["plain", "http-middleware"])
async def test_a_fastapi_app_streams_whole_under_every_producer_shape(
    shape: str, http_mw: bool
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = fastapi_app(registry, opened, http_mw=http_mw)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, shape))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    assert registry.in_flight == 0


async def gzipped_ndjson(
    url: str, opened: asyncio.Queue[str], producer: Producer
) -> tuple[list[Any], list[Any]]:
    """One gzipped NDJSON response of :data:`OUTPUTS` outputs; the outputs and what it
    decompresses to."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            writer.write(b"GET /one HTTP/1.1\r\nHost: t\r\nAccept-Encoding: gzip\r\n\r\n")
            rid = await opened.get()
            outputs = [{"n": n, "t": "lorem ipsum"} for n in range(OUTPUTS)]
            run = asyncio.create_task(producer.run(rid, outputs))
            _, body = await read_response(reader)
            await run
    finally:
        writer.close()
    lines = zlib.decompress(body, 16 + zlib.MAX_WBITS).decode().splitlines()
    return outputs, [json.loads(line) for line in lines]


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_gzipped_ndjson_stream_decompresses_whole_under_every_producer_shape(
    shape: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = one_stream_app(registry, opened, encoder=tether.NDJSON)
    app.user_middleware.insert(0, Middleware(GZipMiddleware, minimum_size=1))
    async with serve(app, http="httptools") as (url, _):
        outputs, got = await gzipped_ndjson(url, opened, Producer(registry, shape))
    assert got == outputs
    assert registry.in_flight == 0


async def test_a_deliver_from_a_foreign_thread_never_drives_the_server_s_send_there() -> None:
    """Misuse: after the first output (checked on the loop), a producer calls plain
    ``deliver()`` from its own thread. Whatever tether does with it, the server's
    ``send`` (uvicorn's transport, which is not thread-safe) runs on the loop's
    thread only."""
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    threads: set[int] = set()

    def recording(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_here(message: Message) -> None:
                threads.add(threading.get_ident())
                await send(message)

            await app(scope, receive, send_here)

        return wrapped

    app = recording(one_stream_app(registry, opened))
    async with (
        serve(app, http="httptools") as (url, _),
        requested(url, opened) as (reader, rid),
    ):
        registry.deliver(rid, {"n": 0})
        await reader.readuntil(b"\n\n")  # out, and the handler parked again
        with contextlib.suppress(tether.TetherError):  # (refused: fine too)
            await asyncio.to_thread(registry.deliver, rid, {"n": 1})
        registry.deliver(rid, {"n": 2}, finished=True)
        await read_response_rest(reader)
    assert threads == {threading.get_ident()}


async def read_response_rest(reader: asyncio.StreamReader) -> bytes:
    """The rest of a chunked response whose head was read (up to its last chunk)."""
    rest = b""
    while not rest.endswith(b"0\r\n\r\n"):
        data = await reader.read(65536)
        assert data, "the connection closed before the end of the response"
        rest += data
    return rest


@pytest.mark.parametrize("shape", SHAPES)
async def test_pipelined_streams_on_one_connection_come_whole_in_order(shape: str) -> None:
    """Two requests pipelined on one connection (uvicorn starts the second inside the
    first one's last ``send``): each stream comes whole, the second after the first."""
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = one_stream_app(registry, opened)
    producer = Producer(registry, shape)
    outputs = [{"n": n} for n in range(OUTPUTS)]
    async with serve(app, http="httptools") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async with asyncio.timeout(BOUND):
                writer.write(http_get("/one") + http_get("/one"))
                bodies = []
                for _ in range(2):
                    rid = await opened.get()
                    run = asyncio.create_task(producer.run(rid, outputs))
                    bodies.append((await read_response(reader))[1])
                    await run
        finally:
            writer.close()
    assert bodies == [sse(outputs)] * 2
    assert registry.in_flight == 0
