"""Memory is bounded in bytes, not in outputs: 1 MB outputs streamed to a client that
never reads end the request at the byte budget, on real servers, and the server holds
about the budget, never the backlog a count of outputs would allow.

Each server runs in the test's own loop, so ``tracemalloc`` sees every Python-side
byte the server holds: the registry's backlog, the encoded chunks, the transport's
buffer. (The kernel's socket buffers are outside it, and bounded by the kernel.)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import AsyncIterator, Callable

import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

import tether
import tether_aiohttp
import tether_starlette
from tests._support.engine import Engine, Pause
from tests._support.ready_server import ReadyServer

MIB = 1024 * 1024
BUDGET = 8 * MIB
OUTPUT = "x" * MIB
MOST = 200
"""Outputs the producer offers at most: by count alone (max_pending=1024), all of them
would wait, 200 MB; the byte budget must end the request after about 8."""
BOUND = 10.0


def _registry() -> tether.Registry:
    return tether.Registry(max_pending_bytes=BUDGET)


def _engine(registry: tether.Registry) -> Engine:
    """Delivers 1 MB outputs to the open request, one per loop turn (one engine step),
    until it is gone or MOST were offered; it never finishes the request."""
    engine = Engine(registry)
    engine.script = [{"text": OUTPUT}, Pause()] * MOST
    return engine


@contextlib.asynccontextmanager
async def _starlette(registry: tether.Registry, producer: Engine, http: str) -> AsyncIterator[int]:
    async def stream(request: Request) -> Response:
        source = registry.open()
        producer.submit(source)
        return await tether_starlette.respond(request, source, streaming=True, send_timeout=2)

    app = Starlette()
    app.add_middleware(tether_starlette.TetherMiddleware, registry=registry)
    app.add_route("/stream", stream)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, http=http, lifespan="off", log_config=None
    )
    server = ReadyServer(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(BOUND):
            await server.ready.wait()
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait([task], timeout=BOUND)


@contextlib.asynccontextmanager
async def _aiohttp(registry: tether.Registry, producer: Engine, http: str) -> AsyncIterator[int]:
    async def stream(request: web.Request) -> web.StreamResponse:
        source = registry.open()
        producer.submit(source)
        return await tether_aiohttp.respond(request, source, streaming=True, send_timeout=2)

    app = web.Application()
    tether_aiohttp.setup(app, registry, drain_timeout=0)
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app)  # aiohttp's defaults: no handler cancellation
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


Server = Callable[[tether.Registry, Engine, str], contextlib.AbstractAsyncContextManager[int]]

SERVERS = [
    pytest.param(_starlette, "h11", id="starlette-h11"),
    pytest.param(_starlette, "httptools", id="starlette-httptools"),
    pytest.param(_aiohttp, "", id="aiohttp"),
]


@pytest.mark.both_loops
@pytest.mark.parametrize(("serve", "http"), SERVERS)
async def test_large_outputs_to_a_client_that_never_reads_stay_within_the_byte_budget(
    serve: Server, http: str
) -> None:
    registry = _registry()
    producer = _engine(registry)
    tracemalloc.start()
    try:
        async with serve(registry, producer, http) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            tracemalloc.reset_peak()
            # the engine's script ends when the request is gone (or after MOST outputs)
            await producer.until(lambda: bool(producer.submitted) and not producer.running)
            # The client never read a byte: the request ended at the budget, with a clear
            # error (ConsumerTooSlow naming max_pending_bytes), long before MOST outputs.
            assert sum(producer.delivered.values()) < MOST // 4
            assert registry.stats().aborted == {"consumer_too_slow": 1}
            assert registry.in_flight == 0
            _, peak = tracemalloc.get_traced_memory()
            assert peak < BUDGET + 24 * MIB, f"peak {peak / MIB:.0f} MiB"
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            del reader
    finally:
        tracemalloc.stop()
