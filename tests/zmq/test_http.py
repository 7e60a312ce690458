"""A client that leaves, through a real server: the request is cancelled in the engine
(in another loop's socket, across the link), for streaming and JSON endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.starlette.conftest import serve
from tether_starlette import TetherMiddleware, respond
from tether_zmq import EngineClient

from .conftest import eventually
from .linked import echo_engine, front

pytestmark = pytest.mark.timeout(60)


def make_app(client: EngineClient) -> Starlette:
    async def generate(request: Request) -> Response:
        streaming = request.query_params.get("stream") == "1"
        return await respond(request, client.open({"n": 0}), streaming=streaming)

    return Starlette(
        routes=[Route("/generate", generate, methods=["POST"])],
        middleware=[Middleware(TetherMiddleware, registry=client.registry)],
    )


async def test_a_client_leaving_a_stream_cancels_its_request_in_the_engine(address: str) -> None:
    async with (
        echo_engine(address) as engine,
        front(engine.server.address) as client,
        serve(make_app(client)) as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):

        async def first_output() -> None:  # (the status line waits for it)
            await eventually(lambda: len(engine.submitted) == 1)
            engine.server.send([(engine.submitted[0], {"i": 1}, False)])

        sender = asyncio.create_task(first_output())
        async with http.stream("POST", "/generate?stream=1") as response:
            await sender
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            left = time.monotonic()
        await eventually(lambda: len(engine.cancelled) == 1)
        assert time.monotonic() - left < 2.0
        assert engine.cancelled[0].key == engine.submitted[0]
        assert engine.cancelled[0].reason == "aborted"
        await eventually(lambda: client.registry.in_flight == 0)
        assert engine.server.in_flight == 0


async def test_a_client_leaving_a_json_request_cancels_it_in_the_engine(address: str) -> None:
    async with (
        echo_engine(address) as engine,
        front(engine.server.address) as client,
        serve(make_app(client)) as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        waiting = asyncio.create_task(http.post("/generate"))
        await eventually(lambda: len(engine.submitted) == 1)
        waiting.cancel()  # closes the connection while the server waits for the result
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        left = time.monotonic()
        await eventually(lambda: len(engine.cancelled) == 1)
        assert time.monotonic() - left < 2.0
        assert engine.cancelled[0].reason == "aborted"
        assert engine.server.in_flight == 0
