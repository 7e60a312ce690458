"""Real servers on 127.0.0.1 (ephemeral ports) in the test's own loop: uvicorn for an
ASGI app, aiohttp as ``web.run_app`` serves, and one route served the same way by
either adapter, for a promise both keep.

A :data:`Endpoint` is written once for both adapters: they expose the same verbs
(``get_registry``, ``respond``), so it receives the adapter's module and the
framework's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any, Final

import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp

import tether
import tether_aiohttp
import tether_starlette
from tests._support.ready_server import ReadyServer

BOUND: Final = 10.0
"""A generous bound on a server's start and stop."""

ADAPTERS: Final = ("starlette", "aiohttp")
"""Starlette on uvicorn; aiohttp with ``handler_cancellation=False`` (its default)."""

Endpoint = Callable[[ModuleType, Any], Awaitable[Any]]
"""``(adapter module, framework request) -> framework response``."""


@contextlib.asynccontextmanager
async def serve(
    app: ASGIApp,
    *,
    lifespan: str = "off",
    server_class: type[ReadyServer] = ReadyServer,
    **options: Any,
) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """Run ``app`` on uvicorn on 127.0.0.1 (ephemeral port) in this loop; yields the
    base URL and the server, and stops it on exit. ``options`` go to
    :class:`uvicorn.Config` (``http="httptools"``, say)."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan=lifespan,
        log_config=None,
        access_log=False,
        **options,
    )
    server = server_class(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(BOUND):
            await server.ready.wait()
        assert server.started, "uvicorn failed to start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        async with asyncio.timeout(BOUND):
            await task


async def start_default_server(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` the way ``web.run_app`` does (``handler_cancellation=False``)."""
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


@contextlib.asynccontextmanager
async def serving(
    adapter: str,
    registry: tether.Registry,
    method: str,
    path: str,
    endpoint: Endpoint,
    *,
    producer_writes: bool = False,
) -> AsyncIterator[str]:
    """Serve ``endpoint`` at ``method path`` with ``adapter`` (one of :data:`ADAPTERS`)
    and ``registry`` installed; yields the base URL, stops the server on exit.
    ``producer_writes``: the Starlette middleware's option of that name."""
    if adapter == "starlette":
        route = Route(path, functools.partial(endpoint, tether_starlette), methods=[method])
        app = Starlette(routes=[route])
        app.add_middleware(
            tether_starlette.TetherMiddleware, registry=registry, producer_writes=producer_writes
        )
        async with serve(app) as (url, _server):
            yield url
        return
    assert adapter == "aiohttp", adapter
    aiohttp_app = web.Application()
    tether_aiohttp.setup(aiohttp_app, registry)
    aiohttp_app.router.add_route(method, path, functools.partial(endpoint, tether_aiohttp))
    runner, port = await start_default_server(aiohttp_app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
