"""On a real uvicorn, with and without producer writes: a send wrapper that delivers
to the stream it is sending (re-entering ``deliver()`` from inside the producer's
step, when it writes) loses nothing: the output it delivers goes out after the one
being sent, once, before the end."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.direct_writes import sse_values
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, serve


class _DeliverWhileSending:
    def __init__(self, app: ASGIApp, registry: tether.Registry, rids: list[str]) -> None:
        self.app, self.registry, self.rids = app, registry, rids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def delivering_send(message: Message) -> None:
            body = message.get("body", b"")
            for n in range(3):
                if f'"trigger{n}"'.encode() in body:
                    self.registry.deliver(self.rids[0], f"reentered{n}")
            await send(message)

        await self.app(scope, receive, delivering_send)


@pytest.mark.both_loops
@pytest.mark.parametrize("producer_writes", [True, False])
async def test_an_output_delivered_from_the_send_chain_goes_out_once_after_the_one_sent(
    producer_writes: bool,
) -> None:
    registry = tether.Registry()
    rids: list[str] = []
    opened = asyncio.Event()

    async def handler(request: Request) -> Response:
        stream = registry.open()
        rids.append(stream.rid)
        registry.deliver(stream.rid, "first")
        opened.set()
        return await respond(request, stream, streaming=True, ping_interval=3600)

    app = Starlette(
        routes=[Route("/s", handler)],
        middleware=[
            Middleware(TetherMiddleware, registry=registry, producer_writes=producer_writes),
            Middleware(_DeliverWhileSending, registry=registry, rids=rids),
        ],
    )
    body = b""
    async with (
        serve(app) as (url, _server),
        httpx.AsyncClient(timeout=BOUND) as http,
        http.stream("GET", f"{url}/s") as response,
    ):
        chunks = response.aiter_raw()
        async with asyncio.timeout(BOUND):
            await opened.wait()
            while b"first" not in body:
                body += await anext(chunks)
            for n in range(3):
                registry.deliver(rids[0], f"trigger{n}")  # (parked: through the sink)
                while f'"reentered{n}"'.encode() not in body:
                    body += await anext(chunks)
            registry.deliver(rids[0], "last", finished=True)
            async for data in chunks:
                body += data
    expected: list[Any] = ["first"]
    for n in range(3):
        expected += [f"trigger{n}", f"reentered{n}"]
    assert sse_values(body) == [*expected, "last", "[DONE]"], body
