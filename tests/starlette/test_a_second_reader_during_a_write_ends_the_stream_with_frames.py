"""On a real uvicorn: a task of the handler that reads the stream it answers with,
parking while the response's write is in flight (a slow network write, held here by
an ASGI middleware), ends the response with an error event and the terminal frame;
the response never breaks off mid-body with ConcurrentRead out of the write loop."""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tether_starlette import TetherMiddleware, respond

from .conftest import BOUND, serve


class _HoldOneWrite:
    """Holds the body write that carries ``marker`` until ``release`` is set."""

    def __init__(
        self, app: ASGIApp, marker: bytes, holding: asyncio.Event, release: asyncio.Event
    ) -> None:
        self.app, self.marker, self.holding, self.release = app, marker, holding, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def held_send(message: Message) -> None:
            if message["type"] == "http.response.body" and self.marker in message.get("body", b""):
                self.holding.set()
                await self.release.wait()
            await send(message)

        await self.app(scope, receive, held_send)


async def test_a_reader_parked_during_a_write_ends_the_stream_with_an_error_event_and_the_end() -> (
    None
):
    registry = tether.Registry()
    holding, release = asyncio.Event(), asyncio.Event()
    streams: list[tether.Stream] = []

    async def handler(request: Request) -> Response:
        stream = registry.open()
        streams.append(stream)
        registry.deliver(stream.rid, 0)
        return await respond(request, stream, streaming=True, ping_interval=3600)

    app = Starlette(
        routes=[Route("/sse", handler)],
        middleware=[
            Middleware(_HoldOneWrite, marker=b'"held"', holding=holding, release=release),
            Middleware(TetherMiddleware, registry=registry),
        ],
    )
    body = b""
    async with (
        serve(app) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=BOUND) as client,
        asyncio.timeout(BOUND),
        client.stream("GET", "/sse") as response,
    ):
        chunks = response.aiter_raw()
        body += await anext(chunks)  # the first output
        (stream,) = streams
        registry.deliver(stream.rid, "held")
        await holding.wait()  # its write is in flight
        side = asyncio.get_running_loop().create_task(stream.__anext__())
        await asyncio.sleep(0)  # (a yield: the side task parks)
        release.set()
        try:
            async for chunk in chunks:
                body += chunk
        except httpx.RemoteProtocolError as exc:
            raise AssertionError(f"the response broke off after {body!r}: {exc!r}") from exc
        await asyncio.gather(side, return_exceptions=True)
    frames = [f.removeprefix(b"data: ") for f in body.split(b"\n\n") if f.startswith(b"data: ")]
    assert [json.loads(f) for f in frames[:2]] == [0, "held"]
    assert json.loads(frames[2])["error"]["type"] == "ConcurrentRead"
    assert frames[3:] == [b"[DONE]"]
    assert registry.in_flight == 0
