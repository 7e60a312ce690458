"""Outputs written from the producer's step: while the handler waits, ``deliver()`` drives
the server's ``send`` itself (``tether.http.Stepped``). A send that suspends there (flow
control, a middleware that awaits) is finished by the handler before anything else; one
that raises ends that response alone. Bytes stay in order and go out once, the send
timeout and the farewell still hold, and the send chain sees the request's context."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import socket
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import hypercorn.asyncio
import hypercorn.config
import pytest
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.raw_http import read_response
from tests._support.stalled import http_get

from .conftest import (
    BOUND,
    Engine,
    FakeServer,
    make_app,
    one_stream_app,
    requested,
    serve,
    stalled_request,
)

REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("REQUEST", default="none")
"""Set per request by an outer middleware, read by the send chain (as a tracer's span is)."""

OUTPUTS: Final = 200
PAD: Final = "x" * 2048
"""About 2 KiB per output: a few dozen fill the small socket buffers below."""


class GatedServer(FakeServer):
    """A fake server whose ``send`` waits while :attr:`gate` is closed, before it writes
    anything (as uvicorn waits for flow control): a write cut there wrote nothing."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def send(self, message: Message) -> None:
        if not self.gate.is_set():
            self.waiting += 1
            self.signal()
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        await super().send(message)


async def started(engine: Engine, server: FakeServer) -> str:
    """Wait until the stream's first output went out through the handler; its rid."""
    await engine.until(lambda: len(engine.submitted) == 1)
    rid = engine.submitted[0]
    engine.registry.deliver(rid, {"n": 1})
    await server.until(lambda: len(server.bodies) == 1)
    return rid


def setting_around_send(app: ASGIApp) -> ASGIApp:
    """A middleware that sets :data:`REQUEST` around each ``send`` (as a tracer does
    with its span): it resets it where it set it, even across a suspension."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_span(message: Message) -> None:
            token = REQUEST.set("sending")
            try:
                await send(message)
            finally:
                REQUEST.reset(token)  # (ValueError in another context than the set's)

        await app(scope, receive, send_in_span)

    return wrapped


async def test_a_send_that_suspends_in_deliver_is_finished_by_the_handler_before_the_rest() -> None:
    engine = Engine()
    engine.script = None
    server = GatedServer()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(setting_around_send(make_app(engine, producer_writes=True))))
        rid = await started(engine, server)
        server.gate.clear()  # the transport holds bytes back from now on
        assert engine.registry.deliver(rid, {"n": 2})  # its send suspends inside deliver()
        assert server.waiting == 1
        engine.registry.deliver(rid, {"n": 3})  # these wait for the handler, in order
        engine.registry.deliver(rid, {"n": 4})
        server.gate.set()
        await server.until(lambda: len(server.bodies) == 3)
        engine.registry.deliver(rid, {"n": 5}, finished=True)
    assert server.bodies == [
        (b'data: {"n":1}\n\n', True),
        (b'data: {"n":2}\n\n', True),
        (b'data: {"n":3}\n\ndata: {"n":4}\n\n', True),  # what piled up: one message
        (b'data: {"n":5}\n\ndata: [DONE]\n\n', False),  # the last, with the end
    ]
    assert engine.registry.in_flight == 0
    assert engine.aborted_at == {}
    await engine.stop()


async def test_a_send_begun_in_deliver_and_cut_by_the_server_is_sent_once_in_the_farewell() -> None:
    engine = Engine()
    engine.script = None
    server = GatedServer()
    task = asyncio.create_task(server.run(make_app(engine, producer_writes=True)))
    rid = await started(engine, server)
    server.gate.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.registry.deliver(rid, {"n": 2})  # begun, then the server cancels
        task.cancel()
        server.gate.set()  # (the farewell itself may go out)
        async with asyncio.timeout(BOUND):
            await asyncio.wait((task,))
        gc.collect()
    assert task.cancelled()
    assert [str(warning.message) for warning in caught] == []
    *_, (last, more) = server.bodies
    assert more is False
    assert last.startswith(b'data: {"n":2}\n\ndata: {"error":')  # the cut write, once
    assert last.endswith(b"data: [DONE]\n\n")
    assert [body for body, _ in server.bodies].count(b'data: {"n":2}\n\n') == 0
    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"cancelled": 1}
    await engine.stop()


async def test_a_client_gone_on_asgi_2_4_is_found_in_deliver_without_reaching_the_producer() -> (
    None
):
    engine = Engine()
    engine.script = None
    server = FakeServer(spec_version="2.4")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(server.run(make_app(engine, producer_writes=True)))
        rid = await started(engine, server)
        server.disconnect(tell_receive=False)  # only send() finds out: it raises OSError
        assert engine.registry.deliver(rid, {"n": 2})  # never raised to the producer
    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert list(engine.aborted_at) == [rid]
    assert engine.registry.deliver(rid, {"n": 3}) is False  # (late, counted)
    await engine.stop()


async def test_a_send_that_raises_in_deliver_fails_that_response_in_its_handler_alone() -> None:
    engine = Engine()
    engine.script = None
    server = FakeServer()
    broken = RuntimeError("a middleware's bug")

    def breaking(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            async def send_or_break(message: Message) -> None:
                if b'"n":2' in message.get("body", b""):
                    raise broken
                await send(message)

            await app(scope, receive, send_or_break)

        return wrapped

    task = asyncio.create_task(server.run(breaking(make_app(engine, producer_writes=True))))
    rid = await started(engine, server)
    assert engine.registry.deliver(rid, {"n": 2})  # the error is the handler's, not ours
    async with asyncio.timeout(BOUND):
        await asyncio.wait((task,))
    assert task.exception() is broken
    assert engine.registry.in_flight == 0
    assert list(engine.aborted_at) == [rid]
    await engine.stop()


class Recorder:
    """Pure ASGI, between tether's middleware and the server: for every body message,
    the task that called ``send``, the task it returned (or failed) in, and what the
    send chain read of the request's context variable."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.sends: list[dict[str, Any]] = []
        self.changed = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        REQUEST.set(scope["path"] + "?" + scope["query_string"].decode())

        async def recorded(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            note: dict[str, Any] = {"in": asyncio.current_task(), "request": REQUEST.get()}
            note["out"] = None
            self.sends.append(note)
            self.changed.set()
            try:
                await send(message)
            except BaseException as exc:
                note["failed"] = exc
                raise
            finally:
                note["out"] = asyncio.current_task()
                self.changed.set()

        await self.app(scope, receive, recorded)

    async def sent_more_than(self, count: int) -> None:
        await self.until(lambda: len(self.sends) > count)

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


@pytest.mark.both_loops
async def test_on_uvicorn_outputs_are_sent_inside_deliver_in_the_request_s_context() -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    recorder = Recorder(one_stream_app(registry, opened, producer_writes=True))
    async with (
        serve(recorder, http="httptools") as (url, _),
        requested(url, opened, "/one?mine") as (reader, rid),
    ):
        for n in range(20):  # each delivered once the last one went out
            sent = len(recorder.sends)
            assert registry.deliver(rid, {"n": n}, finished=n == 19)
            await recorder.sent_more_than(sent)
        _, body = await read_response(reader)
    assert body.decode().count("data: ") == 21
    here = asyncio.current_task()
    inside_deliver = [note for note in recorder.sends if note["in"] is here]
    assert len(inside_deliver) >= 15  # all but the first, the end, and a loop's stray wake
    assert {note["request"] for note in recorder.sends} == {"/one?mine"}
    assert registry.in_flight == 0


async def test_on_uvicorn_outputs_arrive_once_in_order_as_a_slow_reader_turns_fast() -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    recorder = Recorder(one_stream_app(registry, opened, producer_writes=True))
    async with (
        serve(recorder, http="httptools") as (url, _),
        stalled_request(url, opened, http_get("/one")) as (sock, rid),
    ):
        async with asyncio.timeout(BOUND):
            here = asyncio.current_task()
            delivered = 0

            async def deliver(finished: bool = False) -> None:
                nonlocal delivered
                registry.deliver(rid, {"i": delivered, "pad": PAD}, finished=finished)
                delivered += 1
                await asyncio.sleep(0)  # one output per step, as an engine's loop

            # None read: the buffers fill up until a send suspends inside deliver().
            while not any(n["in"] is here and n["out"] is None for n in recorder.sends):
                await deliver()
            for _ in range(OUTPUTS):  # these wait for the handler
                await deliver()
            reader, writer = await asyncio.open_connection(sock=sock)  # reading now
            for _ in range(OUTPUTS):
                await deliver()
            await deliver(finished=True)
            _, body = await read_response(reader)
            writer.close()
    frames = body.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    indices = [int(frame.split(b'"i":')[1].split(b",")[0]) for frame in frames[:-2]]
    assert indices == list(range(delivered))
    assert any(note["in"] is here and note["out"] is not here for note in recorder.sends)
    assert registry.in_flight == 0


async def test_on_uvicorn_the_send_timeout_ends_a_send_that_suspended_inside_deliver() -> None:
    gone = asyncio.Event()
    registry = tether.Registry(lambda rid: gone.set())
    opened: asyncio.Queue[str] = asyncio.Queue()
    recorder = Recorder(one_stream_app(registry, opened, producer_writes=True, send_timeout=0.2))
    async with (
        serve(recorder, http="httptools") as (url, _),
        stalled_request(url, opened, http_get("/one")) as (_, rid),
    ):
        async with asyncio.timeout(BOUND):
            here = asyncio.current_task()
            n = 0
            while not any(note["out"] is None for note in recorder.sends):
                sent = len(recorder.sends)
                assert registry.deliver(rid, {"i": n, "pad": PAD})  # never raises
                await recorder.sent_more_than(sent)
                n += 1
            stuck = recorder.sends[-1]
            assert stuck["in"] is here  # it suspended inside deliver()
            await gone.wait()  # the client counts as gone: the request is aborted
            await recorder.until(lambda: stuck["out"] is not None)
    assert isinstance(stuck.get("failed"), asyncio.CancelledError)
    assert registry.in_flight == 0
    assert registry.stats().aborted == {"client_disconnected": 1}


async def test_on_uvicorn_a_silent_stream_pings_after_the_last_output_sent_inside_deliver() -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    recorder = Recorder(one_stream_app(registry, opened, producer_writes=True, ping_interval=0.1))
    async with (
        serve(recorder, http="httptools") as (url, _),
        requested(url, opened) as (reader, rid),
    ):
        for n in range(30):  # the workload: an output every 10 ms, for 3 intervals
            registry.deliver(rid, {"n": n})
            await asyncio.sleep(0.01)
        await recorder.sent_more_than(30)  # silent now: a ping
        registry.deliver(rid, {"n": 30}, finished=True)
        _, body = await read_response(reader)
    pings = body.split(b"\n\n").index(b": ping")
    assert pings >= 30, body[:200]  # not one while the outputs came
    assert registry.in_flight == 0


class Passing(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


@pytest.fixture
async def hypercorn_url() -> AsyncIterator[Callable[[ASGIApp], Any]]:
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(app: ASGIApp) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = hypercorn.config.Config()
        config.bind = [f"fd://{sock.detach()}"]  # (hypercorn owns and closes it)
        config.accesslog = config.errorlog = None
        stop = asyncio.Event()
        task = asyncio.create_task(hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        stops.append((stop, task))
        return f"http://127.0.0.1:{port}"

    yield start
    for stop, task in stops:
        stop.set()
        async with asyncio.timeout(BOUND):
            await task


@pytest.mark.parametrize("stack", ["hypercorn", "uvicorn-base-http-middleware"])
async def test_every_output_arrives_in_order_where_sends_suspend_each_time(
    stack: str, hypercorn_url: Callable[[ASGIApp], Any]
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = one_stream_app(registry, opened, producer_writes=True)

    async def exchange(url: str) -> bytes:
        async with requested(url, opened) as (reader, rid):
            for n in range(50):
                registry.deliver(rid, {"n": n}, finished=n == 49)
                await asyncio.sleep(0)
            return (await read_response(reader))[1]

    if stack == "hypercorn":
        body = await exchange(await hypercorn_url(app))
    else:
        app.user_middleware.insert(0, Middleware(Passing))
        async with serve(app) as (url, _):
            body = await exchange(url)
    expected = "".join(f'data: {{"n":{n}}}\n\n' for n in range(50)) + "data: [DONE]\n\n"
    assert body.decode() == expected
    assert registry.in_flight == 0
