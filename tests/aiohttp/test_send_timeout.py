"""A client that stops reading without closing its connection is ended by the send
timeout, in both cancellation modes, with a real stalled socket; its connection is
dropped."""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import pytest
from aiohttp import web

import tether
import tether_aiohttp
from tests._support.stalled import http_get, stalled_client

from .conftest import HOLD, Env, StartServer, script

BOUND: Final = 10.0
SEND_TIMEOUT: Final = 0.3
BIG: Final = "x" * (256 * 1024)
"""One large output; 32 of them (8 MiB) outfill every buffer between server and client."""


def slow_app(env: Env, end: str) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        stream = env.registry.open()
        env.tracker.note(env.tracker.opened, [stream.rid])
        env.producer.submit(stream.rid, script([BIG] * 32, end))
        return await tether_aiohttp.respond(
            request, stream, streaming=True, ping_interval=0.05, send_timeout=SEND_TIMEOUT
        )

    app = web.Application()
    tether_aiohttp.setup(app, env.registry)
    app.router.add_get("/slow", handle)
    return app


async def test_a_stalled_client_is_ended_by_the_send_timeout_and_its_request_freed(
    env: Env, start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tether.aiohttp")
    port = await start_server(slow_app(env, HOLD))
    tracker = env.tracker
    async with stalled_client(port, http_get("/slow")) as sock:
        async with asyncio.timeout(BOUND):
            await tracker.until(lambda: bool(tracker.aborted))
        assert list(tracker.aborted) == tracker.opened
        assert env.registry.in_flight == 0
        aborted = env.registry.stats().aborted
        assert aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}
        # The server dropped the connection: reading what it queued ends in a reset or EOF.
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(BOUND):
            try:
                while await loop.sock_recv(sock, 1 << 20):
                    pass
            except ConnectionResetError:
                pass  # the abort reached the client as a reset: dropped all the same
    assert any("read nothing" in record.getMessage() for record in caplog.records)


async def test_a_client_that_keeps_reading_gets_the_whole_large_stream(
    env: Env, start_server: StartServer
) -> None:
    port = await start_server(slow_app(env, "finish"))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_get("/slow"))
    received = 0
    tail = b""
    async with asyncio.timeout(BOUND):
        while chunk := await reader.read(64 * 1024):
            received += len(chunk)
            tail = (tail + chunk)[-64:]
            # chunked, or answered whole (Content-Length) when the stream was over at once
            if tail.endswith((b"0\r\n\r\n", b"data: [DONE]\n\n")):
                break
    writer.close()
    await writer.wait_closed()
    assert received > 32 * len(BIG)
    assert env.tracker.aborted == {}
    assert env.registry.in_flight == 0
