"""On real servers (uvicorn with both parsers, with and without producer writes;
hypercorn), a silent source pings at the interval, and an output delivered between
pings goes out at once, not with the next ping; for a stream, a batch and a
resumable stream's follower. The response ends with one terminal frame, each output
once, in order."""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
import tether.resume
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND
from .test_json_wait_on_servers import serving as json_wait_serving

PING = 0.1
PING_FRAME = b": ping\n\n"
OUTPUTS = 4


class _Client:
    """Reads the raw body, recording when each frame arrived."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, bytes]] = []
        self._buffer = b""
        self.changed = asyncio.Event()

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while b"\n\n" in self._buffer:
            frame, self._buffer = self._buffer.split(b"\n\n", 1)
            self.frames.append((time.monotonic(), frame + b"\n\n"))
        self.changed.set()

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    def pings(self) -> list[float]:
        return [at for at, frame in self.frames if frame == PING_FRAME]

    def data(self) -> list[bytes]:
        return [frame for _, frame in self.frames if frame != PING_FRAME]

    def pinged_past(self, seen: int) -> bool:
        return len(self.pings()) > seen

    def has(self, marker: bytes) -> bool:
        return self.arrival(marker) is not None

    def arrival(self, marker: bytes) -> float | None:
        for at, frame in self.frames:
            if marker in frame:
                return at
        return None


def _serving(server: str, app: Starlette) -> Any:
    return json_wait_serving("uvicorn" if server.startswith("uvicorn-p") else server, app)


def _app(registry: tether.Registry, handler: Any, producer_writes: bool) -> Starlette:
    app = Starlette(routes=[Route("/s", handler)])
    app.add_middleware(TetherMiddleware, registry=registry, producer_writes=producer_writes)
    return app


@pytest.mark.parametrize(
    ("server", "source"),
    [
        ("uvicorn", "stream"),
        ("uvicorn", "batch"),
        ("uvicorn", "follower"),
        ("uvicorn-producer-writes", "stream"),
        ("uvicorn-producer-writes", "follower"),
        ("uvicorn-h11", "stream"),
        ("hypercorn", "stream"),
    ],
)
async def test_a_silent_source_pings_at_the_interval_and_outputs_between_pings_go_out_at_once(
    server: str, source: str
) -> None:
    producer_writes = server == "uvicorn-producer-writes"
    registry = tether.Registry()
    resume = tether.resume.Resume()
    opened: asyncio.Queue[list[str]] = asyncio.Queue()

    async def handler(request: Request) -> Response:
        if source == "batch":
            batch = registry.open_batch(2, keep_going=True)
            registry.deliver(batch.rids[0], "first")
            await opened.put(list(batch.rids))
            return await respond(request, batch, streaming=True, ping_interval=PING)
        stream = registry.open()
        registry.deliver(stream.rid, "first")
        await opened.put([stream.rid])
        return await respond(
            request,
            stream,
            streaming=True,
            ping_interval=PING,
            resume=resume if source == "follower" else None,
        )

    client = _Client()
    latencies: list[float] = []
    async with (
        _serving(server, _app(registry, handler, producer_writes)) as url,
        httpx.AsyncClient(timeout=BOUND) as http,
        http.stream("GET", f"{url}/s") as response,
    ):
        assert response.status_code == 200

        async def read() -> None:
            async for data in response.aiter_raw():
                client.feed(data)

        reading = asyncio.create_task(read())
        try:
            async with asyncio.timeout(BOUND):
                rids = await opened.get()
            rid = rids[0]
            await client.until(lambda: len(client.pings()) >= 3)
            pings = client.pings()
            gaps = [b - a for a, b in pairwise(pings)]
            # Pings keep coming, at about the interval (generous: a loaded machine).
            assert statistics.median(gaps) >= PING / 2, gaps  # (one read may hold two)
            assert max(gaps) < 1.0, gaps
            for n in range(OUTPUTS):
                seen = len(client.pings())
                await client.until(functools.partial(client.pinged_past, seen))
                marker = f'"out{n}"'.encode()
                delivered = time.monotonic()
                registry.deliver(rid, f"out{n}")
                await client.until(functools.partial(client.has, marker))
                arrived = client.arrival(marker)
                assert arrived is not None
                latencies.append(arrived - delivered)
            seen = len(client.pings())
            # Pings go on after the outputs.
            await client.until(lambda: len(client.pings()) >= seen + 2)
            registry.deliver(rid, "last", finished=True)
            if source == "batch":
                registry.deliver(rids[1], "other", finished=True)
            async with asyncio.timeout(BOUND):
                await reading
        finally:
            reading.cancel()
    # At once: not held until the next ping (PING after the last one written).
    assert statistics.median(latencies) < PING / 2, latencies
    data = client.data()
    assert data[-1] == b"data: [DONE]\n\n", data
    assert sum(frame == b"data: [DONE]\n\n" for frame in data) == 1, data
    outs = [n for frame in data for n in range(OUTPUTS) if f'"out{n}"'.encode() in frame]
    assert outs == list(range(OUTPUTS)), data  # each once, in order
    await resume.aclose()
