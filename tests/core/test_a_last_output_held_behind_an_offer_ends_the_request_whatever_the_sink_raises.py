"""A last output (``finished=True``) delivered from inside a sink ends the request once
the sink answers: "a last output delivered there ends the request only then". When
the sink answers with ``CancelledError`` while the producer's own task is being
cancelled (its step called ``cancel()`` on it: the cancellation goes on, as
documented), ``put`` folds what was held but drops ``offered()``'s answer, which says
the end is the caller's to settle: the request never ends (invariants 2, 11)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether


async def test_a_held_last_output_ends_the_request_when_the_producer_is_cancelled() -> None:
    registry = tether.Registry()
    stream = registry.open()

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, "last", finished=True)  # held behind the offered one
        raise asyncio.CancelledError()

    assert stream.set_sink(sink)

    async def engine() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]  (its step cancels itself)
        registry.deliver(stream.rid, "x")

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(engine())
    assert registry.in_flight == 0, "the producer's last output was delivered; the request lives on"
    assert [output async for output in stream] == ["x", "last"]
