"""Requests that share one uvicorn connection, and bodies the app leaves unread.

uvicorn starts a connection's next request from inside the previous request's
``send()`` when requests are pipelined, and (on asyncio's loop) from a reader
callback that carries the context of the request that last resumed reading, after
a body over 64 KiB. Either way the new request's task inherits the previous
request's context. Every test runs on h11 and httptools, on asyncio's loop and on
uvloop, against a real server on 127.0.0.1, with a raw socket so that requests
really share one connection.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests._support.raw_http import connection, leave, read_response, request

from .conftest import HANG, Changes, Engine, make_app, serve

pytestmark = pytest.mark.both_loops

HTTP: Final = [pytest.param("h11", id="h11"), pytest.param("httptools", id="httptools")]

ABORT_BOUND: Final = 1.0
"""Seconds within which a client leaving must reach the producer's ``on_abort``."""


class ReceiveCounter(Changes):
    """An ASGI wrapper that counts the body messages the server hands to the app
    (to the middleware's reader, under tether), so a test knows what was read."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__()
        self.app = app
        self.body_messages = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self.body_messages += 1
                self.signal()
            return message

        await self.app(scope, counted, send)


@pytest.mark.parametrize("http", HTTP)
async def test_pipelined_json_requests_each_get_their_own_scope_and_result(
    engine: Engine, http: str
) -> None:
    engine.script = None
    async with serve(make_app(engine), http=http) as (url, _), connection(url) as (reader, writer):
        writer.write(request("GET", "/json") + request("GET", "/json"))
        await engine.until(lambda: len(engine.submitted) == 1)
        first = engine.submitted[0]
        engine.registry.deliver(first, {"rid": first}, finished=True)
        first_answer = await read_response(reader)
        await engine.until(lambda: len(engine.submitted) == 2)
        second = engine.submitted[1]
        engine.registry.deliver(second, {"rid": second}, finished=True)
        second_answer = await read_response(reader)

    assert first_answer == (200, json.dumps({"rid": first}, separators=(",", ":")).encode())
    assert second_answer == (200, json.dumps({"rid": second}, separators=(",", ":")).encode())
    assert engine.aborted_at == {}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("http", HTTP)
async def test_pipelined_stream_then_json_each_get_their_own_answer(
    engine: Engine, http: str
) -> None:
    engine.script = None
    async with serve(make_app(engine), http=http) as (url, _), connection(url) as (reader, writer):
        writer.write(request("GET", "/stream") + request("GET", "/json"))
        await engine.until(lambda: len(engine.submitted) == 1)
        engine.registry.deliver(engine.submitted[0], {"n": 1}, finished=True)
        streamed = await read_response(reader)
        await engine.until(lambda: len(engine.submitted) == 2)
        engine.registry.deliver(engine.submitted[1], {"n": 2}, finished=True)
        answered = await read_response(reader)

    assert streamed == (200, b'data: {"n":1}\n\ndata: [DONE]\n\n')
    assert answered == (200, b'{"n":2}')
    assert engine.aborted_at == {}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("http", HTTP)
async def test_client_leaving_during_a_pipelined_request_aborts_that_request_alone(
    engine: Engine, http: str
) -> None:
    engine.script = None
    async with serve(make_app(engine), http=http) as (url, _), connection(url) as (reader, writer):
        writer.write(request("GET", "/json") + request("GET", "/json"))
        await engine.until(lambda: len(engine.submitted) == 1)
        first = engine.submitted[0]
        engine.registry.deliver(first, {"n": 1}, finished=True)
        first_answer = await read_response(reader)
        await engine.until(lambda: len(engine.submitted) == 2)
        second = engine.submitted[1]
        left_at = await leave(writer)
        await engine.until(lambda: second in engine.aborted_at)

    assert first_answer == (200, b'{"n":1}')
    assert engine.aborted_at[second] - left_at < ABORT_BOUND
    assert list(engine.aborted_at) == [second]
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("http", HTTP)
async def test_pipelined_requests_refused_by_the_registry_each_get_503(http: str) -> None:
    engine = Engine(max_in_flight=1)
    held = engine.registry.open()
    try:
        async with (
            serve(make_app(engine), http=http) as (url, _),
            connection(url) as (reader, writer),
        ):
            writer.write(request("GET", "/json") + request("GET", "/stream"))
            answers = [await read_response(reader), await read_response(reader)]
    finally:
        await held.aclose()
        await engine.stop()

    assert [status for status, _ in answers] == [503, 503]
    assert [json.loads(body)["error"]["type"] for _, body in answers] == ["Overloaded"] * 2


@pytest.mark.parametrize("http", HTTP)
async def test_request_after_a_large_upload_on_the_same_connection_notices_its_client_leaving(
    engine: Engine, http: str
) -> None:
    engine.script = [HANG]
    upload = bytes(range(256)) * 512  # 128 KiB: uvicorn pauses reading past 64 KiB
    async with serve(make_app(engine), http=http) as (url, _), connection(url) as (reader, writer):
        writer.write(request("POST", "/body", upload))
        status, body = await read_response(reader)
        writer.write(request("GET", "/json"))
        await engine.until(lambda: len(engine.submitted) == 1)
        left_at = await leave(writer)
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert (status, json.loads(body)["sha256"]) == (200, hashlib.sha256(upload).hexdigest())
    assert engine.aborted_at[engine.submitted[0]] - left_at < ABORT_BOUND
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0


@pytest.mark.parametrize("http", HTTP)
async def test_client_leaving_while_its_body_is_unread_aborts_the_work(
    engine: Engine, http: str
) -> None:
    engine.script = [HANG]
    segments = [b"a" * 1000, b"b" * 1000, b"c" * 1000]
    app = ReceiveCounter(make_app(engine))
    async with serve(app, http=http) as (url, _), connection(url) as (_, writer):
        # /json opens its stream and waits for the result without reading the body.
        writer.write(request("POST", "/json", segments[0], length=3000))
        await engine.until(lambda: len(engine.submitted) == 1)
        await app.until(lambda: app.body_messages >= 1)
        writer.write(segments[1])  # a TCP segment of its own, read once the first was
        await app.until(lambda: app.body_messages >= 2)
        writer.write(segments[2])
        await writer.drain()
        left_at = await leave(writer)
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert engine.aborted_at[engine.submitted[0]] - left_at < ABORT_BOUND
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
    assert engine.registry.in_flight == 0
