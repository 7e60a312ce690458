"""Spans under real servers: with an HTTP span current around the app (as an
instrumented server makes one), the request's ``tether.request`` span is its child,
through each adapter's middleware and handler, and carries the client's
``X-Request-Id``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import tether
import tether_aiohttp
import tether_otel
from tests._support.ready_server import ReadyServer
from tether_starlette import TetherMiddleware
from tether_starlette import respond as respond_starlette

BOUND = 10.0


def answer(registry: tether.Registry) -> tether.Stream:
    """What a handler does here: open a request, and produce it at once."""
    stream = registry.open()
    registry.deliver(stream.rid, {"text": "ok"}, finished=True)
    return stream


class HttpSpan:
    """An ASGI middleware that makes a current server span around each request."""

    def __init__(self, app: ASGIApp, *, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.tracer.start_as_current_span("HTTP " + scope["path"]):
            await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def starlette_server(registry: tether.Registry, tracer: Tracer) -> AsyncIterator[str]:
    async def generate(request: Request) -> Response:
        return await respond_starlette(request, answer(registry), streaming=False)

    app = Starlette(
        routes=[Route("/generate", generate, methods=["POST"])],
        middleware=[
            Middleware(HttpSpan, tracer=tracer),
            Middleware(TetherMiddleware, registry=registry),
        ],
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = ReadyServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(BOUND):
            await server.ready.wait()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(BOUND):
            await task
        sock.close()


@contextlib.asynccontextmanager
async def aiohttp_server(registry: tether.Registry, tracer: Tracer) -> AsyncIterator[str]:
    @web.middleware
    async def http_span(request: web.Request, handler: Any) -> web.StreamResponse:
        with tracer.start_as_current_span("HTTP " + request.path):
            response: web.StreamResponse = await handler(request)
            return response

    async def generate(request: web.Request) -> web.StreamResponse:
        return await tether_aiohttp.respond(request, answer(registry), streaming=False)

    app = web.Application(middlewares=[http_span])  # outside tether's, as instrumentation is
    tether_aiohttp.setup(app, registry)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        async with asyncio.timeout(BOUND):
            await runner.cleanup()
        sock.close()


SERVERS: dict[str, Callable[[tether.Registry, Tracer], Any]] = {
    "starlette": starlette_server,
    "aiohttp": aiohttp_server,
}


@pytest.mark.parametrize("name", list(SERVERS))
async def test_the_request_span_is_a_child_of_the_http_span(name: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = tether.Registry()
    tether_otel.instrument(registry, tracer_provider=provider)
    async with (
        SERVERS[name](registry, provider.get_tracer("server")) as url,
        aiohttp.ClientSession() as http,
        asyncio.timeout(BOUND),
        http.post(f"{url}/generate", headers={"X-Request-Id": "trace-me"}) as response,
    ):
        assert response.status == 200
        assert await response.json() == {"text": "ok"}
    spans: dict[str, ReadableSpan] = {span.name: span for span in exporter.get_finished_spans()}
    request, incoming = spans["tether.request"], spans["HTTP /generate"]
    assert request.parent is not None
    assert request.parent.span_id == incoming.context.span_id
    attributes = dict(request.attributes or {})
    assert attributes["tether.request_id"] == "trace-me"
    assert attributes["tether.outcome"] == "finished"
