"""Promised (DESIGN invariant 11, ``Exchange.run``'s docstring): a response ends with
exactly one terminal frame; a cancellation of the handler ends the response *first*
(the farewell) only if it was not over."""

from __future__ import annotations

import asyncio
from typing import Any

import tether
import tether.http
from tests._support.direct_writes import sse_values
from tests.core.test_the_woken_write_loop_for_every_source import (
    BOUND,
    _ends_once,
    _Recorder,
    _started,
)


class _CancelsAfterTheLastWrite(_Recorder):
    """Asks, during the terminal write, for the handler's cancellation in the next loop
    turn: a server's cancel arriving just as the response ended."""

    def __init__(self) -> None:
        super().__init__()
        self.handler: asyncio.Task[Any] | None = None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.handler = self.handler or asyncio.current_task()
        await super().write(chunk, last)
        if last and self.handler is not None:
            asyncio.get_running_loop().call_soon(self.handler.cancel)


async def test_a_cancel_after_the_last_write_of_a_woken_stream_adds_no_second_terminal_frame() -> (
    None
):
    registry = tether.Registry()
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 0)
    writer = _CancelsAfterTheLastWrite()
    running = await _started(exchange, writer)
    total = 2 * tether.http.WOKEN_IN_PLACE + 2 if hasattr(tether.http, "WOKEN_IN_PLACE") else 10
    for n in range(1, total):
        await writer.until(lambda n=n: n <= len(writer.framed))  # type: ignore[misc]
        registry.deliver(stream.rid, n, finished=n == total - 1)
    async with asyncio.timeout(BOUND):
        await asyncio.gather(running, return_exceptions=True)
    assert sse_values(writer.body()) == [*range(total), "[DONE]"], writer.body()
    _ends_once(writer)
    assert registry.in_flight == 0
