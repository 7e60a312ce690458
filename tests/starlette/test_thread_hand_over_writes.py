"""``producer_writes="threads"``: an engine thread's outputs go out from its hand-over
(``deliver_many_threadsafe``, a loop callback), as a step's go out from
``deliver_many``: no task of the handler's is woken per event. It is the app's word
that its send chain needs no task: a chain that does fails the response there, loudly
(each event sent at most once, the request ended), never silently. With ``True`` a
thread's hand-over is written by the handler's task."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tether_starlette import TetherMiddleware

from .conftest import BOUND, one_stream_app, requested, serve
from .test_send_chain_under_every_producer import (
    OUTPUTS,
    Producer,
    one_response,
    sse,
    timed_send,
)


def noting_writers(app: ASGIApp, writers: list[asyncio.Task[Any] | None]) -> ASGIApp:
    """A pure ASGI middleware that notes the task (or none) sending each body message."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def noted(message: Message) -> None:
            if message["type"] == "http.response.body":
                writers.append(asyncio.current_task())
            await send(message)

        await app(scope, receive, noted)

    return wrapped


@pytest.mark.parametrize("writes", ["threads", True, False])
async def test_an_engine_thread_s_events_go_out_from_its_hand_over_when_told(
    writes: bool | Literal["threads"],
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    writers: list[asyncio.Task[Any] | None] = []
    app = noting_writers(one_stream_app(registry, opened, producer_writes=writes), writers)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, "thread"))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    from_hand_overs = sum(writer is None for writer in writers)
    if writes == "threads":  # (the first and the last go out with the handler's task)
        assert from_hand_overs >= OUTPUTS - 2, writers
    else:
        assert from_hand_overs == 0
    assert registry.in_flight == 0


async def _raw_body(reader: asyncio.StreamReader) -> bytes:
    """What a chunked body held when its connection ended, whole chunks only."""
    async with asyncio.timeout(BOUND):
        data = await reader.read()  # (to the end of the connection)
    body = b""
    rest = data.partition(b"\r\n\r\n")[2]
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if not size or len(rest) < size + 2:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return body


async def test_a_send_chain_that_needs_a_task_fails_a_threads_response_loudly() -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    app = timed_send(one_stream_app(registry, opened, producer_writes="threads"), BOUND)
    outputs = [{"n": n} for n in range(OUTPUTS)]
    async with (
        serve(app, http="httptools") as (url, _),
        requested(url, opened) as (reader, rid),
    ):
        run = asyncio.create_task(Producer(registry, "thread").run(rid, outputs))
        body = await _raw_body(reader)
        await run
    whole = sse(outputs)
    assert body != whole  # cut...
    assert whole.startswith(body)  # ... each event at most once, in order
    assert registry.in_flight == 0


def test_producer_writes_is_true_false_or_threads() -> None:
    registry = tether.Registry()
    app = one_stream_app(registry, asyncio.Queue())
    for writes in (True, False, "threads"):
        TetherMiddleware(app, registry=registry, producer_writes=writes)
    for odd in ("yes", "True", 1, None):
        with pytest.raises(ValueError, match="producer_writes"):
            TetherMiddleware(app, registry=registry, producer_writes=odd)  # type: ignore[arg-type]
