"""The default byte budget weighs what producers really deliver, whatever its shape.

``max_pending_bytes`` (16 MiB by default) must see a deeply nested output (an
OpenAI tool-call delta, ``choices[0].delta.tool_calls[0].function.arguments``, five
levels) and an object output (a dataclass, an engine's ``RequestOutput``): a weight
that stopped a few levels down or trusted the shallow ``sys.getsizeof`` would let
such outputs wait unbounded with ``merge`` (the advised setup, where the count
bound is off), and 1,024 of any size without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import tether

from .conftest import AbortLog

MEGABYTE = 1_000_000


@dataclasses.dataclass(frozen=True)
class Delta:
    """An engine output as an object, as many engines deliver them."""

    text: str


def _tool_call_delta() -> dict[str, Any]:
    arguments = "x" * MEGABYTE
    return {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": arguments}}]}}]}


def _object_delta() -> Delta:
    return Delta("x" * MEGABYTE)


@pytest.mark.parametrize(
    "make", [_tool_call_delta, _object_delta], ids=["tool-call-delta", "dataclass-output"]
)
async def test_the_default_byte_budget_bounds_outputs_of_any_shape(
    make: Callable[[], object],
) -> None:
    registry = tether.Registry()  # the defaults: max_pending_bytes=16 MiB
    stream = registry.open()
    for _ in range(40):  # 40 MB for a consumer that reads nothing
        registry.deliver(stream.rid, make())
    assert stream.rid not in registry, "40 MB wait under a 16 MiB budget"
    with pytest.raises(tether.ConsumerTooSlow):
        async with asyncio.timeout(10):
            await stream.next_ready()


async def test_a_merged_object_backlog_is_bounded_by_the_default_byte_budget() -> None:
    def merge(older: Delta, newer: Delta) -> Delta:
        return Delta(older.text + newer.text)

    registry = tether.Registry(merge=merge)
    stream = registry.open()
    for _ in range(40):
        registry.deliver(stream.rid, _object_delta())
    assert stream.rid not in registry, "a 40 MB merged backlog under a 16 MiB budget"
    await stream.aclose()


async def test_the_byte_budget_bounds_a_backlog_whose_large_outputs_fall_between_weighed_ones(
    aborts: AbortLog,
) -> None:
    """``max_pending_bytes`` bounds what waits whatever the outputs' sizes: large
    outputs among small ones are weighed too (were only the outputs at 2, 4, 8, ...
    waiting weighed, 57 kB of these would wait under a 1 kB budget)."""
    registry = tether.Registry(aborts, max_pending_bytes=1000, sizeof=len)
    stream = registry.open()
    large = "x" * 1000
    delivered = 0
    for count in range(1, 65):
        tiny = count & (count - 1) == 0  # (the counts a sampled weight looked at)
        registry.deliver(stream.rid, "t" if tiny else large)
        delivered += 1
        if stream.rid not in registry:
            break
    assert stream.rid not in registry
    assert delivered <= 3, "more than the budget and one output waited"
    await stream.aclose()
