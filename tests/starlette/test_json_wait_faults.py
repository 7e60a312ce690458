"""Many JSON waits on one uvicorn, some clients leaving, some answered: each leaver
aborted exactly once and soon, each other answered with its own result, nothing
left alive once the requests are over (no request's link, no reader, no task), and
nothing in the loop's exception handler, even when ``on_abort`` raises. The same
for streams and endless chunked bodies on every server, whether the middleware reads
the server's own ``receive`` (no task) or a wrapper's (a task each); and a wait the
server's graceful timeout cuts while its body is still arriving.

Real uvicorn (both parsers) and hypercorn on 127.0.0.1, on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import sys
import warnings
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.raw_http import connection, leave, read_response, request

from .conftest import Engine, make_app, serve
from .test_json_wait_on_servers import hypercorn_serving

pytestmark = pytest.mark.both_loops

CLIENTS: Final = 60
ABORT_BOUND: Final = 1.0


def _alive(qualname: str) -> int:
    """How many objects of the middleware's class ``qualname`` are alive."""
    gc.collect()
    return sum(
        1
        for thing in gc.get_objects()
        if type(thing).__qualname__ == qualname and type(thing).__module__.startswith("tether")
    )


def _readers_alive() -> int:
    gc.collect()
    return sum(
        1
        for thing in gc.get_objects()
        if asyncio.iscoroutine(thing) and getattr(thing, "__qualname__", "") == "_ServerLink._read"
    )


@pytest.mark.parametrize("raising", [False, True], ids=["on_abort", "on_abort-raises"])
async def test_many_json_waits_some_left_some_answered_each_once_and_nothing_left(
    raising: bool,
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    aborts: collections.Counter[str] = collections.Counter()
    engine: Engine

    def on_abort(rid: str) -> None:
        aborts[rid] += 1
        engine.abort(rid)
        if raising:
            raise RuntimeError("the engine's abort hook failed")

    engine = Engine(tether.Registry(on_abort))
    engine.script = None
    tasks_before = len(asyncio.all_tasks())
    try:
        async with serve(make_app(engine)) as (url, _):
            conns = [connection(url) for _ in range(CLIENTS)]
            pairs = [await conn.__aenter__() for conn in conns]
            for index, (_, writer) in enumerate(pairs):
                body = b"" if index % 3 else b"b" * (index * 100)
                writer.write(request("POST", "/json", body))
            await engine.until(lambda: len(engine.submitted) == CLIENTS)
            by_order = list(engine.submitted)  # (not the connections' order)
            # Every other connection leaves; which rids they carry the test does not know:
            # CLIENTS // 2 requests aborted, each exactly once, the others answered.
            left = [await leave(writer) for _, writer in pairs[::2]]
            await engine.until(lambda: len(engine.aborted_at) >= CLIENTS // 2)
            alive = [rid for rid in by_order if rid not in engine.aborted_at]
            for rid in alive:
                assert engine.registry.deliver(rid, {"rid": rid}, finished=True)
            answers = [await read_response(reader) for reader, _ in pairs[1::2]]
            for conn in conns:
                await conn.__aexit__(None, None, None)
            await engine.until(lambda: engine.registry.in_flight == 0)
    finally:
        await engine.stop()
        loop.set_exception_handler(None)

    assert len(engine.aborted_at) == CLIENTS // 2
    assert set(aborts.values()) == {1}
    assert max(engine.aborted_at.values()) - min(left) < ABORT_BOUND + len(left) * 0.05
    assert sorted(json.loads(body)["rid"] for status, body in answers if status == 200) == sorted(
        alive
    )
    assert engine.registry.stats().aborted == {"client_disconnected": CLIENTS // 2}
    assert unhandled == []
    assert len(asyncio.all_tasks()) <= tasks_before
    assert _alive("_ServerLink") == 0
    assert _readers_alive() == 0


@pytest.mark.parametrize("body", [b"", b"s" * 5000], ids=["no-body", "body"])
async def test_a_json_wait_cut_by_the_servers_graceful_timeout_is_told_503_and_aborted_once(
    body: bytes,
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    engine = Engine()
    engine.script = None
    try:
        async with (
            serve(make_app(engine), timeout_graceful_shutdown=0.2) as (url, server),
            connection(url) as (reader, writer),
        ):
            writer.write(request("POST", "/json", body))
            await engine.until(lambda: len(engine.submitted) == 1)
            server.should_exit = True  # uvicorn waits, then cancels the handler
            status, answer = await read_response(reader)
            await engine.until(lambda: engine.registry.in_flight == 0)
    finally:
        await engine.stop()
        loop.set_exception_handler(None)
    assert status == 503, answer
    assert engine.aborted == engine.submitted
    assert unhandled == []


def _wrapping_receive(app: ASGIApp) -> ASGIApp:
    """A pure ASGI middleware outside tether that wraps ``receive`` in a function of its own
    (the middleware's reader then needs a task)."""

    async def outer(scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped() -> Message:
            return await receive()

        await app(scope, wrapped, send)

    return outer


@contextlib.asynccontextmanager
async def _serving(server: str, app: ASGIApp) -> AsyncIterator[str]:
    if server == "hypercorn":
        async with hypercorn_serving(app) as url:
            yield url
    else:
        async with serve(app, http=server) as (url, _):
            yield url


def _send_one(writer: asyncio.StreamWriter, index: int) -> bool:
    """Client ``index``'s request: JSON or a stream; no body, a whole one, or chunks
    that never end. Whether its response can be read whole."""
    path = "/stream" if index % 4 == 1 else "/json"
    if index % 3 == 0:
        writer.write(request("POST", path, b"b" * (index * 1000)))
    elif index % 3 == 1:
        head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head.encode() + b"5\r\nhello\r\n")  # never ended
        return False
    else:
        writer.write(request("GET", path))
    return True


@pytest.mark.parametrize("server", ["h11", "httptools", "hypercorn"])
@pytest.mark.parametrize(
    "receive", [pytest.param(False, id="servers-own"), pytest.param(True, id="wrapped")]
)
async def test_many_requests_on_every_server_half_left_end_once_and_leave_nothing_behind(
    server: str, receive: bool
) -> None:
    """JSON waits and streams, with no body, a body or an endless chunked one, half the
    clients leaving: each leaver aborted once, nothing in flight, no reader (task or
    driven) alive, and nothing reported: no warning, no unraisable exception, nothing
    in the loop's exception handler. The server's own ``receive`` is read without a
    task; a wrapped one in a task per request."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    unraisable: list[Any] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    engine = Engine()
    engine.script = None
    app = _wrapping_receive(make_app(engine)) if receive else make_app(engine)
    tasks_before = len(asyncio.all_tasks())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with _serving(server, app) as url, contextlib.AsyncExitStack() as stack:
                pairs = [await stack.enter_async_context(connection(url)) for _ in range(CLIENTS)]
                whole = [_send_one(writer, index) for index, (_, writer) in enumerate(pairs)]
                await engine.until(lambda: len(engine.submitted) == CLIENTS)
                readers = sum(task.get_name() == "tether-rx" for task in asyncio.all_tasks())
                left = [await leave(writer) for _, writer in pairs[::2]]
                await engine.until(lambda: len(engine.aborted_at) >= CLIENTS // 2)
                for rid in engine.submitted:
                    if rid not in engine.aborted_at:
                        assert engine.registry.deliver(rid, {"rid": rid}, finished=True)
                for index in range(1, CLIENTS, 2):
                    if whole[index]:
                        assert (await read_response(pairs[index][0]))[0] == 200
            await engine.until(lambda: engine.registry.in_flight == 0)
            gc.collect()
    finally:
        sys.unraisablehook = hook
        loop.set_exception_handler(None)
        await engine.stop()
    assert readers == (CLIENTS if receive else 0)
    assert len(engine.aborted_at) == CLIENTS // 2
    assert max(engine.aborted_at.values()) - min(left) < ABORT_BOUND + len(left) * 0.05
    assert engine.registry.stats().aborted == {"client_disconnected": CLIENTS // 2}
    assert unhandled == []
    assert unraisable == []
    assert [str(warning.message) for warning in caught] == []
    assert len(asyncio.all_tasks()) <= tasks_before
    assert _alive("_ServerLink") == _alive("Driven") == 0
    assert _readers_alive() == 0


@pytest.mark.parametrize("path", ["/json", "/stream"])
@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_wait_cut_by_the_graceful_timeout_mid_upload_is_told_503_and_aborted_once(
    http: str, path: str
) -> None:
    """The handler waits without reading a body still arriving, over the read-ahead (the
    reader waits for the app to take some): the server's shutdown cancels the handler,
    whose client is told, its work aborted once, and nothing is reported."""
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    unraisable: list[Any] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    engine = Engine()
    engine.script = None
    try:
        async with (
            serve(make_app(engine), http=http, timeout_graceful_shutdown=0.2) as (url, server),
            connection(url) as (reader, writer),
        ):
            writer.write(request("POST", path, b"u" * 300_000, length=1_000_000))
            await engine.until(lambda: len(engine.submitted) == 1)
            server.should_exit = True  # uvicorn waits, then cancels the handler
            status, _ = await read_response(reader)
            await engine.until(lambda: engine.registry.in_flight == 0)
    finally:
        sys.unraisablehook = hook
        loop.set_exception_handler(None)
        await engine.stop()
    assert status == 503
    assert engine.aborted == engine.submitted
    assert unhandled == []
    assert unraisable == []
