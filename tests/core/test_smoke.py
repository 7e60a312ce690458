"""First-light checks of the registry; the full core suite lives beside this file."""

from __future__ import annotations

import tether


async def test_stream_delivers_outputs_in_order_and_frees_its_rid() -> None:
    registry = tether.Registry()
    stream = registry.open()
    registry.deliver(stream.rid, 1)
    registry.deliver(stream.rid, 2, finished=True)
    assert registry.in_flight == 0
    assert [output async for output in stream] == [1, 2]
