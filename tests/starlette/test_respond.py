"""respond() and its response on a fake ASGI server: ownership of the source, headers,
and the error that names the missing middleware."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator

import pytest
from starlette.requests import Request
from starlette.types import Message

import tether
import tether_starlette
from tether_starlette import respond

from .conftest import BOUND, Engine, FakeServer, make_app


def test_exports_only_the_entry_points_sorted() -> None:
    assert tether_starlette.__all__ == [
        "REGISTRY_KEY",
        "TetherMiddleware",
        "get_registry",
        "json_errors",
        "lifespan",
        "respond",
        "resume",
    ]
    assert tether_starlette.__all__ == sorted(tether_starlette.__all__)


@contextlib.contextmanager
def request_scope(server: FakeServer) -> Iterator[tether.RequestScope]:
    """The request's scope, as the middleware opens it and marks it in the ASGI scope."""
    with tether.RequestScope() as scope:
        server.scope["tether.scope"] = scope
        yield scope


async def test_respond_without_the_middleware_names_it_and_closes_the_source(
    engine: Engine,
) -> None:
    server = FakeServer()
    with pytest.raises(RuntimeError, match=r"needs TetherMiddleware.*add_middleware"):
        await server.run(make_app(engine, middleware=0))

    assert list(engine.aborted_at) == engine.submitted
    assert engine.registry.in_flight == 0


async def test_respond_with_bad_options_raises_and_still_closes_the_source(
    engine: Engine,
) -> None:
    server = FakeServer()
    stream = engine.registry.open()
    with request_scope(server), pytest.raises(ValueError, match="ping_interval"):
        await respond(Request(server.scope), stream, streaming=True, ping_interval=0)
    assert stream.finished
    assert engine.registry.in_flight == 0


async def test_response_closes_its_source_when_its_task_is_cancelled_in_a_write(
    engine: Engine,
) -> None:
    server = FakeServer()
    stream = engine.registry.open()  # outside any request scope: only the response owns it
    engine.registry.deliver(stream.rid, {"n": 1})
    with request_scope(server):
        response = await respond(Request(server.scope), stream, streaming=True)
    stalled = asyncio.Event()

    async def stalling_send(message: Message) -> None:
        await server.send(message)
        if server.bodies:  # a write that never drains
            stalled.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(response(server.scope, server.receive, stalling_send))
    async with asyncio.timeout(BOUND):
        await stalled.wait()
        task.cancel()
        await asyncio.wait((task,))

    assert task.cancelled()
    assert list(engine.aborted_at) == [stream.rid]
    assert engine.registry.in_flight == 0


async def test_extra_headers_are_added_and_may_override(engine: Engine) -> None:
    server = FakeServer()
    stream = engine.registry.open()
    engine.registry.deliver(stream.rid, {"n": 1}, finished=True)
    with request_scope(server):
        response = await respond(
            Request(server.scope),
            stream,
            streaming=True,
            headers={"X-Request-Id": "r-1", "Cache-Control": "no-store"},
        )
    await response(server.scope, server.receive, server.send)

    headers = server.sent[0]["headers"]
    assert (b"x-request-id", b"r-1") in headers
    assert [value for name, value in headers if name == b"cache-control"] == [b"no-store"]
    assert server.bodies == [(b'data: {"n":1}\n\ndata: [DONE]\n\n', False)]


async def test_a_stream_that_ends_before_its_first_output_is_a_complete_answer(
    engine: Engine,
) -> None:
    server = FakeServer()
    batch = engine.registry.open_batch(2, keep_going=True)
    for rid in batch.rids:
        engine.registry.fail(rid, ValueError("no"))
    with request_scope(server):
        response = await respond(Request(server.scope), batch, streaming=False)
    await response(server.scope, server.receive, server.send)

    assert server.sent[0]["status"] == 200
    body = server.bodies[0][0]
    assert (b"content-length", str(len(body)).encode()) in server.sent[0]["headers"]
    assert body.count(b'"type":"ProducerError"') == 2


async def test_a_stream_s_list_result_is_answered_whole_with_no_call_per_item(
    engine: Engine,
) -> None:
    """A merged list (token ids folded with ``operator.add``) is the stream's own value:
    encoded as it is, not walked item by item in Python (only a keep-going batch's
    results can hold an error to write in place)."""
    server = FakeServer()
    stream = engine.registry.open()
    tokens = list(range(20_000))
    engine.registry.deliver(stream.rid, tokens, finished=True)
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    with request_scope(server):
        sys.setprofile(count)
        try:
            response = await respond(Request(server.scope), stream, streaming=False)
        finally:
            sys.setprofile(None)
    await response(server.scope, server.receive, server.send)
    assert server.sent[0]["status"] == 200
    assert json.loads(server.bodies[0][0]) == tokens
    assert calls < 1_000, f"{calls} Python calls to answer a list of {len(tokens)}"
