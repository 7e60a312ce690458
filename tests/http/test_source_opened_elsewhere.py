"""Review: ``respond()`` owns its source but does not watch the client for it.

``respond(request, source)`` says the response owns ``source`` from then on, yet a
client disconnect reaches only the streams that the request's ``RequestScope``
adopted, which are the ones ``registry.open()`` made *inside* the handler's context.
A source opened elsewhere (a dispatcher task that opens streams for queued
requests, a job opened by an earlier request and answered by this one) is never
aborted when its client leaves: the producer works for nobody until it finishes.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
import tether_aiohttp
import tether_starlette
from tests.aiohttp.conftest import start_default_server
from tests.starlette.conftest import serve


class Job:
    """A request opened before its HTTP request arrived, outside any scope."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.answering = asyncio.Event()
        self.registry = tether.Registry(lambda rid: self.aborted.set())
        self.stream: tether.Stream | None = None

    def open(self) -> None:
        self.stream = self.registry.open()  # (the test itself runs in no request scope)

    def take(self) -> tether.Stream:
        assert self.stream is not None
        self.answering.set()
        return self.stream


async def _wait_then_leave(port: int, job: Job) -> None:
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /job HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    async with asyncio.timeout(10):
        await job.answering.wait()
    writer.transport.abort()
    try:
        async with asyncio.timeout(2):
            await job.aborted.wait()
    except TimeoutError:
        pytest.fail("the client left 2 s ago and its request is still in flight", pytrace=False)


async def test_starlette_respond_aborts_its_source_when_the_client_leaves() -> None:
    job = Job()

    async def answer(request: Request) -> Response:
        return await tether_starlette.respond(request, job.take(), streaming=False)

    app = Starlette(routes=[Route("/job", answer)])
    app.add_middleware(tether_starlette.TetherMiddleware, registry=job.registry)
    async with serve(app) as (url, _server):
        job.open()
        try:
            await _wait_then_leave(int(url.rsplit(":", 1)[1]), job)
        finally:
            await job.registry.close(drain_timeout=0)


async def test_aiohttp_respond_aborts_its_source_when_the_client_leaves() -> None:
    job = Job()

    async def answer(request: web.Request) -> web.StreamResponse:
        return await tether_aiohttp.respond(request, job.take(), streaming=False)

    app = web.Application()
    tether_aiohttp.setup(app, job.registry, drain_timeout=0)
    app.router.add_get("/job", answer)
    runner, port = await start_default_server(app)
    job.open()
    try:
        await _wait_then_leave(port, job)
    finally:
        await runner.cleanup()
