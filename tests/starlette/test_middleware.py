"""TetherMiddleware on a fake ASGI server: the exact messages, on ASGI < 2.4 and >= 2.4."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
import tether.http
from tether_starlette import TetherMiddleware, get_registry

from .conftest import Engine, FakeServer, make_app

SPECS = [pytest.param("2.3", id="asgi-2.3"), pytest.param("2.4", id="asgi-2.4")]

READ_AHEAD = 64 * 1024
"""The bytes of unread body the middleware's reader may hold (docs/starlette.md)."""


@pytest.mark.parametrize("spec_version", SPECS)
async def test_stream_sends_start_then_each_output_from_deliver_then_the_terminal(
    engine: Engine, spec_version: str
) -> None:
    engine.script = None
    server = FakeServer(spec_version=spec_version)
    app = server.run(make_app(engine, producer_writes=True))
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(app)
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        engine.registry.deliver(rid, {"n": 1})
        await server.until(lambda: len(server.sent) == 2)
        # The handler waits: each output is sent inside deliver(), before it returns.
        engine.registry.deliver(rid, {"n": 2})
        assert len(server.sent) == 3
        # The last output is the write loop's: it goes with the terminal frame and the end.
        engine.registry.deliver(rid, {"n": 3}, finished=True)
        await server.until(lambda: len(server.sent) == 4)

    start = server.sent[0]
    assert (start["type"], start["status"]) == ("http.response.start", 200)
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"cache-control", b"no-cache") in start["headers"]
    assert (b"x-accel-buffering", b"no") in start["headers"]
    assert server.bodies == [
        (b'data: {"n":1}\n\n', True),
        (b'data: {"n":2}\n\n', True),
        (b'data: {"n":3}\n\ndata: [DONE]\n\n', False),
    ]
    assert engine.registry.in_flight == 0
    assert engine.aborted_at == {}


async def test_idle_stream_pings_and_the_first_ping_sends_the_headers(engine: Engine) -> None:
    engine.script = None
    server = FakeServer(query="ping=0.01")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine, producer_writes=True)))
        await server.until(lambda: len(server.sent) == 3)
        engine.registry.deliver(engine.submitted[0], {"n": 1}, finished=True)

    assert server.sent[0]["status"] == 200
    assert server.bodies[:2] == [(b": ping\n\n", True), (b": ping\n\n", True)]
    assert server.bodies[-1] == (b'data: {"n":1}\n\ndata: [DONE]\n\n', False)


@pytest.mark.parametrize("spec_version", SPECS)
@pytest.mark.parametrize("batch", [0, 3], ids=["stream", "batch"])
async def test_disconnect_mid_stream_aborts_every_rid_at_once(
    engine: Engine, spec_version: str, batch: int
) -> None:
    engine.script = None
    server = FakeServer(spec_version=spec_version, query=f"batch={batch}")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine)))
        await engine.until(lambda: len(engine.submitted) == max(batch, 1))
        engine.registry.deliver(engine.submitted[0], {"n": 1})
        await server.until(lambda: len(server.sent) == 2)
        server.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == len(engine.submitted))

    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"client_disconnected": max(batch, 1)}
    assert len(server.sent) == 2


async def test_disconnect_mid_stream_is_seen_even_when_the_body_was_never_read(
    engine: Engine,
) -> None:
    engine.script = None
    # A body of several messages the streaming endpoint never reads.
    server = FakeServer(method="POST", body=[b"a" * 10, b"b" * 10, b"c" * 10])
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine)))
        await engine.until(lambda: len(engine.submitted) == 1)
        engine.registry.deliver(engine.submitted[0], {"n": 1})
        await server.until(lambda: len(server.sent) == 2)
        server.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"client_disconnected": 1}


@pytest.mark.parametrize("spec_version", SPECS)
async def test_disconnect_during_a_json_wait_is_seen_even_when_the_body_was_never_read(
    engine: Engine, spec_version: str
) -> None:
    engine.script = None
    # The JSON endpoint waits for its result and never reads this body of several messages.
    server = FakeServer(
        spec_version=spec_version, method="POST", path="/json", body=[b"a" * 10] * 4
    )
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine)))
        await engine.until(lambda: len(engine.submitted) == 1)
        server.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0
    assert server.sent == []


async def test_send_raising_oserror_is_a_disconnect_on_asgi_2_4(engine: Engine) -> None:
    engine.script = None
    server = FakeServer(spec_version="2.4")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine)))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        engine.registry.deliver(rid, {"n": 1})
        await server.until(lambda: len(server.sent) == 2)
        server.disconnect(tell_receive=False)
        engine.registry.deliver(rid, {"n": 2})
        await engine.until(lambda: rid in engine.aborted_at)

    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("spec_version", SPECS)
@pytest.mark.parametrize("batch", [0, 3], ids=["stream", "batch"])
async def test_disconnect_during_a_json_wait_aborts_every_rid_at_once(
    engine: Engine, spec_version: str, batch: int
) -> None:
    engine.script = None
    server = FakeServer(spec_version=spec_version, path="/json", query=f"batch={batch}")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine)))
        await engine.until(lambda: len(engine.submitted) == max(batch, 1))
        server.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == len(engine.submitted))

    assert engine.registry.in_flight == 0
    assert server.sent == []


async def test_json_answer_is_one_start_and_one_complete_body(engine: Engine) -> None:
    server = FakeServer(path="/json", query="batch=2")
    await server.run(make_app(engine))

    assert server.sent[0]["status"] == 200
    assert (b"content-type", b"application/json") in server.sent[0]["headers"]
    assert server.bodies == [(b'[{"n":2},{"n":2}]', False)]
    assert engine.registry.in_flight == 0


async def test_disconnect_after_the_response_completed_is_not_a_client_disconnect() -> None:
    seen: list[tuple[Message, bool]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        request_scope = tether.http.current_scope()
        assert request_scope is not None
        seen.append((await receive(), request_scope.disconnected))

    server = FakeServer(uvicorn_like=True)
    await server.run(TetherMiddleware(app, registry=tether.Registry()))

    assert seen == [({"type": "http.disconnect"}, False)]


async def test_body_reaches_the_app_in_order_with_at_most_read_ahead_bytes_unread() -> None:
    chunk = READ_AHEAD // 4
    chunks = [bytes([index]) * chunk for index in range(10)] + [b""]
    received: list[Message] = []
    pulled_ahead: list[int] = []  # unread bytes the reader held each time it pulled more
    registry = tether.Registry()

    def taken() -> int:
        return sum(len(message["body"]) for message in received)

    def pulled() -> int:
        return sum(map(len, chunks[: server.pulled]))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # A stream opened before the body is read: the reader takes receive over.
        stream = registry.open()
        while not received or received[-1].get("more_body", False):
            # Give the reader every chance to read ahead before taking the next one.
            await server.until(
                lambda: server.pulled == len(chunks) or pulled() - taken() >= READ_AHEAD
            )
            received.append(await receive())
        await stream.aclose()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server = FakeServer(method="POST", body=chunks)
    original_receive = server.receive

    async def receive() -> Message:
        pulled_ahead.append(pulled() - taken())
        return await original_receive()

    server.receive = receive  # type: ignore[method-assign]
    await server.run(TetherMiddleware(app, registry=registry))

    assert [message["body"] for message in received] == chunks
    # It read ahead (that is how a disconnect is seen), but never past the bound.
    assert max(pulled_ahead) == READ_AHEAD - chunk
    assert all(ahead < READ_AHEAD for ahead in pulled_ahead)


async def test_a_request_that_opens_no_stream_reads_receive_directly_with_no_reader() -> None:
    chunks = [b"a" * 10, b"b" * 20, b""]
    received: list[Message] = []
    reader_tasks: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while not received or received[-1].get("more_body", False):
            received.append(await receive())
            # Nothing reads ahead of the app: it pulled exactly what it received.
            assert server.pulled == len(received)
        reader_tasks.extend(
            task.get_name() for task in asyncio.all_tasks() if task.get_name() == "tether-rx"
        )
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server = FakeServer(method="POST", body=chunks)
    await server.run(TetherMiddleware(app, registry=tether.Registry()))

    assert [message["body"] for message in received] == chunks
    assert reader_tasks == []


async def test_installed_twice_one_reader_one_scope_one_answer(engine: Engine) -> None:
    engine.script = None
    server = FakeServer()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine, middleware=2)))
        await engine.until(lambda: len(engine.submitted) == 1)
        server.disconnect()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert server.most_receiving == 1
    assert engine.registry.stats().aborted == {"client_disconnected": 1}


async def test_error_escaping_the_app_before_the_response_gets_its_status_once(
    engine: Engine,
) -> None:
    engine.registry = tether.Registry(max_in_flight=1)
    held = engine.registry.open()
    server = FakeServer(path="/json")
    await server.run(make_app(engine, middleware=2))
    await held.aclose()

    assert [message["type"] for message in server.sent] == [
        "http.response.start",
        "http.response.body",
    ]
    assert server.sent[0]["status"] == 503
    assert (b"retry-after", b"1") in server.sent[0]["headers"]
    assert b'"type":"Overloaded"' in server.bodies[0][0]


async def test_websocket_scopes_pass_straight_through() -> None:
    calls: list[tuple[Scope, Receive, Send]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        calls.append((scope, receive, send))

    async def receive() -> Message:
        raise AssertionError("not called")

    async def send(message: Message) -> None:
        raise AssertionError("not called")

    scope: Scope = {"type": "websocket", "asgi": {"version": "3.0"}}
    await TetherMiddleware(app, registry=tether.Registry())(scope, receive, send)

    assert calls == [(scope, receive, send)]
    assert "tether.registry" not in scope


def test_middleware_outside_asyncio_fails_at_once_with_a_clear_error() -> None:
    # What trio (or any other loop) looks like from inside: no running asyncio loop.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not reached")

    async def receive() -> Message:
        raise AssertionError("not reached")

    async def send(message: Message) -> None:
        raise AssertionError("not reached")

    scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
    coroutine = TetherMiddleware(app, registry=tether.Registry())(scope, receive, send)
    with pytest.raises(RuntimeError, match=r"needs an asyncio event loop.*trio"):
        coroutine.send(None)


async def test_handlers_find_the_registry_with_get_registry() -> None:
    registry = tether.Registry()
    found: list[tether.Registry] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        found.append(get_registry(Request(scope, receive)))
        await JSONResponse({"ok": True})(scope, receive, send)

    await FakeServer().run(TetherMiddleware(app, registry=registry))
    assert found == [registry]


def test_get_registry_without_the_middleware_names_it() -> None:
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": []})
    with pytest.raises(RuntimeError, match=r"add_middleware\(TetherMiddleware"):
        get_registry(request)


async def test_installed_twice_with_two_registries_is_refused(engine: Engine) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the app must not run under two registries")  # pragma: no cover

    inner = TetherMiddleware(app, registry=tether.Registry())
    with pytest.raises(RuntimeError, match="installed twice with two registries"):
        await FakeServer().run(TetherMiddleware(inner, registry=engine.registry))
    assert engine.registry.in_flight == 0


class _CatchingBase(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        try:
            return await call_next(request)
        except ValueError:
            return JSONResponse({"caught": True}, status_code=418)


class _CatchingASGI:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ValueError:
            await JSONResponse({"caught": True}, status_code=418)(scope, receive, send)


def _raising_app(registry: tether.Registry, **options: Any) -> Starlette:
    async def raises(request: Request) -> Response:
        registry.open()
        raise ValueError("a bug in the handler, after open()")

    app = Starlette(routes=[Route("/", raises)], **options)
    app.add_middleware(TetherMiddleware, registry=registry)
    return app


async def _get(app: ASGIApp) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with asyncio.timeout(10), httpx.AsyncClient(transport=transport) as client:
        return await client.get("http://app/", headers={"x-request-id": "job-7"})


@pytest.mark.parametrize("outer", [_CatchingBase, _CatchingASGI], ids=["base-http", "pure-asgi"])
async def test_a_user_middleware_outside_answers_the_errors_it_catches(outer: type) -> None:
    registry = tether.Registry()
    app = _raising_app(registry)
    app.add_middleware(outer)
    response = await _get(app)
    assert (response.status_code, response.json()) == (418, {"caught": True})
    assert registry.in_flight == 0


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"exception_handlers": {Exception: None}}, id="exception-handler"),
        pytest.param({"exception_handlers": {500: None}}, id="500-handler"),
        pytest.param({"debug": True}, id="debug"),
    ],
)
async def test_the_apps_own_500_answers_an_escaped_error(options: dict[str, Any]) -> None:
    async def handler(request: Request, exc: Exception) -> Response:
        return JSONResponse({"handled": type(exc).__name__}, status_code=500)

    handlers = options.get("exception_handlers")
    if handlers is not None:
        options = {"exception_handlers": dict.fromkeys(handlers, handler)}
    registry = tether.Registry()
    response = await _get(_raising_app(registry, **options))
    assert response.status_code == 500
    if handlers is not None:
        assert response.json() == {"handled": "ValueError"}
    else:  # Starlette's debug page, a traceback
        assert "ValueError" in response.text
    assert registry.in_flight == 0


async def test_an_escaped_error_gets_starlettes_plain_500_with_the_request_id() -> None:
    registry = tether.Registry()
    response = await _get(_raising_app(registry))
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    assert response.headers["x-request-id"] == "job-7"
    assert registry.in_flight == 0


async def test_a_stream_opened_while_a_receive_of_the_app_waits_that_is_then_cancelled_sees_a_leave(
    engine: Engine,
) -> None:
    """The app waits in ``receive()`` (Starlette's ``is_disconnected()``, a body read
    under a deadline), opens its stream meanwhile, then gives that receive up
    (cancelled): the middleware still watches for the client leaving."""
    engine.script = None

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        pending = asyncio.create_task(receive())
        await asyncio.sleep(0)  # one loop turn: it starts, and waits for the body
        assert server.receiving == 1
        stream = engine.registry.open()
        pending.cancel()  # given up, with nothing received
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        engine.submit(stream)
        result = await stream.result()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": repr(result).encode()})

    server = FakeServer(method="POST", body=())
    async with asyncio.TaskGroup() as tasks:
        running = tasks.create_task(server.run(TetherMiddleware(app, registry=engine.registry)))
        await engine.until(lambda: len(engine.submitted) == 1)
        server.disconnect()
        try:
            async with asyncio.timeout(2):
                await engine.until(lambda: len(engine.aborted_at) == 1)
        except TimeoutError:
            running.cancel()  # (the handler waits for good: the test ends, and says so)
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
