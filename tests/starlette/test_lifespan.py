"""Shutdown: the lifespan helper, and a uvicorn server subclass that drains (a server
stopped without a signal)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from httpx_sse import ServerSentEvent, aconnect_sse
from starlette.applications import Starlette

from tether_starlette import lifespan

from .conftest import BOUND, HANG, Engine, ReadyServer, make_app, serve


async def test_lifespan_closes_the_registry_inside_the_inner_lifespan(engine: Engine) -> None:
    seen: list[tuple[str, bool]] = []

    @contextlib.asynccontextmanager
    async def producer_lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        seen.append(("start", engine.registry.closed))
        yield {"producer": "up"}
        seen.append(("stop", engine.registry.closed))

    run = lifespan(engine.registry, drain_timeout=0, inner=producer_lifespan)
    async with run(Starlette()) as state:
        assert state == {"producer": "up"}

    assert seen == [("start", False), ("stop", True)]


async def test_lifespan_on_uvicorn_closes_the_registry_at_shutdown(engine: Engine) -> None:
    app = make_app(engine, lifespan=lifespan(engine.registry, drain_timeout=1))
    async with (
        serve(app, lifespan="on") as (url, _),
        httpx.AsyncClient(timeout=BOUND) as client,
    ):
        response = await client.get(f"{url}/json")
        assert not engine.registry.closed

    assert response.json() == {"n": 2}
    assert engine.registry.closed


def draining_server(
    engine: Engine, drain_timeout: float, draining: asyncio.Event | None = None
) -> type[ReadyServer]:
    """A server subclass that drains (for servers stopped without a signal), on the
    test server that says when it is up (and, with ``draining``, when the drain began)."""

    class DrainingServer(ReadyServer):
        async def shutdown(self, sockets: Any = None) -> None:
            drain = asyncio.create_task(engine.registry.close(drain_timeout=drain_timeout))
            if draining is not None:  # after the drain's first step (callbacks run in order)
                asyncio.get_running_loop().call_soon(draining.set)
            try:
                await super().shutdown(sockets)
            finally:
                await drain

    return DrainingServer


@contextlib.asynccontextmanager
async def reading_a_stream(
    engine: Engine, server_class: type[ReadyServer]
) -> AsyncIterator[tuple[uvicorn.Server, AsyncIterator[ServerSentEvent]]]:
    """Serve the test app with ``server_class`` and open one SSE stream on it."""
    async with (
        serve(make_app(engine), server_class=server_class) as (url, server),
        httpx.AsyncClient(timeout=BOUND) as client,
        aconnect_sse(client, "GET", f"{url}/stream") as source,
        contextlib.aclosing(source.aiter_sse()) as events,
    ):
        yield server, events


async def test_uvicorn_shutdown_drain_ends_open_streams_with_an_error_event(
    engine: Engine,
) -> None:
    engine.script = [{"n": 1}, HANG]
    server_class = draining_server(engine, drain_timeout=0.05)
    async with reading_a_stream(engine, server_class) as (server, events):
        first = await anext(events)
        server.should_exit = True
        rest = [event.data async for event in events]

    assert first.data == '{"n":1}'
    assert json.loads(rest[0])["error"]["code"] == 503
    assert rest[1:] == ["[DONE]"]
    assert engine.registry.stats().aborted == {"server": 1}
    assert engine.registry.in_flight == 0


async def test_uvicorn_shutdown_drain_lets_a_request_finish_within_the_timeout(
    engine: Engine,
) -> None:
    gate = asyncio.Event()
    engine.script = [{"n": 1}, gate, {"n": 2}]
    draining = asyncio.Event()
    server_class = draining_server(engine, drain_timeout=BOUND, draining=draining)
    async with reading_a_stream(engine, server_class) as (server, events):
        first = await anext(events)
        server.should_exit = True
        async with asyncio.timeout(BOUND):
            await draining.wait()
        draining_with_one_in_flight = (engine.registry.closed, engine.registry.in_flight)
        gate.set()
        rest = [event.data async for event in events]

    assert draining_with_one_in_flight == (True, 1)
    assert [first.data, *rest] == ['{"n":1}', '{"n":2}', "[DONE]"]
    assert engine.aborted_at == {}
