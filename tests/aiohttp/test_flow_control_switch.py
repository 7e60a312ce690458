"""A stream's writes switch between the direct path (straight to an idle transport,
or from the producer's step) and the queued path (through aiohttp's writer, which
waits for flow control) as a client reads slowly, then fast: every output reaches
it once, in order, on a real socket."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, Final

import pytest
from aiohttp import web

import tether
import tether_aiohttp
from tests._support.stalled import http_get

from .conftest import StartServer, chunked_body

BOUND: Final = 10.0
OUTPUTS: Final = 400
PAD: Final = "x" * 2048
"""About 2 KiB per output: a few dozen fill the small socket buffers below."""
BUFFER: Final = 8192
"""The server's send buffer and the client's receive buffer, in bytes."""


class Paced:
    """A producer that delivers one output per loop iteration, and holds the second
    half back until the client starts reading."""

    def __init__(self, registry: tether.Registry) -> None:
        self.registry = registry
        self.half = asyncio.Event()  # the first half is delivered
        self.reading = asyncio.Event()  # the client started reading

    async def run(self, rid: str) -> None:
        for index in range(OUTPUTS):
            if index == OUTPUTS // 2:
                self.half.set()
                await self.reading.wait()
            self.registry.deliver(rid, {"i": index, "pad": PAD}, finished=index == OUTPUTS - 1)
            await asyncio.sleep(0)  # one output per step, as an engine's loop does


def paced_app(
    registry: tether.Registry,
    paced: Paced,
    tasks: set[asyncio.Task[None]],
    writes: dict[str, int],
) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert isinstance(transport, asyncio.Transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        # Every write of the response ends in one of these two calls, whichever path.
        for name in ("write", "writelines"):
            original = getattr(transport, name)

            def counted(data: Any, original: Any = original) -> None:
                writes["transport"] += 1
                original(data)

            setattr(transport, name, counted)
        stream = registry.open()
        task = asyncio.create_task(paced.run(stream.rid))
        tasks.add(task)
        return await tether_aiohttp.respond(request, stream, streaming=True)

    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.router.add_get("/paced", handle)
    return app


async def test_outputs_arrive_once_and_in_order_when_a_slow_reader_turns_fast(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = {"queued": 0, "transport": 0}
    original_write = web.StreamResponse.write

    async def counted_write(self: web.StreamResponse, data: bytes) -> None:
        writes["queued"] += 1
        await original_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted_write)
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    paced = Paced(registry)
    tasks: set[asyncio.Task[None]] = set()
    port = await start_server(paced_app(registry, paced, tasks, writes))
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        sock.setblocking(False)
        async with asyncio.timeout(BOUND):
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, http_get("/paced"))
            await paced.half.wait()  # half the outputs delivered, none read: queued
            paced.reading.set()
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                data = await loop.sock_recv(sock, 1 << 16)
                assert data, "the server closed the connection early"
                raw += data
        await asyncio.gather(*tasks)
    finally:
        sock.close()
    frames = chunked_body(raw).split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    indices = [_index(frame) for frame in frames[:-2]]
    assert indices == list(range(OUTPUTS))
    assert aborted == []
    assert registry.in_flight == 0
    # Both paths carried outputs: aiohttp's writer (a backlog under flow control) and
    # the direct one (transport writes beyond the writer's own, its head and its end).
    assert writes["queued"] >= 1
    assert writes["transport"] - writes["queued"] - 2 >= 10


def _index(frame: bytes) -> int:
    assert frame.startswith(b"data: "), frame
    output = json.loads(frame[len(b"data: ") :])
    assert output["pad"] == PAD
    index: int = output["i"]
    return index
