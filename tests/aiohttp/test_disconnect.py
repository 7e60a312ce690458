"""A client that leaves aborts its work and frees its requests, with aiohttp's default
``handler_cancellation=False`` (a transport watcher notices) and with ``True``
(aiohttp cancels the handler). Clients are bare connections the test closes."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer

import tether_aiohttp

from .conftest import Env, StartServer, build_app, raw_request, read_until, start_default_server

BOUND = 10.0
LATENCY = 0.1
"""Disconnect-to-abort bound, in seconds (the design's "within milliseconds", with room)."""

CASES = {
    "during a stream": "/?n=1&end=hold",
    "during a non-streaming wait": "/?n=1&end=hold&streaming=0",
    "during a non-streaming batch wait": "/?n=1&end=hold&streaming=0&batch=3",
}


@pytest.mark.parametrize("target", CASES.values(), ids=CASES.keys())
async def test_client_disconnect_aborts_every_open_request_and_frees_it(
    env: Env, start_server: StartServer, target: str
) -> None:
    tracker = env.tracker
    port = await start_server(build_app(env))
    async with asyncio.timeout(BOUND):
        reader, writer = await raw_request(port, target)
        if "streaming=0" in target:
            await tracker.until(lambda: len(tracker.opened) > 0)
        else:
            await read_until(reader, b"data: ")
        rids = set(tracker.opened)
        assert env.registry.in_flight == len(rids)
        writer.close()
        closed_at = asyncio.get_running_loop().time()
        await tracker.until(lambda: tracker.aborted.keys() >= rids)
        await tracker.until(lambda: set(tracker.handled) == rids)
        await writer.wait_closed()
    assert env.registry.in_flight == 0
    assert tracker.aborted.keys() == rids
    assert max(tracker.aborted.values()) - closed_at <= LATENCY
    # Counted as the client leaving in both modes, also when aiohttp cancels the handler.
    assert dict(env.registry.stats().aborted) == {"client_disconnected": len(rids)}


async def test_many_disconnects_on_the_default_server_are_each_noticed_within_the_bound(
    env: Env,
) -> None:
    tracker = env.tracker
    runner, port = await start_default_server(build_app(env))
    try:
        async with asyncio.timeout(BOUND):
            clients = [await raw_request(port, "/?n=1&end=hold") for _ in range(10)]
            for reader, _ in clients:
                await read_until(reader, b"data: ")
            closed_at: dict[str, float] = {}
            for rid, (_, writer) in zip(tracker.opened, clients, strict=True):
                writer.close()
                closed_at[rid] = asyncio.get_running_loop().time()
            await tracker.until(lambda: tracker.aborted.keys() == closed_at.keys())
            await tracker.until(lambda: len(tracker.handled) == len(closed_at))
    finally:
        await runner.cleanup()
    latencies = [tracker.aborted[rid] - closed_at[rid] for rid in closed_at]
    assert max(latencies) <= LATENCY, f"disconnect-to-abort latencies: {sorted(latencies)}"
    assert env.registry.in_flight == 0
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 10}


async def test_failed_write_ends_the_stream_quietly_as_a_disconnect(env: Env) -> None:
    tracker = env.tracker
    # a watcher too slow to matter: the ping written after the close is what fails
    runner, port = await start_default_server(build_app(env, poll_interval=3600.0))
    try:
        async with asyncio.timeout(BOUND):
            reader, writer = await raw_request(port, "/?n=0&end=hold&ping=0.01")
            await read_until(reader, b": ping")
            writer.close()
            await tracker.until(lambda: len(tracker.handled) == 1)
    finally:
        await runner.cleanup()
    assert tracker.aborted.keys() == set(tracker.opened)
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}
    assert env.registry.in_flight == 0


async def test_cancelled_handler_counts_its_unawaited_streams_as_client_disconnects(
    env: Env, aiohttp_server: AiohttpServer
) -> None:
    tracker = env.tracker
    never = asyncio.Event()

    async def submit_slowly(request: web.Request) -> web.StreamResponse:
        stream = env.registry.open()
        tracker.note(tracker.opened, [stream.rid])
        await never.wait()  # an engine that takes the request slowly
        return await tether_aiohttp.respond(request, stream, streaming=True)

    app = web.Application()
    tether_aiohttp.setup(app, env.registry)
    app.router.add_get("/", submit_slowly)
    server = await aiohttp_server(app)  # handler_cancellation=True
    async with asyncio.timeout(BOUND):
        _, writer = await raw_request(server.port, "/")
        await tracker.until(lambda: len(tracker.opened) == 1)
        writer.close()
        await tracker.until(lambda: len(tracker.aborted) == 1)
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}
    assert env.registry.in_flight == 0
