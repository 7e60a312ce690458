"""Resumable streams on real servers: a Starlette app on uvicorn and an aiohttp app
(``handler_cancellation`` off, its default), each on 127.0.0.1 with an ephemeral port,
in the test's own loop, and a client that reads SSE events with their ids.

The app's one route, ``/gen``, answers a reconnect with ``resume()`` and anything
else with a new resumable stream whose outputs the test delivers itself (so it
decides where a client drops); ``/stop`` aborts a stream by its token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import socket
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import pytest
import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
import tether.resume
import tether_aiohttp
import tether_starlette
from tests._support.loops import LAZY_AND_EAGER, PLAIN, LoopFactories
from tests._support.ready_server import ReadyServer
from tests._support.redis_server import redis_proc as redis_proc
from tests._support.redis_server import redis_url as redis_url
from tests._support.waiting import eventually as eventually
from tether.resume import TOKEN_HEADER

BOUND: Final = 10.0
ADAPTERS: Final = ("starlette", "aiohttp", "aiohttp-cancel")
"""Starlette on uvicorn; aiohttp as ``web.run_app`` serves; aiohttp cancelling handlers."""
PING: Final = 0.05
"""The apps' ping interval: a stream's status line goes out this soon, before any output."""


class Books:
    """The registry's ``on_abort`` calls and the rids the app opened, in order."""

    def __init__(self) -> None:
        self.aborts: collections.Counter[str] = collections.Counter()
        self.opened: list[str] = []

    def on_abort(self, rid: str) -> None:
        self.aborts[rid] += 1


@dataclasses.dataclass
class Site:
    """One running app: its base URL, registry, resumption policy and books."""

    url: str
    registry: tether.Registry
    resume: tether.resume.Resume
    books: Books

    @property
    def store(self) -> tether.resume.MemoryStore:
        store = self.resume.store
        assert isinstance(store, tether.resume.MemoryStore)
        return store

    async def opened(self, count: int = 1) -> str:
        """The rid of the ``count``-th stream the app opened, once it is open."""
        await eventually(lambda: len(self.books.opened) >= count)
        return self.books.opened[count - 1]

    async def parked(self, count: int = 1) -> None:
        """Wait until the server noticed ``count`` clients leave (their streams park)."""
        await eventually(lambda: self.store.parked == count)

    async def settled(self) -> None:
        """Wait until nothing is in flight and no stream is resumable any more."""
        await eventually(lambda: self.registry.in_flight == 0 and len(self.store) == 0)


def _starlette_app(
    site_registry: tether.Registry, resume: tether.resume.Resume, books: Books
) -> Any:
    async def gen(request: Request) -> Response:
        resumed = await tether_starlette.resume(request, resume, ping_interval=PING)
        if resumed is not None:
            return resumed
        stream = site_registry.open()
        books.opened.append(stream.rid)
        return await tether_starlette.respond(
            request, stream, streaming=True, resume=resume, ping_interval=PING
        )

    async def stop(request: Request) -> Response:
        token = request.headers.get(TOKEN_HEADER, "")
        return Response(status_code=204 if await resume.cancel(token) else 404)

    return Starlette(
        routes=[Route("/gen", gen), Route("/stop", stop, methods=["POST"])],
        middleware=[Middleware(tether_starlette.TetherMiddleware, registry=site_registry)],
    )


def _aiohttp_app(site_registry: tether.Registry, resume: tether.resume.Resume, books: Books) -> Any:
    async def gen(request: web.Request) -> web.StreamResponse:
        resumed = await tether_aiohttp.resume(request, resume, ping_interval=PING)
        if resumed is not None:
            return resumed
        stream = site_registry.open()
        books.opened.append(stream.rid)
        return await tether_aiohttp.respond(
            request, stream, streaming=True, resume=resume, ping_interval=PING
        )

    async def stop(request: web.Request) -> web.StreamResponse:
        token = request.headers.get(TOKEN_HEADER, "")
        return web.Response(status=204 if await resume.cancel(token) else 404)

    app = web.Application()
    tether_aiohttp.setup(app, site_registry)
    app.router.add_get("/gen", gen)
    app.router.add_post("/stop", stop)
    return app


@contextlib.asynccontextmanager
async def serving(
    adapter: str,
    *,
    grace: float = 30.0,
    max_events: int = 1000,
    store: tether.resume.MemoryStore | None = None,
) -> AsyncIterator[Site]:
    """Serve the test app with ``adapter`` on 127.0.0.1; on exit, close the registry
    and the resumption store, and stop the server."""
    books = Books()
    registry = tether.Registry(books.on_abort)
    resume = tether.resume.Resume(grace=grace, max_events=max_events, store=store)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with sock:
        if adapter == "starlette":
            config = uvicorn.Config(
                _starlette_app(registry, resume, books), log_config=None, lifespan="off"
            )
            server = ReadyServer(config)
            task = asyncio.create_task(server.serve(sockets=[sock]))
            try:
                async with asyncio.timeout(BOUND):
                    await server.ready.wait()
                assert server.started
                yield Site(url, registry, resume, books)
            finally:
                await registry.close(drain_timeout=0)
                await resume.aclose()
                server.should_exit = True
                async with asyncio.timeout(BOUND):
                    await task
        else:
            runner = web.AppRunner(
                _aiohttp_app(registry, resume, books),
                access_log=None,
                handler_cancellation=adapter == "aiohttp-cancel",
            )
            await runner.setup()
            try:
                await web.SockSite(runner, sock).start()
                yield Site(url, registry, resume, books)
            finally:
                await registry.close(drain_timeout=0)
                await resume.aclose()
                async with asyncio.timeout(BOUND):
                    await runner.cleanup()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """The core tests run on a plain loop and an eager-task loop (a follower must not
    depend on when a task first runs); the tests with servers on the plain one."""
    if item.path.name in ("test_resume_core.py", "test_redis_store.py"):
        return LAZY_AND_EAGER
    return PLAIN


@pytest.fixture(params=ADAPTERS)
def adapter(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclasses.dataclass
class Event:
    """One SSE event as a client sees it."""

    id: str | None
    data: Any
    event: str | None = None


class Reader:
    """Reads one SSE response event by event; ``close()`` drops the connection."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.token = response.headers.get(TOKEN_HEADER)
        self.last_id: str | None = None

    async def next(self) -> Event | None:
        """The next event (pings skipped); ``None`` when the body ended."""
        fields: dict[str, str] = {}
        async with asyncio.timeout(BOUND):
            while True:
                line = await self.response.content.readline()
                if not line:
                    return None
                text = line.decode().rstrip("\n")
                if text:
                    if not text.startswith(":"):
                        name, _, value = text.partition(": ")
                        fields[name] = value
                    continue
                if "data" not in fields:
                    fields.clear()
                    continue
                raw = fields["data"]
                data = raw if raw == "[DONE]" else json.loads(raw)
                event = Event(fields.get("id"), data, fields.get("event"))
                if event.id is not None:
                    self.last_id = event.id
                return event

    async def take(self, count: int) -> list[Any]:
        """The data of the next ``count`` events."""
        found = []
        for _ in range(count):
            event = await self.next()
            assert event is not None, f"the stream ended after {found}"
            found.append(event.data)
        return found

    async def rest(self) -> list[Any]:
        """The data of every event up to the end of the body."""
        found = []
        while (event := await self.next()) is not None:
            found.append(event.data)
        return found

    def close(self) -> None:
        self.response.close()


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as session:
        yield session


async def connect(
    session: aiohttp.ClientSession,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Reader:
    """GET ``url`` and return a reader of its stream (status 200 checked)."""
    response = await session.get(url, headers=headers, params=params)
    assert response.status == 200, (response.status, await response.text())
    return Reader(response)
