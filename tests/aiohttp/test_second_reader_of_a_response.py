"""A handler that answers with a JSON ``respond()`` while a side task of its own
awaits the same stream's ``result()`` (to log it, say) gets an answer, and the
server goes on serving: the second reader is refused, the first undisturbed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

import tether
import tether_aiohttp

from .conftest import StartServer

BOUND = 10.0


@pytest.mark.parametrize("side_first", [False, True], ids=["respond-first", "side-task-first"])
async def test_a_json_response_with_a_second_reader_answers_and_the_server_goes_on(
    start_server: StartServer, side_first: bool
) -> None:
    registry = tether.Registry()
    side: list[asyncio.Task[object]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = registry.open()
        task = asyncio.get_running_loop().create_task(stream.result())
        side.append(task)
        if side_first:
            await asyncio.sleep(0)  # (a yield, not a wait: the side task reads first)
        asyncio.get_running_loop().call_soon(
            lambda: registry.deliver(stream.rid, {"n": 1}, finished=True)
        )
        return await tether_aiohttp.respond(request, stream, streaming=False)

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.router.add_get("/json", handler)
    app.router.add_get("/health", health)
    port = await start_server(app)
    async with aiohttp.ClientSession() as session, asyncio.timeout(BOUND):
        async with session.get(f"http://127.0.0.1:{port}/json") as response:
            status, body = response.status, await response.json()
        async with session.get(f"http://127.0.0.1:{port}/health") as health_response:
            assert await health_response.text() == "ok"  # the loop still turns
    async with asyncio.timeout(BOUND):
        (side_outcome,) = await asyncio.gather(*side, return_exceptions=True)
    if side_first:  # the side task read first: respond() was refused, the scope's end
        # closed the stream under the side task, which ends (never spins) all the same
        assert isinstance(side_outcome, tether.Aborted) or side_outcome == {"n": 1}
        assert status == 500
        assert "error" in body
    else:
        assert (status, body) == (200, {"n": 1})
        assert isinstance(side_outcome, tether.ConcurrentRead)
    assert registry.in_flight == 0
