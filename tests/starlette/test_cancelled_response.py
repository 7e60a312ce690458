"""A handler the server cancels (uvicorn does, at the end of its graceful-shutdown
period) still ends its response, then lets the cancellation go on.

Driven on the fake ASGI server of conftest, through the middleware and the test app,
so the exact messages are visible.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message

from .conftest import BOUND, HANG, Engine, FakeServer, make_app


def events(body: bytes) -> list[object]:
    """The ``data:`` payloads of an SSE body, ``[DONE]`` as a string."""
    found: list[object] = []
    for frame in body.decode().split("\n\n"):
        if frame.startswith("data: "):
            data = frame.removeprefix("data: ")
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


async def cancelled_once(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end (bounded); it must end cancelled."""
    task.cancel()
    async with asyncio.timeout(BOUND):
        await asyncio.wait((task,))
    assert task.cancelled(), "the cancellation was swallowed"


@pytest.mark.parametrize("query", ["", "batch=2"], ids=["stream", "batch"])
async def test_a_stream_cancelled_mid_stream_ends_with_an_error_event_and_the_terminal_frame(
    engine: Engine, query: str
) -> None:
    engine.script = [{"n": 1}, HANG]
    server = FakeServer(query=query)
    task = asyncio.create_task(server.run(make_app(engine)))
    expected = 2 if query else 1
    await server.until(lambda: len(events(b"".join(body for body, _ in server.bodies))) >= expected)

    await cancelled_once(task)

    *streamed, (last, more) = server.bodies
    assert all(more for _, more in streamed)
    assert more is False
    error, done = events(last)
    assert isinstance(error, dict)
    assert error["error"]["code"] == 503
    assert done == "[DONE]"
    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"cancelled": len(engine.submitted)}
    assert sorted(engine.aborted_at) == sorted(engine.submitted)


async def test_a_stream_cancelled_in_a_write_resends_that_write_before_its_end(
    engine: Engine,
) -> None:
    """As uvicorn does, the fake server writes nothing of a ``send`` cancelled in its
    wait for flow control: that chunk is sent again, so no output is lost."""
    gate = asyncio.Event()
    engine.script = [{"n": 1}, gate, {"n": 2}, HANG]
    server = FakeServer()
    blocked = asyncio.Event()
    resumed = asyncio.Event()

    async def flow_controlled_send(message: Message) -> None:
        if len(server.bodies) == 1 and not resumed.is_set():  # the second body blocks
            blocked.set()
            await resumed.wait()
        await server.send(message)

    app = make_app(engine)
    task = asyncio.create_task(app(server.scope, server.receive, flow_controlled_send))
    await server.until(lambda: len(server.bodies) == 1)
    gate.set()
    async with asyncio.timeout(BOUND):
        await blocked.wait()

    task.cancel()
    resumed.set()  # the client reads again: the end of the response can be written
    async with asyncio.timeout(BOUND):
        await asyncio.wait((task,))

    assert task.cancelled()
    body = b"".join(body for body, _ in server.bodies)
    assert server.bodies[-1][1] is False
    first, second, error, done = events(body)
    assert (first, second) == ({"n": 1}, {"n": 2})
    assert isinstance(error, dict)
    assert error["error"]["code"] == 503
    assert done == "[DONE]"
    assert engine.registry.in_flight == 0


async def test_a_stream_cancelled_while_its_client_reads_nothing_still_ends_in_time(
    engine: Engine,
) -> None:
    """A client that stopped reading blocks every write: the end of the response is
    abandoned after a short bound, and the cancellation goes on."""
    engine.script = [{"n": 1}, HANG]
    server = FakeServer()
    blocked = asyncio.Event()

    async def stalled_send(message: Message) -> None:
        if server.bodies:
            blocked.set()
            await asyncio.Event().wait()  # never drains
        await server.send(message)

    app = make_app(engine)
    task = asyncio.create_task(app(server.scope, server.receive, stalled_send))
    await server.until(lambda: len(server.bodies) == 1)
    engine.registry.deliver(engine.submitted[0], {"n": 2})
    async with asyncio.timeout(BOUND):
        await blocked.wait()

    await cancelled_once(task)

    assert server.bodies == [(b'data: {"n":1}\n\n', True)]
    assert engine.registry.in_flight == 0


async def test_a_stream_cancelled_before_its_status_line_went_out_gets_a_json_error_status(
    engine: Engine,
) -> None:
    """uvicorn writes nothing of a ``send`` cancelled in its flow-control wait: when
    that send was the status line, the client gets a whole JSON answer instead."""
    engine.script = [{"n": 1}, HANG]
    server = FakeServer()
    blocked = asyncio.Event()
    resumed = asyncio.Event()

    async def flow_controlled_send(message: Message) -> None:
        if not resumed.is_set():  # the status line blocks
            blocked.set()
            await resumed.wait()
        await server.send(message)

    app = make_app(engine)
    task = asyncio.create_task(app(server.scope, server.receive, flow_controlled_send))
    async with asyncio.timeout(BOUND):
        await blocked.wait()

    task.cancel()
    resumed.set()
    async with asyncio.timeout(BOUND):
        await asyncio.wait((task,))

    assert task.cancelled()
    start, body = server.sent
    assert start["status"] == 503
    assert (b"content-type", b"application/json") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == 503
    assert engine.registry.in_flight == 0


async def test_a_json_wait_cancelled_by_the_server_gets_a_json_error_status(
    engine: Engine,
) -> None:
    engine.script = [HANG]
    server = FakeServer(path="/json")
    task = asyncio.create_task(server.run(make_app(engine)))
    await engine.until(lambda: len(engine.submitted) == 1)

    await cancelled_once(task)

    assert engine.registry.in_flight == 0
    start, body = server.sent
    assert start["status"] == 503
    assert json.loads(body["body"])["error"]["code"] == 503
