"""A handler that answers with a JSON ``respond()`` while a side task of its own
awaits the same stream's ``result()`` (to log it, say) gets an answer, and the
server goes on serving: the second reader is refused, the first undisturbed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, serve


@pytest.mark.parametrize("side_first", [False, True], ids=["respond-first", "side-task-first"])
async def test_a_json_response_with_a_second_reader_answers_and_the_server_goes_on(
    side_first: bool,
) -> None:
    registry = tether.Registry()
    side: list[asyncio.Task[object]] = []

    async def handler(request: Request) -> Response:
        stream = registry.open()
        task = asyncio.get_running_loop().create_task(stream.result())
        side.append(task)
        if side_first:
            await asyncio.sleep(0)  # (a yield, not a wait: the side task reads first)
        asyncio.get_running_loop().call_soon(
            lambda: registry.deliver(stream.rid, {"n": 1}, finished=True)
        )
        return await respond(request, stream, streaming=False)

    async def health(request: Request) -> Response:
        return Response("ok")

    app = Starlette(
        routes=[Route("/json", handler), Route("/health", health)],
        middleware=[Middleware(TetherMiddleware, registry=registry)],
    )
    async with serve(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=BOUND) as client:
        async with asyncio.timeout(BOUND):
            response = await client.get("/json")
            assert (await client.get("/health")).text == "ok"  # the loop still turns
    async with asyncio.timeout(BOUND):
        (side_outcome,) = await asyncio.gather(*side, return_exceptions=True)
    if side_first:  # the side task read first: respond() was refused, the scope's end
        # closed the stream under the side task, which ends (never spins) all the same
        assert isinstance(side_outcome, tether.Aborted) or side_outcome == {"n": 1}
        assert response.status_code == 500
        assert "error" in response.json()
    else:
        assert response.status_code == 200
        assert response.json() == {"n": 1}
        assert isinstance(side_outcome, tether.ConcurrentRead)
    assert registry.in_flight == 0
