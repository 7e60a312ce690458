"""A pure ASGI middleware outside TetherMiddleware that wraps ``receive`` the way real
ones do (a context variable set around the wait, OpenTelemetry's span around each
receive, a timeout on a slow client's body) changes nothing for tether: the answer is
the result, nothing is aborted, nothing is logged, and a client that leaves is still
noticed. The middleware's reader calls that ``receive``, so whatever the wrapper needs
of the code that awaits it (one context across the wait, a current task) it must get.

Real uvicorn on 127.0.0.1, on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import pytest
from opentelemetry import trace
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests._support.raw_http import connection, read_response, request

from .conftest import Changes, Engine, leave_until_aborted, make_app, serve

pytestmark = pytest.mark.both_loops

ABORT_BOUND: Final = 1.0
"""Seconds within which a client leaving must reach the producer's ``on_abort``."""

_READING: contextvars.ContextVar[str | None] = contextvars.ContextVar("reading", default=None)


async def _with_a_contextvar(receive: Receive) -> Message:
    token = _READING.set("body")  # e.g. a request-logging middleware marks the read
    try:
        return await receive()
    finally:
        _READING.reset(token)


async def _with_a_span(receive: Receive) -> Message:
    # What opentelemetry-instrumentation-asgi's otel_receive does around each receive.
    with trace.get_tracer("outer").start_as_current_span("http receive"):
        return await receive()


async def _with_a_timeout(receive: Receive) -> Message:
    async with asyncio.timeout(60):  # a slow client's body is bounded
        return await receive()


Wrap = Callable[[Receive], Awaitable[Message]]

WRAPPERS: Final = [
    pytest.param(_with_a_contextvar, id="contextvar-reset"),
    pytest.param(_with_a_span, id="opentelemetry-span"),
    pytest.param(_with_a_timeout, id="asyncio-timeout"),
]


class Outer:
    """The user's middleware outside TetherMiddleware; it records what escapes the app
    and counts the calls of its ``receive`` (a change the engine's waits see)."""

    def __init__(self, app: ASGIApp, wrap: Wrap, changes: Changes) -> None:
        self.signal = changes.signal
        self.app = app
        self.wrap = wrap
        self.escaped: list[BaseException] = []
        self.entered = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped() -> Message:
            self.entered += 1
            self.signal()
            return await self.wrap(receive)

        try:
            await self.app(scope, wrapped, send)
        except BaseException as exc:
            self.escaped.append(exc)
            raise


def _waiting(engine: Engine, app: Outer, turn: int) -> bool:
    """The ``turn``-th request is submitted and its reader waits (or it is gone)."""
    if len(engine.submitted) < turn:
        return False
    return app.entered >= 2 * turn or engine.submitted[-1] not in engine.registry


@pytest.mark.parametrize("wrap", WRAPPERS)
async def test_an_outer_receive_wrapper_leaves_a_json_answer_whole_and_unaborted(
    engine: Engine, wrap: Wrap, caplog: pytest.LogCaptureFixture
) -> None:
    engine.script = None
    app = Outer(make_app(engine), wrap, engine)
    caplog.set_level(logging.ERROR)
    async with serve(app) as (url, _), connection(url) as (reader, writer):
        for turn in (1, 2):  # a second request on the connection as well
            writer.write(request("GET", "/json"))
            # The reader took the (empty) body and waits in its second receive.
            await engine.until(functools.partial(_waiting, engine, app, turn))
            rid = engine.submitted[-1]
            ok = engine.registry.deliver(rid, {"rid": rid}, finished=True)
            answer = await read_response(reader)
            assert ok, engine.registry.stats().aborted
            assert answer[0] == 200, answer
    assert engine.aborted_at == {}
    assert app.escaped == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("wrap", WRAPPERS)
async def test_an_outer_receive_wrapper_leaves_a_body_arriving_after_open_unaborted(
    engine: Engine, wrap: Wrap, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler opens its stream while its body is still arriving: the middleware's
    reader waits in the wrapped receive, and the rest of the body wakes it."""
    engine.script = None
    app = Outer(make_app(engine), wrap, engine)
    caplog.set_level(logging.ERROR)
    async with serve(app) as (url, _), connection(url) as (reader, writer):
        writer.write(request("POST", "/json", b"x" * 10, length=20))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        # The reader took the first part and waits for more (or failed at once).
        await engine.until(lambda: app.entered >= 2 or rid not in engine.registry)
        writer.write(b"y" * 10)
        await writer.drain()
        await engine.until(lambda: app.entered >= 3 or rid not in engine.registry)
        ok = engine.registry.deliver(rid, {"n": 1}, finished=True)
        answer = await read_response(reader)
    assert ok, engine.registry.stats().aborted
    assert answer == (200, b'{"n":1}')
    assert engine.aborted_at == {}
    assert app.escaped == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("wrap", WRAPPERS)
async def test_an_outer_receive_wrapper_still_lets_a_leaving_client_abort_its_json_wait(
    engine: Engine, wrap: Wrap, caplog: pytest.LogCaptureFixture
) -> None:
    engine.script = None
    app = Outer(make_app(engine), wrap, engine)
    caplog.set_level(logging.ERROR)
    async with serve(app) as (url, _), connection(url) as (_, writer):
        writer.write(request("GET", "/json"))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        left_at = await leave_until_aborted(engine, writer, rid)
    assert engine.aborted_at[rid] - left_at < ABORT_BOUND
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert [type(exc) for exc in app.escaped] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def _with_an_anyio_deadline(receive: Receive) -> Message:
    with anyio.fail_after(60):  # the same bound, written with anyio (Starlette's own)
        return await receive()


class _Passing(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


async def test_an_outer_anyio_deadline_on_receive_leaves_a_json_answer_unaborted(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    await test_an_outer_receive_wrapper_leaves_a_json_answer_whole_and_unaborted(
        engine, _with_an_anyio_deadline, caplog
    )


async def test_a_base_http_middleware_outside_still_gets_the_json_answer(
    engine: Engine,
) -> None:
    """Documented as hiding disconnects (docs/starlette.md); the answer itself must not
    suffer: the result, nothing aborted."""
    engine.script = None
    app = make_app(engine)
    app.add_middleware(_Passing)
    async with serve(app) as (url, _), connection(url) as (reader, writer):
        writer.write(request("POST", "/json", b"z" * 10))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        ok = engine.registry.deliver(rid, {"n": 1}, finished=True)
        answer = await read_response(reader)
    assert ok, engine.registry.stats().aborted
    assert answer == (200, b'{"n":1}')
    assert engine.aborted_at == {}


async def test_a_fastapi_http_middleware_added_after_tether_still_gets_the_json_answer(
    engine: Engine,
) -> None:
    """FastAPI's ``@app.middleware("http")`` (a BaseHTTPMiddleware), the usual way to
    add a header or time a request, decorated after ``add_middleware(TetherMiddleware)``."""
    from fastapi import FastAPI

    from tether_starlette import TetherMiddleware, respond

    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=engine.registry)

    @app.middleware("http")
    async def timed(request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        response.headers["x-timed"] = "1"
        return response

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        source = engine.registry.open()
        engine.submit(source)
        return await respond(request, source, streaming=False)

    engine.script = None
    async with serve(app) as (url, _), connection(url) as (reader, writer):
        writer.write(request("POST", "/generate", b'{"prompt": "hi"}', json=True))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        ok = engine.registry.deliver(rid, {"text": "hello"}, finished=True)
        answer = await read_response(reader)
    assert ok, engine.registry.stats().aborted
    assert answer == (200, b'{"text":"hello"}')
    assert engine.aborted_at == {}
