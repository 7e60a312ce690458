"""With ``producer_writes``, an engine thread's steps (``deliver_many_threadsafe``) are
written as the loop takes them in, as a step on the loop's are: past the first, an
output does not wake its handler's task to be written. Every event still arrives once, in
order, through every middleware that wraps ``send``."""

from __future__ import annotations

import asyncio
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.direct_writes import sse_values
from tests._support.raw_http import read_response

from .conftest import BOUND, one_stream_app, requested, serve
from .test_send_chain_under_every_producer import Producer

STEPS: Final = 40


def writers_recorded(
    app: ASGIApp, handler: list[asyncio.Task[object] | None], by: list[bool]
) -> ASGIApp:
    """A pure ASGI middleware around ``app``: notes the request's task, and for each
    body message with bytes whether a task other than that one sent it."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        handler.append(asyncio.current_task())

        async def noting(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                by.append(asyncio.current_task() not in (handler[-1], None))
            await send(message)

        await app(scope, receive, noting)

    return wrapped


async def test_an_engine_thread_s_steps_are_written_without_waking_the_handler() -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    handler: list[asyncio.Task[object] | None] = []
    by_another_task: list[bool] = []
    app = writers_recorded(
        one_stream_app(registry, opened, producer_writes=True), handler, by_another_task
    )
    outputs = [{"n": n, "text": "é✓𝄞"} for n in range(STEPS)]
    async with serve(app, http="httptools") as (url, _), requested(url, opened) as (reader, rid):
        run = asyncio.create_task(Producer(registry, "thread").run(rid, outputs))
        async with asyncio.timeout(BOUND):
            status, body = await read_response(reader)
            await run
    assert status == 200
    assert sse_values(body) == [*outputs, "[DONE]"]
    # The first step is declined in the loop's callback (its handler writes it), and
    # the last output goes out with the end, from the handler; the rest are the
    # engine's (37 of 40 here; half leaves room for a loaded machine's turns).
    assert sum(by_another_task) >= STEPS // 2, by_another_task
    assert registry.in_flight == 0
