"""A FastAPI endpoint's ``BackgroundTasks`` (any Starlette ``response.background``)
run once its answer was sent, streamed or not, as a Starlette response runs them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI, Request
from starlette.responses import Response

import tether
from tests._support.servers import serve
from tether_starlette import TetherMiddleware, respond

BOUND = 10.0


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "stream"])
async def test_an_endpoints_background_tasks_run_after_its_answer(streaming: bool) -> None:
    registry = tether.Registry()
    ran = asyncio.Event()
    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=registry)

    @app.get("/generate")
    async def generate(request: Request, background_tasks: BackgroundTasks) -> Response:
        background_tasks.add_task(ran.set)
        stream = registry.open()
        registry.deliver(stream.rid, {"n": 1})  # the head goes out with it
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: registry.deliver(stream.rid, {"n": 2}, finished=True))
        return await respond(request, stream, streaming=streaming)

    async with serve(app) as (url, _server), httpx.AsyncClient(timeout=BOUND) as client:
        response = await client.get(f"{url}/generate")
        assert response.status_code == 200
        try:
            async with asyncio.timeout(BOUND):
                await ran.wait()
        except TimeoutError:
            pytest.fail(f"the background task never ran after the answer {response.text!r}")
    assert registry.in_flight == 0
