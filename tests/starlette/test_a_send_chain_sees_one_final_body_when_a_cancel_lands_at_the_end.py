"""Promised (``Exchange.run``: a cancellation of the handler "ends the response first
(the farewell)", i.e. only a response not yet ended; DESIGN invariant 11, every request
ends exactly once; docs/starlette.md: a send wrapper sees "the same farewell" after the
write loop moved to a task of its own): a server's ``send`` chain gets one final body
message (``more_body=False``) per response."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tests._support.raw_http import read_response
from tests._support.servers import serve

from .conftest import BOUND, one_stream_app, requested
from .test_send_chain_under_every_producer import hypercorn_serving


class CancelsAtTheEnd:
    """An outer middleware: records every body message, and asks for the request's
    task to be cancelled in the loop turn after the final one went out."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bodies: list[Message] = []
        self.changed = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.body":
                self.bodies.append(message)
                self.changed.set()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                asyncio.get_running_loop().call_soon(task.cancel)

        with contextlib.suppress(asyncio.CancelledError):  # (the cancel it asked for)
            await self.app(scope, receive, recording)

    async def until(self, count: int) -> None:
        async with asyncio.timeout(BOUND):
            while len(self.bodies) < count:
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def on(server: str, app: ASGIApp) -> AsyncIterator[str]:
    if server == "hypercorn":
        async with hypercorn_serving(app) as url:
            yield url
    else:
        async with serve(app) as (url, _):
            yield url


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
async def test_a_send_chain_sees_one_final_body_when_a_cancel_lands_just_after_it(
    server: str,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    outer = CancelsAtTheEnd(one_stream_app(registry, opened))
    async with on(server, outer) as url, requested(url, opened) as (reader, rid):
        for n in range(10):
            registry.deliver(rid, n, finished=n == 9)
            await outer.until(n + 1)  # written before the next one: woken for each
        async with asyncio.timeout(BOUND):
            status, body = await read_response(reader)
    finals: list[Any] = [m for m in outer.bodies if not m.get("more_body")]
    assert status == 200
    assert body.count(b"[DONE]") == 1
    assert len(finals) == 1, f"final body messages sent: {finals}"
    assert registry.in_flight == 0
