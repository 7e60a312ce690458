"""``write_checked`` is an optional method of a ``Direct``: an object that has an attribute
of that name that is not callable (a flag, a count) is written through ``write()``, and
one whose ``write_checked`` raises loses nothing: every event reaches the client once,
in order, then the terminal frame."""

from __future__ import annotations

import asyncio

import pytest

import tether
import tether.http
from tests._support.direct_writes import DirectTransport, sse_values, started_and_parked


class WithAFlag(DirectTransport):
    write_checked = 0  # (a count, say: not the method)


class Raising(DirectTransport):
    def write_checked(self, chunk: bytes) -> bool:
        raise OSError("the send chain broke")


@pytest.mark.parametrize(("transport", "direct"), [(WithAFlag, 5), (Raising, 0)])
async def test_every_event_reaches_the_client_once_in_order(
    transport: type[DirectTransport], direct: int
) -> None:
    registry = tether.Registry()
    async with asyncio.timeout(10):
        stream, _, writer, running = await started_and_parked(registry, transport())
        for n in range(5):
            registry.deliver(stream.rid, n)
        registry.deliver(stream.rid, 5, finished=True)
        await running
    assert sse_values(writer.body()) == ["first", 0, 1, 2, 3, 4, 5, "[DONE]"]
    assert len(writer.sink.written) == direct
