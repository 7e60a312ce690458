"""A handler that streams by hand (``async for output in stream`` and its own writes)
has its client's disconnect noticed and counted as one, in both of aiohttp's
cancellation modes and on both loops: the work is aborted at once, exactly once."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

import tether_aiohttp

from .conftest import Env, StartServer, raw_request, read_until

BOUND = 10.0
LATENCY = 0.1
"""Disconnect-to-abort bound, in seconds (the design's "within milliseconds", with room)."""


@pytest.mark.both_loops
async def test_a_hand_written_stream_loop_counts_its_client_leaving_as_a_disconnect(
    env: Env, start_server: StartServer
) -> None:
    tracker = env.tracker

    async def stream_by_hand(request: web.Request) -> web.StreamResponse:
        stream = env.registry.open()
        tracker.note(tracker.opened, [stream.rid])
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            env.registry.deliver(stream.rid, "first")
            async with stream:
                async for output in stream:  # waits for outputs that never come
                    await response.write(f"data: {output}\n\n".encode())
        finally:
            tracker.note(tracker.handled, [stream.rid])
        return response

    app = web.Application()
    tether_aiohttp.setup(app, env.registry)
    app.router.add_get("/", stream_by_hand)
    port = await start_server(app)
    async with asyncio.timeout(BOUND):
        reader, writer = await raw_request(port, "/")
        await read_until(reader, b"data: first")
        writer.close()
        closed_at = asyncio.get_running_loop().time()
        await tracker.until(lambda: len(tracker.aborted) == 1)
        await tracker.until(lambda: len(tracker.handled) == 1)
    assert max(tracker.aborted.values()) - closed_at <= LATENCY
    assert env.registry.in_flight == 0
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}
