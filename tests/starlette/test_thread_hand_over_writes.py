"""With ``producer_writes``, an engine thread's outputs go out from its hand-over
(``deliver_many_threadsafe``), as a step's go out from ``deliver_many``: no task of the
handler's is woken per event. A send chain that needs a task is written by the
handler's task instead, every event once and in order (its bound is kept: see
``test_thread_engine_keeps_the_send_bound``)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether

from .conftest import one_stream_app, serve
from .test_send_chain_under_every_producer import (
    OUTPUTS,
    Producer,
    one_response,
    sse,
    timed_send,
)


def noting_writers(app: ASGIApp, writers: list[asyncio.Task[object] | None]) -> ASGIApp:
    """A pure ASGI middleware that notes the task (or none) sending each body message."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def noted(message: Message) -> None:
            if message["type"] == "http.response.body":
                writers.append(asyncio.current_task())
            await send(message)

        await app(scope, receive, noted)

    return wrapped


@pytest.mark.parametrize("producer_writes", [True, False])
async def test_an_engine_thread_s_events_go_out_from_its_hand_over(producer_writes: bool) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    writers: list[asyncio.Task[object] | None] = []
    app = noting_writers(one_stream_app(registry, opened, producer_writes=producer_writes), writers)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, "thread"))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])
    from_hand_overs = sum(writer is None for writer in writers)
    if producer_writes:  # (the first and the last go out with the handler's task)
        assert from_hand_overs >= OUTPUTS - 2, writers
    else:
        assert from_hand_overs == 0
    assert registry.in_flight == 0


async def test_a_send_chain_that_needs_a_task_gets_an_engine_thread_s_events_once_in_order() -> (
    None
):
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    writers: list[asyncio.Task[object] | None] = []
    inner = one_stream_app(registry, opened, producer_writes=True)
    app = noting_writers(timed_send(inner, 30), writers)
    async with serve(app, http="httptools") as (url, _):
        body = await one_response(url, opened, Producer(registry, "thread"))
    assert body == sse([{"n": n} for n in range(OUTPUTS)])  # each event once, in order
    assert None not in writers  # the handler's task wrote them all
    assert registry.in_flight == 0
    assert registry.stats().aborted == {}
