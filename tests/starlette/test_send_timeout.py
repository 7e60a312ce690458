"""A client that stops reading without closing its connection is ended by the send
timeout, on real servers (uvicorn's two parsers, with and without producer writes,
hypercorn), with a real stalled socket."""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
from tests._support.stalled import http_get, stalled_client
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, HANG, Engine, make_app, serve
from .test_json_wait_on_servers import serving

SEND_TIMEOUT: Final = 0.3
BIG: Final = "x" * (256 * 1024)
"""One large output; 32 of them (8 MiB) outfill every buffer between server and client."""


async def slow_endpoint(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    stream = engine.registry.open()
    engine.submit(stream)
    return await respond(
        request, stream, streaming=True, ping_interval=0.05, send_timeout=SEND_TIMEOUT
    )


async def test_a_stalled_client_is_ended_by_the_send_timeout_and_its_request_freed(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    engine.script = [BIG] * 32 + [HANG]
    app = make_app(engine)
    app.router.routes.append(Route("/slow", slow_endpoint))
    caplog.set_level(logging.WARNING, logger="tether")
    async with serve(app) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        async with stalled_client(port, http_get("/slow")):
            await engine.until(lambda: len(engine.submitted) == 1)
            started = asyncio.get_running_loop().time()
            await engine.until(lambda: bool(engine.aborted_at))
            elapsed = asyncio.get_running_loop().time() - started
            assert list(engine.aborted_at) == engine.submitted
            assert engine.registry.in_flight == 0
            aborted = engine.registry.stats().aborted
            assert aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}
    assert elapsed < BOUND
    assert any("read nothing" in record.getMessage() for record in caplog.records)


async def test_a_client_that_keeps_reading_gets_the_whole_large_stream(engine: Engine) -> None:
    engine.script = [BIG] * 8 + [{"last": True}]
    app = make_app(engine)
    app.router.routes.append(Route("/slow", slow_endpoint))
    async with serve(app) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(http_get("/slow"))
        received = 0
        async with asyncio.timeout(BOUND):
            while chunk := await reader.read(64 * 1024):
                received += len(chunk)
                if chunk.endswith(b"0\r\n\r\n"):
                    break
        writer.close()
        await writer.wait_closed()
    assert received > 8 * len(BIG)
    assert engine.aborted_at == {}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize(
    "server", ["uvicorn", "uvicorn-h11", "uvicorn-producer-writes", "hypercorn"]
)
async def test_a_stalled_client_of_a_silent_stream_is_cut_by_the_send_timeout_once(
    server: str,
) -> None:
    aborted = asyncio.Event()
    registry = tether.Registry(lambda rid: aborted.set())
    opened: asyncio.Queue[str] = asyncio.Queue()

    async def handler(request: Request) -> Response:
        stream = registry.open()
        await opened.put(stream.rid)
        return await respond(
            request, stream, streaming=True, ping_interval=0.05, send_timeout=SEND_TIMEOUT
        )

    app = Starlette(routes=[Route("/slow", handler)])
    app.add_middleware(
        TetherMiddleware, registry=registry, producer_writes=server.endswith("producer-writes")
    )
    name = "uvicorn" if server == "uvicorn-producer-writes" else server
    async with serving(name, app) as url:
        port = int(url.rsplit(":", 1)[1])
        async with stalled_client(port, http_get("/slow")), asyncio.timeout(BOUND):
            rid = await opened.get()
            for _ in range(32):  # (8 MiB: more than every buffer on the way holds)
                registry.deliver(rid, BIG)
                await asyncio.sleep(0)  # (a yield: the loop takes each as it comes)
            await aborted.wait()  # then silence: only pings are due
            assert registry.in_flight == 0
    assert registry.stats().aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}
