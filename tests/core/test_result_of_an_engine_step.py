"""``result()`` of requests fed by engine steps (``deliver_many``): whatever the
producer delivers while the reader waits is folded, never lost, never read twice,
and counted: the last output (or, with ``merge``, every output merged) is the
result, requests in the same step keep to their own, and an observer is told how
many outputs each got."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
from tests._support.observers import Recorder


def _concat(older: list[Any], newer: list[Any]) -> list[Any]:
    return older + newer


@pytest.mark.parametrize("merged", [False, True])
async def test_each_waiting_result_folds_its_own_outputs_of_every_step(merged: bool) -> None:
    registry = tether.Registry(merge=_concat if merged else None)
    seen = Recorder()
    registry.add_observer(seen)
    streams = [registry.open() for _ in range(3)]
    steps = 50
    # the first output of each before anyone waits: it is read into the result too
    registry.deliver_many([(stream.rid, [stream.rid, 0], False) for stream in streams])
    results = [asyncio.create_task(stream.result()) for stream in streams]
    for step in range(1, steps):
        await asyncio.sleep(0)  # the engine yields between steps (the readers wait from the first)
        finished = step == steps - 1
        live = registry.deliver_many(
            [(stream.rid, [stream.rid, step], finished) for stream in streams]
        )
        assert live == len(streams)
    async with asyncio.timeout(10):
        outcomes = await asyncio.gather(*results)
    for stream, result in zip(streams, outcomes, strict=True):
        if merged:
            expected = [item for step in range(steps) for item in (stream.rid, step)]
        else:
            expected = [stream.rid, steps - 1]
        assert result == expected
        assert seen.ends[stream.rid].outputs == steps
    assert registry.in_flight == 0
