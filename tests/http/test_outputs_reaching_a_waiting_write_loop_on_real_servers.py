"""Outputs that reach a write loop while it waits, on real servers (uvicorn through
the woken loop and through the producer's step, aiohttp through its direct writes):
values one JSON writer refuses and the other writes go out as the standard library
writes them; an output nothing can write ends the stream after everything before it,
once; what an ``async for`` took before ``respond()`` goes out first, then every later
output at once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

import tether
from tests._support.direct_writes import sse_values
from tests._support.servers import serving

BOUND = 10.0

SERVERS = ("starlette", "starlette-producer-writes", "aiohttp")
"""Uvicorn's woken write loop, with the producer's step writing, aiohttp's direct writes."""


def _serving(server: str, registry: tether.Registry, answer: Any) -> Any:
    adapter = server.removesuffix("-producer-writes")
    producer_writes = server.endswith("producer-writes")
    return serving(adapter, registry, "GET", "/s", answer, producer_writes=producer_writes)


class _Bad:
    """An output the transform refuses."""


def _transform(output: Any) -> Any:
    if isinstance(output, _Bad):
        raise ValueError("refused by the transform")
    return output


def _frames(body: bytes) -> list[bytes]:
    return [f for f in body.split(b"\n\n") if f and f != b": ping"]


@pytest.mark.both_loops
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("bad", ["lone-surrogate", "transform-refuses"])
async def test_values_reaching_a_waiting_loop_go_out_as_json_writes_them_and_a_bad_one_ends_it(
    server: str, bad: str
) -> None:
    ended = asyncio.Event()
    registry = tether.Registry(lambda rid: ended.set())
    opened: asyncio.Queue[str] = asyncio.Queue()

    async def answer(verbs: Any, request: Any) -> Any:
        stream = registry.open()
        registry.deliver(stream.rid, "first")
        await opened.put(stream.rid)
        return await verbs.respond(
            request, stream, streaming=True, ping_interval=3600, transform=_transform
        )

    values: list[Any] = [2**64, {1: "a"}, float("nan"), {"deep": [-(2**70)]}]
    body = b""
    async with (
        _serving(server, registry, answer) as url,
        httpx.AsyncClient(timeout=BOUND) as http,
        http.stream("GET", f"{url}/s") as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_raw()
        async with asyncio.timeout(BOUND):
            rid = await opened.get()
            while b"first" not in body:
                body += await anext(chunks)
            for n, value in enumerate(values):
                registry.deliver(rid, value)  # (the loop is parked: one at a time)
                while len(_frames(body)) < n + 2:
                    body += await anext(chunks)
            registry.deliver(rid, "\ud800" if bad == "lone-surrogate" else _Bad())
            registry.deliver(rid, "after")  # (never written: the stream ended before it)
            async for data in chunks:
                body += data
            await ended.wait()  # the request was aborted
    frames = _frames(body)
    assert frames[:5] == [
        b'data: "first"',
        b"data: 18446744073709551616",
        b'data: {"1":"a"}',
        b"data: null",
        b'data: {"deep":[-1180591620717411303424]}',
    ], frames
    assert len(frames) == 7, frames
    error = json.loads(frames[5].removeprefix(b"data: "))
    assert error["error"]["code"] == 500, error
    assert frames[6] == b"data: [DONE]", frames
    assert registry.in_flight == 0


@pytest.mark.both_loops
@pytest.mark.parametrize("server", SERVERS)
async def test_what_async_for_took_before_respond_goes_out_first_and_later_outputs_at_once(
    server: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()

    async def answer(verbs: Any, request: Any) -> Any:
        stream = registry.open()
        for n in range(4):
            registry.deliver(stream.rid, n)
        async for output in stream:  # takes all four, hands out one
            assert output == 0
            break
        await opened.put(stream.rid)
        return await verbs.respond(request, stream, streaming=True, ping_interval=3600)

    body = b""
    async with (
        _serving(server, registry, answer) as url,
        httpx.AsyncClient(timeout=BOUND) as http,
        http.stream("GET", f"{url}/s") as response,
    ):
        chunks = response.aiter_raw()
        async with asyncio.timeout(BOUND):
            rid = await opened.get()
            while 3 not in sse_values(body + b"data: [DONE]\n\n"):
                body += await anext(chunks)
            for n in range(4, 8):
                registry.deliver(rid, n)
                while n not in sse_values(body + b"data: [DONE]\n\n"):
                    body += await anext(chunks)
            registry.deliver(rid, 8, finished=True)
            async for data in chunks:
                body += data
    assert sse_values(body) == [1, 2, 3, 4, 5, 6, 7, 8, "[DONE]"], body
    assert registry.in_flight == 0
