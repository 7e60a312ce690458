"""What the Starlette adapter's tests share: the suite's fake engine
(``tests/_support/engine.py``), a fake ASGI server for exact message sequences, an
app, and a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, Literal

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Scope

import tether
from tests._support.engine import HANG as HANG
from tests._support.engine import Changes as Changes
from tests._support.engine import Engine as Engine
from tests._support.loops import LoopFactories, server_loops
from tests._support.raw_http import leave
from tests._support.ready_server import ReadyServer as ReadyServer
from tests._support.servers import serve as serve
from tests._support.stalled import http_get, stalled_client
from tether_starlette import TetherMiddleware, respond

BOUND: Final = 10.0
"""A generous bound on every wait in these tests."""


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """A test marked ``both_loops`` runs on asyncio's loop and on uvloop (an in-process
    uvicorn serves on the test's loop); every other test on asyncio's own loop."""
    return server_loops(item)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine()
    yield engine
    await engine.stop()


async def _answer(request: Request, *, streaming: bool) -> Response:
    """Opens a stream (or a batch with ``?batch=N``) and answers with it."""
    params = request.query_params
    engine: Engine = request.app.state.engine
    registry = engine.registry
    size = int(params.get("batch", "0"))
    timeout = float(params["timeout"]) if "timeout" in params else None
    source = registry.open_batch(size, timeout=timeout) if size else registry.open(timeout=timeout)
    engine.submit(source)
    encoder = tether.NDJSON if params.get("encoder") == "ndjson" else None
    ping_interval = float(params.get("ping", "15"))
    return await respond(
        request, source, streaming=streaming, encoder=encoder, ping_interval=ping_interval
    )


async def stream_endpoint(request: Request) -> Response:
    return await _answer(request, streaming=True)


async def json_endpoint(request: Request) -> Response:
    return await _answer(request, streaming=False)


async def body_endpoint(request: Request) -> Response:
    """Reads the body as it arrives; reports its digest and how many messages carried it."""
    digest = hashlib.sha256()
    messages = 0
    async for chunk in request.stream():
        digest.update(chunk)
        messages += 1
    return JSONResponse({"sha256": digest.hexdigest(), "messages": messages})


def make_app(
    engine: Engine, *, middleware: int = 1, producer_writes: bool = False, **options: Any
) -> Starlette:
    """The test app: ``/stream``, ``/json`` and ``/body``, under ``middleware`` copies
    of TetherMiddleware (0 to test respond() without it), with ``producer_writes``."""
    app = Starlette(
        routes=[
            Route("/stream", stream_endpoint, methods=["GET", "POST"]),
            Route("/json", json_endpoint, methods=["GET", "POST"]),
            Route("/body", body_endpoint, methods=["POST"]),
        ],
        middleware=[
            Middleware(TetherMiddleware, registry=engine.registry, producer_writes=producer_writes)
        ]
        * middleware,
        **options,
    )
    app.state.engine = engine
    return app


class FakeServer(Changes):
    """A fake ASGI server for one HTTP request, driven by the test.

    ``receive`` hands out the body messages given, then waits for :meth:`disconnect`.
    ``send`` records messages; once the client is gone it does nothing (ASGI < 2.4)
    or raises :class:`OSError` (ASGI >= 2.4). With ``uvicorn_like``, it reports a
    disconnect as soon as the response is complete, as uvicorn does.
    """

    def __init__(
        self,
        *,
        spec_version: str = "2.3",
        method: str = "GET",
        path: str = "/stream",
        query: str = "",
        body: Sequence[bytes] = (b"",),
        uvicorn_like: bool = False,
    ) -> None:
        super().__init__()
        self.scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": spec_version},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [(b"host", b"test")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 80),
        }
        self.raises = tuple(map(int, spec_version.split("."))) >= (2, 4)
        self.uvicorn_like = uvicorn_like
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        for index, chunk in enumerate(body):
            more = index < len(body) - 1
            self.incoming.put_nowait({"type": "http.request", "body": chunk, "more_body": more})
        self.sent: list[Message] = []
        self.pulled = 0
        self.receiving = 0
        self.most_receiving = 0
        self.gone = False

    async def receive(self) -> Message:
        self.receiving += 1
        self.most_receiving = max(self.most_receiving, self.receiving)
        try:
            message = await self.incoming.get()
        finally:
            self.receiving -= 1
        self.pulled += 1
        self.signal()
        return message

    async def send(self, message: Message) -> None:
        if self.gone:
            if self.raises:
                raise OSError("the client is gone")
            return
        self.sent.append(message)
        if self.uvicorn_like and self.complete:
            self.incoming.put_nowait({"type": "http.disconnect"})
        self.signal()

    def disconnect(self, *, tell_receive: bool = True) -> None:
        """The client leaves; ``tell_receive=False`` lets only ``send`` find out."""
        self.gone = True
        if tell_receive:
            self.incoming.put_nowait({"type": "http.disconnect"})

    @property
    def bodies(self) -> list[tuple[bytes, bool]]:
        """``(body, more_body)`` of every body message sent."""
        return [
            (message.get("body", b""), message.get("more_body", False))
            for message in self.sent
            if message["type"] == "http.response.body"
        ]

    @property
    def complete(self) -> bool:
        return any(not more for _, more in self.bodies)

    async def run(self, app: ASGIApp) -> None:
        """Call ``app`` for this request (bounded)."""
        async with asyncio.timeout(BOUND):
            await app(self.scope, self.receive, self.send)


def one_stream_app(
    registry: tether.Registry,
    opened: asyncio.Queue[str],
    *,
    producer_writes: bool | Literal["threads"] = False,
    **options: Any,
) -> Starlette:
    """``/one`` opens a stream (for the query's ``rid``, if it has one), puts its rid in
    ``opened`` and streams it with ``respond``'s ``options``."""

    async def handle(request: Request) -> Response:
        stream = registry.open(request.query_params.get("rid"))
        opened.put_nowait(stream.rid)
        return await respond(request, stream, streaming=True, **options)

    return Starlette(
        routes=[Route("/one", handle)],
        middleware=[
            Middleware(TetherMiddleware, registry=registry, producer_writes=producer_writes)
        ],
    )


@contextlib.asynccontextmanager
async def requested(
    url: str, opened: asyncio.Queue[str], target: str = "/one"
) -> AsyncIterator[tuple[asyncio.StreamReader, str]]:
    """GET ``target`` on a raw connection to ``url``; yields its reader and the rid of
    the stream its handler opened, all within :data:`BOUND`."""
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            writer.write(http_get(target))
            yield reader, await opened.get()
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def stalled_request(
    url: str, opened: asyncio.Queue[str], request: bytes
) -> AsyncIterator[tuple[socket.socket, str]]:
    """Send ``request`` to ``url`` from a client that reads nothing; yields its socket
    and the rid of the stream its handler opened (awaited within :data:`BOUND`)."""
    port = int(url.rsplit(":", 1)[1])
    async with stalled_client(port, request) as sock:
        async with asyncio.timeout(BOUND):
            rid = await opened.get()
        yield sock, rid


async def leave_until_aborted(engine: Engine, writer: asyncio.StreamWriter, rid: str) -> float:
    """The client of ``writer`` leaves; wait until ``rid`` was aborted and nothing is in
    flight any more. Returns when the client left (``leave``'s clock)."""
    left_at = await leave(writer)
    await engine.until(lambda: rid in engine.aborted_at)
    await engine.until(lambda: engine.registry.in_flight == 0)
    return left_at
